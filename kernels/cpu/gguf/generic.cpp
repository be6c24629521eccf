// The generic GGUF kernels (generic.h). Per 8-row tile and 32-weight block: the codes are
// unpacked into 8 "registers" of 32 int8 bytes exactly as the x86 kernels hold them (formats.h:
// byte 4n + j of register r is weight first(r) + j of row n), each multiplied against the
// activation bytes it meets there, lane by lane, and summed per row n over its 4 bytes. Every
// loop is element-wise over fixed 32-byte registers, so compilers vectorise it for whatever
// the target has (SSE2, NEON); with Arm's dot product the 4-byte sums are one sdot per 16 bytes.
#include "generic.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "../common.h"
#include "activations.h"
#include "formats.h"

#if defined(__ARM_NEON) && defined(__ARM_FEATURE_DOTPROD)
#include <arm_neon.h>
#define LOCALLLM_GGUF_DOTPROD 1
#endif

#ifdef __clang__
// the float part is written as explicit fused multiply-adds and single roundings, as the x86
// kernels' intrinsics are: clang would otherwise fuse a * b + c on its own
#pragma STDC FP_CONTRACT OFF
#endif

namespace localllm_cpu::gguf::generic {

const char* name() {
#ifdef LOCALLLM_GGUF_DOTPROD
  return "generic (Arm dot product)";
#else
  return "generic";
#endif
}

const char* x86_name() {
#if !defined(__AVX2__) || !defined(__F16C__) || !defined(__FMA__)
  return nullptr;
#elif defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AMX_INT8__)
  return "x86 AVX-512 VNNI + AMX";
#elif defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return "x86 AVX-512 VNNI";
#elif defined(__AVXVNNI__)
  return "x86 AVX2 VNNI";
#else
  return "x86 AVX2";
#endif
}

namespace {

// a * b + c rounded once where the CPU has a fused multiply-add (every Arm64, x86 with FMA:
// the x86 kernels' _mm256_fmadd_ps, so the results match); without one a library fma is
// ~20x slower, and there are no x86 kernels to match anyway.
inline float fmadd(float a, float b, float c) {
#if defined(__FMA__) || defined(__aarch64__) || defined(__FP_FAST_FMAF)
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

// IEEE half to float, exactly (what F16C's vcvtph2ps gives).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: man * 2^-24, exact in fp32
    const float v = static_cast<float>(man) * 5.9604644775390625e-8f;
    return __builtin_bit_cast(float, __builtin_bit_cast(uint32_t, v) | sign);
  }
  const uint32_t bits = exp == 0x1f ? sign | 0x7f800000u | (man << 13) : sign | ((exp + 112) << 23) | (man << 13);
  return __builtin_bit_cast(float, bits);
}

// 2^(e - 128), denormal below e = 2 (ggml's GGML_E8M0_TO_FP32_HALF, as isa.h's e8m0_half)
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
  return __builtin_bit_cast(float, bits);
}

template <class Fm>
constexpr int first_of(int r) {  // the first weight of register r (formats.h)
  return Fm::codes == Codes::kInt8 ? 4 * r : 8 * (r / 2) + 4 * (r % 2);
}

using Regs = int8_t[8][32];
using Wide = int16_t[8][32];  // Regs widened once per block, for every row's 16-bit products

// w16 = w as int16 (not needed with Arm's dot product, which multiplies bytes)
inline void widen(const Regs& w, Wide& w16) {
#ifndef LOCALLLM_GGUF_DOTPROD
  for (int r = 0; r < 8; ++r)
    for (int k = 0; k < 32; ++k) w16[r][k] = w[r][k];
#else
  (void)w, (void)w16;
#endif
}

// Block b's codes as the x86 kernels' registers (unpack.h's unpack_codes): unsigned 0..63 for
// nibble codes (they fit int8), the table's signed values, or the file's int8 codes.
template <class Fm>
inline void unpack(const TileView<Fm>& v, int64_t b, Regs& w) {
  if constexpr (Fm::codes == Codes::kInt8) {
    std::memcpy(w, v.codes + b * 256, 256);
  } else {
    const uint8_t* c = v.codes + b * 128;
    uint8_t q[8][32];
    for (int r = 0; r < 8; ++r)
      for (int k = 0; k < 32; ++k) {
        const uint8_t raw = c[32 * (r / 2) + k];
        q[r][k] = r % 2 ? raw >> 4 : raw & 15;
        if constexpr (Fm::hi_bits == 1) q[r][k] |= ((v.hi[b * 32 + k] >> r) & 1) << 4;
        if constexpr (Fm::hi_bits == 2) q[r][k] |= ((v.hi[b * 64 + 32 * (r / 4) + k] >> (2 * (r % 4))) & 3) << 4;
      }
    if constexpr (Fm::codes == Codes::kTable) {
#ifdef LOCALLLM_GGUF_DOTPROD
      const int8x16_t table = vld1q_s8(Fm::table);
      for (int r = 0; r < 8; ++r)
        for (int h = 0; h < 2; ++h) vst1q_s8(w[r] + 16 * h, vqtbl1q_s8(table, vld1q_u8(q[r] + 16 * h)));
#else
      for (int r = 0; r < 8; ++r)
        for (int k = 0; k < 32; ++k) w[r][k] = Fm::table[q[r][k]];
#endif
    } else {
      std::memcpy(w, q, 256);
    }
  }
}

// dv[h][n], cv[h][n]: w = dv * q + cv for half h of block b, row n (unpack.h's block_scales,
// the same fp32 operations).
template <class Fm>
inline void scales(const TileView<Fm>& v, int64_t b, float (&dv)[2][8], float (&cv)[2][8]) {
  const int64_t sb = b / (Fm::super / 32);
  for (int n = 0; n < 8; ++n) {
    if constexpr (Fm::scale == Scale::kD) {
      dv[0][n] = half_to_float(v.d[b * 8 + n]);
      cv[0][n] = dv[0][n] * static_cast<float>(Fm::offset);
    } else if constexpr (Fm::scale == Scale::kDM) {
      dv[0][n] = half_to_float(v.d[b * 16 + n]);
      cv[0][n] = half_to_float(v.d[b * 16 + 8 + n]);
    } else if constexpr (Fm::scale == Scale::kKQuant) {
      const float d = half_to_float(v.d[sb * 16 + n]), dmin = half_to_float(v.d[sb * 16 + 8 + n]);
      dv[0][n] = d * static_cast<float>(v.scales[b * 16 + n]);
      cv[0][n] = -(dmin * static_cast<float>(v.scales[b * 16 + 8 + n]));
    } else if constexpr (Fm::scale == Scale::kK6) {
      const float d = half_to_float(v.d[sb * 8 + n]);
      for (int h = 0; h < 2; ++h) {
        dv[h][n] = d * static_cast<float>(static_cast<int8_t>(v.scales[b * 16 + 8 * h + n]));
        cv[h][n] = dv[h][n] * -32.f;
      }
    } else if constexpr (Fm::scale == Scale::kIQ4XS) {
      dv[0][n] = half_to_float(v.d[sb * 8 + n]) * static_cast<float>(static_cast<int8_t>(v.scales[b * 8 + n]));
      cv[0][n] = 0.f;
    } else if constexpr (Fm::scale == Scale::kE8M0) {
      dv[0][n] = e8m0_half(v.scales[b * 8 + n]);
      cv[0][n] = 0.f;
    }
    if constexpr (!Fm::halves) dv[1][n] = dv[0][n], cv[1][n] = cv[0][n];
  }
}

// The activation each register byte meets, widened to 16 bits: for a row's block,
// xe[32 r + 4 n + j] = x[first(r) + j] (made once per call, read by every tile). Unused with
// Arm's dot product, which broadcasts the 4 bytes itself.
template <class Fm>
void expand(const Activations& a, int64_t levels, std::vector<int16_t>& xe) {
#ifndef LOCALLLM_GGUF_DOTPROD
  const int64_t blocks = levels * a.M * (a.K / 32);
  xe.resize(std::max<size_t>(xe.size(), static_cast<size_t>(blocks * 256)));
  int16_t* out = xe.data();
  parallel_for(0, blocks, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int8_t* x = a.xq + i * 32;  // xq is [levels, M, K]: block i in that order
      for (int r = 0; r < 8; ++r)
        for (int k = 0; k < 32; ++k) out[i * 256 + 32 * r + k] = x[first_of<Fm>(r) + k % 4];
    }
  });
#else
  (void)a, (void)levels, (void)xe;
#endif
}

// isum[h][n]: sum over the registers of half h (all 8 in half 0 unless Fm::halves) of row n's
// 4-byte products. x: the row's 32 activation bytes of the block; xe: their expansion.
template <class Fm>
inline void dot(const Regs& w, const Wide& w16, const int8_t* x, const int16_t* xe, int32_t (&isum)[2][8]) {
  constexpr int H = Fm::halves ? 2 : 1;
#ifdef LOCALLLM_GGUF_DOTPROD
  (void)xe, (void)w16;
  int32x4_t acc[H][2];
  for (int h = 0; h < H; ++h) acc[h][0] = acc[h][1] = vdupq_n_s32(0);
  for (int r = 0; r < 8; ++r) {
    const int h = Fm::halves ? r / 4 : 0;
    int32_t x4;
    std::memcpy(&x4, x + first_of<Fm>(r), 4);
    const int8x16_t xv = vreinterpretq_s8_s32(vdupq_n_s32(x4));
    acc[h][0] = vdotq_s32(acc[h][0], vld1q_s8(w[r]), xv);
    acc[h][1] = vdotq_s32(acc[h][1], vld1q_s8(w[r] + 16), xv);
  }
  for (int h = 0; h < H; ++h) vst1q_s32(isum[h], acc[h][0]), vst1q_s32(isum[h] + 4, acc[h][1]);
#else
  (void)x, (void)w;
  // products summed over G registers in 16 bits, then widened once: |sum| <= 4 * 63 * 127 for
  // unsigned codes (6 bits at most), 2 * 128 * 127 for signed ones (activations are within
  // +-127), both below 2^15
  constexpr int G = Fm::is_signed ? 2 : 4;
  int32_t acc[H][32] = {};
  for (int r0 = 0; r0 < 8; r0 += G) {
    int16_t s[32] = {};
    for (int r = r0; r < r0 + G; ++r)
      for (int k = 0; k < 32; ++k) s[k] = static_cast<int16_t>(s[k] + w16[r][k] * xe[32 * r + k]);
    const int h = Fm::halves ? r0 / 4 : 0;
    for (int k = 0; k < 32; ++k) acc[h][k] += s[k];
  }
  for (int h = 0; h < H; ++h)
    for (int n = 0; n < 8; ++n) isum[h][n] = acc[h][4 * n] + acc[h][4 * n + 1] + acc[h][4 * n + 2] + acc[h][4 * n + 3];
#endif
}

constexpr int64_t kRows = 16;  // activation rows per work item: a tile's unpacked block serves them all

// Output tile t x activation rows [m0, m0 + rows) (rows <= kRows) of `a` (its M: the level
// stride), into y's rows [m0, ...) (row stride N) and columns [8t, 8t + 8).
template <class Fm>
void tile_rows(const Packed& w, int64_t t, int64_t nb, const Activations& a, const int16_t* xe, int64_t levels,
               int64_t m0, int64_t rows, float* y, int64_t N) {
  const TileView<Fm> v(w, t, nb);
  float acc[kRows][8] = {};
  for (int64_t b = 0; b < nb; ++b) {
    __builtin_prefetch(v.codes + (b + 8) * Fm::code_bytes);
    Regs q;
    unpack<Fm>(v, b, q);
    Wide q16;
    widen(q, q16);
    float dv[2][8], cv[2][8];
    scales<Fm>(v, b, dv, cv);
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t m = m0 + i;
      int32_t isum[2][2][8];  // [level][half][row n]
      float dx[2];
      for (int64_t lv = 0; lv < levels; ++lv) {
        const int64_t row = lv * a.M + m;
        dot<Fm>(q, q16, a.xq + row * a.K + b * 32, xe + (row * nb + b) * 256, isum[lv]);
        dx[lv] = a.xd[row * nb + b];
      }
      // kernel.h's tile_kernel float part, operation for operation (per lane n: the loops
      // run over n innermost, so they vectorise)
      float* out = acc[i];
      if constexpr (Fm::halves) {
        const float* xs = a.xs16 + m * 2 * nb + 2 * b;
        float f0[8] = {}, f1[8] = {};
        for (int64_t lv = 0; lv < levels; ++lv)
          for (int n = 0; n < 8; ++n) {
            f0[n] = fmadd(static_cast<float>(isum[lv][0][n]), dx[lv], f0[n]);
            f1[n] = fmadd(static_cast<float>(isum[lv][1][n]), dx[lv], f1[n]);
          }
        for (int n = 0; n < 8; ++n) {
          out[n] = fmadd(f0[n], dv[0][n], out[n]);
          out[n] = fmadd(f1[n], dv[1][n], out[n]);
          out[n] = fmadd(cv[0][n], xs[0], out[n]);
          out[n] = fmadd(cv[1][n], xs[1], out[n]);
        }
      } else {
        const float xs = a.xs[m * nb + b];
        float f[8] = {};
        for (int64_t lv = 0; lv < levels; ++lv)
          for (int n = 0; n < 8; ++n) f[n] = fmadd(static_cast<float>(isum[lv][0][n]), dx[lv], f[n]);
        for (int n = 0; n < 8; ++n) {
          out[n] = fmadd(f[n], dv[0][n], out[n]);
          out[n] = fmadd(cv[0][n], xs, out[n]);
        }
      }
    }
  }
  for (int64_t i = 0; i < rows; ++i) std::memcpy(y + (m0 + i) * N + t * kTileN, acc[i], sizeof(acc[i]));
}

// One run of work items over the experts that got rows (a plain linear: one expert, all rows).
struct Group {
  Packed w;
  int64_t r0, rows, first_item;  // its rows [r0, r0 + rows) of `a` and y
};

template <class Fm>
void run(const std::vector<Group>& groups, int64_t items, int64_t tiles, int64_t nb, const Activations& a,
         int64_t levels, float* y, int64_t N) {
  thread_local std::vector<int16_t> xe;
  expand<Fm>(a, levels, xe);
  const int16_t* xep = xe.data();
  parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    size_t g = 0;
    for (int64_t i = begin; i < end; ++i) {
      while (g + 1 < groups.size() && groups[g + 1].first_item <= i) ++g;
      const Group& gr = groups[g];
      const int64_t j = i - gr.first_item, per_tile = (gr.rows + kRows - 1) / kRows;
      const int64_t t = j / per_tile, m0 = gr.r0 + (j % per_tile) * kRows;
      tile_rows<Fm>(gr.w, t, nb, a, xep, levels, m0, std::min(kRows, gr.r0 + gr.rows - m0), y, N);
    }
  });
  (void)tiles;
}

template <class Fm>
void dequantize_type(const Packed& w, int64_t N, int64_t K, bool bf16, void* out) {
  const int64_t tiles = N / kTileN, nb = K / 32;
  float* of = bf16 ? nullptr : static_cast<float*>(out);
  uint16_t* ob = bf16 ? static_cast<uint16_t*>(out) : nullptr;
  // a code offset (Q4_0's -8, Q6_K's -32) goes on the code, as the gguf package does (dequantize.cpp)
  constexpr bool centred = Fm::scale != Scale::kDM && Fm::scale != Scale::kKQuant;
  constexpr float code_off = Fm::scale == Scale::kD ? Fm::offset : Fm::scale == Scale::kK6 ? -32.f : 0.f;
  parallel_for(0, tiles * nb, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / nb, b = i % nb;
      const TileView<Fm> v(w, t, nb);
      Regs q;
      unpack<Fm>(v, b, q);
      float dv[2][8], cv[2][8];
      scales<Fm>(v, b, dv, cv);
      for (int64_t n = 0; n < kTileN; ++n) {
        float wf[32];
        for (int r = 0; r < 8; ++r)
          for (int j = 0; j < 4; ++j) {
            const int k = first_of<Fm>(r) + j;
            const float qf = static_cast<float>(q[r][4 * n + j]);
            wf[k] = centred ? dv[k / 16][n] * (qf + code_off) : dv[k / 16][n] * qf + cv[k / 16][n];
          }
        const int64_t off = (t * kTileN + n) * K + b * 32;
        if (!bf16) {
          std::memcpy(of + off, wf, sizeof(wf));
        } else {
          for (int j = 0; j < 32; ++j) {  // round to nearest even
            const uint32_t bits = __builtin_bit_cast(uint32_t, wf[j]);
            ob[off + j] = static_cast<uint16_t>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
          }
        }
      }
    }
  });
}

}  // namespace

void linear(const float* x, int64_t M, int64_t K, const Packed& w, int64_t N, int64_t type, int64_t levels, float* y) {
  const int64_t nb = K / 32, tiles = N / kTileN;
  const Activations a = quantize_rows(x, M, K, levels);
  const std::vector<Group> groups{{w, 0, M, 0}};
  const int64_t items = tiles * ((M + kRows - 1) / kRows);
  const bool known = with_format(type, [&](auto fm) { run<decltype(fm)>(groups, items, tiles, nb, a, levels, y, N); });
  LOCALLLM_CHECK(known, "GGUF block type ", type, " has no CPU kernel");
}

void linear_grouped(const float* x, int64_t R, int64_t K, const Packed& w, int64_t E, int64_t N,
                    const int64_t* offsets, int64_t type, int64_t levels, float* y) {
  const Layout l = layout(type);
  LOCALLLM_CHECK(l.block_weights > 0, "GGUF block type ", type, " has no CPU kernel");
  if (R == 0) return;
  const int64_t nb = K / 32, tiles = N / kTileN, d_row = K / l.super * l.d_halves;
  const Activations a = quantize_rows(x, R, K, levels);  // once for every expert's rows
  std::vector<Group> groups;
  int64_t items = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = offsets[e], n = offsets[e + 1] - r0;
    if (n == 0) continue;
    const int64_t t0 = e * tiles;
    const Packed we{w.codes + t0 * nb * l.code_bytes, w.hi + t0 * nb * l.hi_bytes, w.scales + t0 * nb * l.scale_bytes,
                    w.d + t0 * d_row};
    groups.push_back({we, r0, n, items});
    items += tiles * ((n + kRows - 1) / kRows);
  }
  with_format(type, [&](auto fm) { run<decltype(fm)>(groups, items, tiles, nb, a, levels, y, N); });
}

void dequantize(const Packed& w, int64_t N, int64_t K, int64_t type, bool bf16, void* out) {
  const bool known = with_format(type, [&](auto fm) { dequantize_type<decltype(fm)>(w, N, K, bf16, out); });
  LOCALLLM_CHECK(known, "GGUF block type ", type, " has no CPU kernel");
}

}  // namespace localllm_cpu::gguf::generic
