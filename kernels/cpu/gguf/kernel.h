// The GGUF linear's inner kernel, templated on the packed layout (Fm, formats.h), the ISA
// (Isa, isa.h) and the activation tile (TM rows, L levels): one register of Isa::kTiles
// weight tiles against TM activation rows, over the whole K. Instantiated per type in the
// linear_*.cpp files, which linear.cpp dispatches to.
#pragma once

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "activations.h"
#include "unpack.h"

#ifdef LOCALLLM_GGUF_KERNELS
namespace localllm_cpu::gguf {

// How far ahead of the block being multiplied its weight stream is prefetched: the layer
// matrices are small (0.2-1 MB) and separate, so the hardware prefetcher, which stops at each
// 4 KB page, would restart cold on every one of them.
constexpr int64_t kPrefetchBytes = 1024;

// Output tiles [t, t + Isa::kTiles) x activation rows [m0, m0 + TM), in L levels: R = L * TM
// chains of integer multiply-adds, each split in A accumulators (a layout with two scales per
// block keeps its halves apart; else even and odd chunks when there are few chains, so ~4
// chains are in flight), then per block the float part: per row,
//   acc += dv * (sum over levels of dx * codes dot) + cv * (sum over levels of dx * code sum).
template <class Fm, class Isa, int TM, int L>
void tile_kernel(const Packed& w, int64_t t, int64_t nb, const Activations& a, int64_t m0, float* y, int64_t N) {
  using VI = typename Isa::VI;
  using VF = typename Isa::VF;
  constexpr int R = TM * L;
  constexpr int A = Fm::halves ? 2 : (R >= 4 ? 1 : (R >= 2 ? 2 : 4));
  constexpr bool offset_signed = Fm::is_signed && Isa::kSignedByOffset;
  const Tiles<Fm, Isa> tiles(w, t, nb);
  VF acc[TM];
  for (int m = 0; m < TM; ++m) acc[m] = VF{};
  const int8_t* xrow[R];
  const float* dxrow[R];
  for (int r = 0; r < R; ++r) {  // r = level * TM + row
    const int64_t lv = r / TM, m = m0 + r % TM;
    xrow[r] = a.xq + (lv * a.M + m) * a.K;
    dxrow[r] = a.xd + (lv * a.M + m) * nb;
  }
  for (int64_t b = 0; b < nb; ++b) {
    for (int i = 0; i < Isa::kTiles; ++i) {
      const char* c = reinterpret_cast<const char*>(tiles.codes[i] + b * Fm::code_bytes + kPrefetchBytes);
      for (int64_t o = 0; o < Fm::code_bytes; o += 64) _mm_prefetch(c + o, _MM_HINT_T0);
      if constexpr (Fm::hi_bytes > 0)
        _mm_prefetch(reinterpret_cast<const char*>(tiles.hi[i] + b * Fm::hi_bytes + kPrefetchBytes / 4 * Fm::hi_bits),
                     _MM_HINT_T0);
    }
    VI wv[8];
    unpack_codes<Fm, Isa, offset_signed>(tiles, b, wv);
    if constexpr (offset_signed && Fm::codes == Codes::kInt8)  // a table gave offset codes already
      for (int p = 0; p < 8; ++p) wv[p] = Isa::xor_(wv[p], Isa::set1(0x80));
    VI isum[R][A];
    for (int r = 0; r < R; ++r)
      for (int k = 0; k < A; ++k) isum[r][k] = Isa::zero();
    for (int p = 0; p < 8; ++p) {
      // register p holds weights 4p.. (int8 codes) or 8(p/2) + 4(p%2).. (nibbles): p < 4 is the
      // block's first 16 weights either way
      const int first = Fm::codes == Codes::kInt8 ? 4 * p : 8 * (p / 2) + 4 * (p % 2);
      const int k = Fm::halves ? p / 4 : p % A;
      for (int r = 0; r < R; ++r) {
        int32_t x4;
        std::memcpy(&x4, xrow[r] + b * 32 + first, 4);
        if constexpr (Fm::is_signed && !Isa::kSignedByOffset) {
          isum[r][k] = Isa::madd_signed(isum[r][k], wv[p], Isa::bcast32(x4));
        } else {
          isum[r][k] = Isa::madd(isum[r][k], wv[p], Isa::bcast32(x4));
        }
      }
    }
    VF dv[2], cv[2];
    block_scales<Fm, Isa>(tiles, b, dv, cv);
    if constexpr (offset_signed)
      for (int h = 0; h < 2; ++h) cv[h] = Isa::fma(dv[h], Isa::set1f(-128.f), cv[h]);
    // explicit FMAs, the same in every instantiation: a row's result must not depend on the
    // row tile it lands in (so on the batch), which contraction left to the compiler broke
    for (int m = 0; m < TM; ++m) {
      const float* xs = a.xs16 + (m0 + m) * 2 * nb + 2 * b;
      if constexpr (Fm::halves) {
        VF f0 = VF{}, f1 = VF{};
        for (int lv = 0; lv < L; ++lv) {
          const int r = lv * TM + m;
          f0 = Isa::fma(Isa::cvt(isum[r][0]), Isa::set1f(dxrow[r][b]), f0);
          f1 = Isa::fma(Isa::cvt(isum[r][1]), Isa::set1f(dxrow[r][b]), f1);
        }
        acc[m] = Isa::fma(f0, dv[0], acc[m]);
        acc[m] = Isa::fma(f1, dv[1], acc[m]);
        acc[m] = Isa::fma(cv[0], Isa::set1f(xs[0]), acc[m]);
        acc[m] = Isa::fma(cv[1], Isa::set1f(xs[1]), acc[m]);
      } else {
        VF f = VF{};
        for (int lv = 0; lv < L; ++lv) {
          const int r = lv * TM + m;
          VI sum = isum[r][0];
          for (int k = 1; k < A; ++k) sum = Isa::add32(sum, isum[r][k]);
          f = Isa::fma(Isa::cvt(sum), Isa::set1f(dxrow[r][b]), f);
        }
        acc[m] = Isa::fma(f, dv[0], acc[m]);
        acc[m] = Isa::fma(cv[0], Isa::set1f(a.xs[(m0 + m) * nb + b]), acc[m]);
      }
    }
  }
  for (int m = 0; m < TM; ++m) Isa::store(y + (m0 + m) * N + t * kTileN, acc[m]);
}

using TileFn = void (*)(const Packed&, int64_t, int64_t, const Activations&, int64_t, float*, int64_t);

#if defined(LOCALLLM_GGUF_AVX512) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define LOCALLLM_GGUF_AMX 1
// AMX (Sapphire Rapids and later) for batches of 16 rows: one tile multiply of 16 activation
// rows by 32 weights of 16 output rows replaces 16 x 8 vpdpbusd, and the unpacking of a
// register pair of weight tiles is done once per call, not once per 4 rows. The integer sums
// are the VNNI kernel's (the same offset codes, exact int32 arithmetic, in any order) and the
// float part below is tile_kernel's operation for operation, so a row's result is bit for
// bit the same whichever kernel takes it (the batch invariance tests hold across both).
constexpr int64_t kAmxRows = 16;

// The fewest rows the AMX kernel takes, 0 when this process may not use AMX tiles (Linux
// hands out the tile state on request) or LOCALLLM_GGUF_AMX=0; LOCALLLM_GGUF_AMX=N sets it.
int64_t amx_min_rows();

struct alignas(64) AmxConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: 0, 1 the activations of levels 0, 1 (16 rows x 32 / H bytes); 2 the weights (32 / H
// weights as 8 / H rows of 16 outputs x 4 bytes: an unpacked register per row, first(r) = 4r);
// 4, 5 the int32 sums of levels 0, 1 (16 x 16). H = 2 for a layout with a scale per 16-weight half.
template <class Fm>
void amx_configure(int rows) {
  constexpr int H = Fm::halves ? 2 : 1;
  AmxConfig c;
  c.rows[0] = c.rows[1] = rows, c.colsb[0] = c.colsb[1] = 32 / H;
  c.rows[2] = 8 / H, c.colsb[2] = 64;
  c.rows[4] = c.rows[5] = rows, c.colsb[4] = c.colsb[5] = 64;
  // GCC 12 does not count ldtilecfg as reading c and drops the stores above without this
  asm volatile("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}

// Output tiles t, t + 1 x activation rows [0, M), L levels, in groups of 16 rows (the last
// may have fewer: a tile of fewer rows). `wbuf`: scratch of nb * 512 bytes for the unpacked
// weights (the B tiles), filled once and read by every group. Sets its own tile configuration.
template <class Fm, int L>
void amx_kernel(const Packed& w, int64_t t, int64_t nb, const Activations& a, float* y, int64_t N, uint8_t* wbuf) {
  using Isa = Avx512;
  using VI = typename Isa::VI;
  using VF = typename Isa::VF;
  constexpr int H = Fm::halves ? 2 : 1;
  constexpr bool offset_signed = Fm::is_signed;  // Avx512: signed codes as code + 128
  const Tiles<Fm, Isa> tiles(w, t, nb);
  for (int64_t b = 0; b < nb; ++b) {
    VI wv[8];
    unpack_codes<Fm, Isa, offset_signed>(tiles, b, wv);
    if constexpr (offset_signed && Fm::codes == Codes::kInt8)
      for (int p = 0; p < 8; ++p) wv[p] = Isa::xor_(wv[p], Isa::set1(0x80));
    for (int p = 0; p < 8; ++p) _mm512_storeu_si512(wbuf + b * 512 + 64 * p, wv[p]);
  }
  alignas(64) int32_t sums[H][L][kAmxRows][16];
  // The next register pair's weights (this thread's next unit, at::parallel_for's ranges being
  // contiguous) are prefetched while this one computes: its unpacking above otherwise waits on
  // memory with the tile unit idle (measured on a 262k-vocabulary Q8_0 head at 16 rows: 30.6 ->
  // 26.5 ms).
  const bool next = (t + 2) * kTileN < N;
  const Tiles<Fm, Isa> ahead(w, next ? t + 2 : t, nb);
  // one group of rows [mg, mg + rows); Full: rows == 16 known at compile time, so the 16
  // accumulators stay in registers (with a runtime count they went through the stack)
  auto group = [&](int64_t g, int rows, auto full) {
    constexpr bool Full = decltype(full)::value;
    const int64_t mg = g * kAmxRows;
    VF acc[kAmxRows];
    for (int m = 0; m < kAmxRows; ++m) acc[m] = VF{};
    for (int64_t b = 0; b < nb; ++b) {
      if (g == 0 && next)
        for (int i = 0; i < Isa::kTiles; ++i) {
          const char* c = reinterpret_cast<const char*>(ahead.codes[i] + b * Fm::code_bytes);
          for (int64_t o = 0; o < Fm::code_bytes; o += 64) _mm_prefetch(c + o, _MM_HINT_T0);
          if constexpr (Fm::hi_bytes > 0)
            for (int64_t o = 0; o < Fm::hi_bytes; o += 64)
              _mm_prefetch(reinterpret_cast<const char*>(ahead.hi[i] + b * Fm::hi_bytes + o), _MM_HINT_T0);
        }
      for (int h = 0; h < H; ++h) {
        const int64_t col = b * 32 + h * (32 / H);
        _tile_loadd(2, wbuf + b * 512 + h * 256, 64);
        _tile_loadd(0, a.xq + mg * a.K + col, a.K);
        _tile_zero(4);
        _tile_dpbsud(4, 0, 2);
        if constexpr (L == 2) {
          _tile_loadd(1, a.xq + (a.M + mg) * a.K + col, a.K);
          _tile_zero(5);
          _tile_dpbsud(5, 1, 2);
        }
        _tile_stored(4, sums[h][0], 64);
        if constexpr (L == 2) _tile_stored(5, sums[h][L - 1], 64);
      }
      VF dv[2], cv[2];
      block_scales<Fm, Isa>(tiles, b, dv, cv);
      if constexpr (offset_signed)
        for (int h = 0; h < 2; ++h) cv[h] = Isa::fma(dv[h], Isa::set1f(-128.f), cv[h]);
#pragma GCC unroll 16
      for (int m = 0; m < kAmxRows; ++m) {  // tile_kernel's float part, the same operations
        if constexpr (!Full)
          if (m >= rows) break;
        const int64_t row = mg + m;
        if constexpr (Fm::halves) {
          const float* xs = a.xs16 + row * 2 * nb + 2 * b;
          VF f0 = VF{}, f1 = VF{};
          for (int lv = 0; lv < L; ++lv) {
            const float dx = a.xd[(lv * a.M + row) * nb + b];
            f0 = Isa::fma(Isa::cvt(_mm512_load_si512(sums[0][lv][m])), Isa::set1f(dx), f0);
            f1 = Isa::fma(Isa::cvt(_mm512_load_si512(sums[1][lv][m])), Isa::set1f(dx), f1);
          }
          acc[m] = Isa::fma(f0, dv[0], acc[m]);
          acc[m] = Isa::fma(f1, dv[1], acc[m]);
          acc[m] = Isa::fma(cv[0], Isa::set1f(xs[0]), acc[m]);
          acc[m] = Isa::fma(cv[1], Isa::set1f(xs[1]), acc[m]);
        } else {
          VF f = VF{};
          for (int lv = 0; lv < L; ++lv)
            f = Isa::fma(Isa::cvt(_mm512_load_si512(sums[0][lv][m])), Isa::set1f(a.xd[(lv * a.M + row) * nb + b]), f);
          acc[m] = Isa::fma(f, dv[0], acc[m]);
          acc[m] = Isa::fma(cv[0], Isa::set1f(a.xs[row * nb + b]), acc[m]);
        }
      }
    }
    for (int m = 0; m < (Full ? static_cast<int>(kAmxRows) : rows); ++m)
      Isa::store(y + (mg + m) * N + t * kTileN, acc[m]);
  };
  const int64_t groups = (a.M + kAmxRows - 1) / kAmxRows;
  for (int64_t g = 0; g < groups; ++g) {
    const int rows = static_cast<int>(std::min(kAmxRows, a.M - g * kAmxRows));
    if (g == 0 || rows < kAmxRows) amx_configure<Fm>(rows);
    if (rows == kAmxRows) {
      group(g, rows, std::true_type{});
    } else {
      group(g, rows, std::false_type{});
    }
  }
}

using AmxFn = void (*)(const Packed&, int64_t, int64_t, const Activations&, float*, int64_t, uint8_t*);
#endif

// The kernels of one layout: [ISA: 0 Avx2, 1 Avx512][rows 1, 2, 4 -> 0, 1, 2][levels - 1];
// with AMX, the 16-row kernels [levels - 1] and their tile configuration.
struct TileKernels {
  TileFn fn[2][3][2];
#ifdef LOCALLLM_GGUF_AMX
  AmxFn amx[2];
#endif
};

template <class Fm, class Isa>
void fill_isa(TileKernels& k, int i) {
  k.fn[i][0][0] = &tile_kernel<Fm, Isa, 1, 1>;
  k.fn[i][0][1] = &tile_kernel<Fm, Isa, 1, 2>;
  k.fn[i][1][0] = &tile_kernel<Fm, Isa, 2, 1>;
  k.fn[i][1][1] = &tile_kernel<Fm, Isa, 2, 2>;
  k.fn[i][2][0] = &tile_kernel<Fm, Isa, 4, 1>;
  k.fn[i][2][1] = &tile_kernel<Fm, Isa, 4, 2>;
}

template <class Fm>
TileKernels tile_kernels() {
  TileKernels k{};
  fill_isa<Fm, Avx2>(k, 0);
#ifdef LOCALLLM_GGUF_AVX512
  fill_isa<Fm, Avx512>(k, 1);
#endif
#ifdef LOCALLLM_GGUF_AMX
  k.amx[0] = &amx_kernel<Fm, 1>;
  k.amx[1] = &amx_kernel<Fm, 2>;
#endif
  return k;
}

// Defined in linear_<family>.cpp, one per group of types, so their instantiations compile in
// parallel: the kernels of `type`, or false when the group has no such type.
bool tile_kernels_legacy(int64_t type, TileKernels& out);  // Q4_0, Q4_1, Q5_0, Q5_1, Q8_0
bool tile_kernels_kquant(int64_t type, TileKernels& out);  // Q4_K, Q5_K, Q6_K
bool tile_kernels_table(int64_t type, TileKernels& out);   // IQ4_NL, IQ4_XS, MXFP4

}  // namespace localllm_cpu::gguf
#endif  // LOCALLLM_GGUF_KERNELS
