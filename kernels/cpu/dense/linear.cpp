// The batch-invariant float linear (linear.h states the reduction order). Speed comes from a
// tile of up to 4 rows x 4 columns per pass over K (each weight vector loaded once feeds 4
// rows, each activation vector 4 columns: 16 independent FMA chains), N split across threads
// in 4-column tiles and M in chunks that keep the activations in L2; none of these choices
// touches the order in which any one output is summed.
#include "linear.h"

#include "../common.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// The flags every kernel file gets allow reassociation (cpu_ops.FLAGS), which would let the
// compiler regroup the horizontal sums and the scalar loop differently where a tile of 1 row
// and one of 4 are inlined: here the written order is the order.
#pragma GCC optimize("no-associative-math", "no-reciprocal-math")

namespace localllm_cpu::dense {
namespace {

constexpr int kRows = 4;        // rows per tile
constexpr int kCols = 4;        // weight rows (output columns) per tile
constexpr int64_t kChunkM = 64; // rows per pass over a thread's columns

// One tile: out[r * kCols + c] = x_r . w_c for r < MR; columns past the weight's end repeat
// its last row (computed, then not stored by the caller).
#if defined(__AVX512F__)
inline float hsum(__m512 v) {
  const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));
}

template <int MR>
void tile_f32(const float* x, int64_t ldx, const float* const* w, int64_t K, float* out) {
  __m512 acc[MR][kCols];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < kCols; ++c) acc[r][c] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 wv[kCols];
    for (int c = 0; c < kCols; ++c) wv[c] = _mm512_loadu_ps(w[c] + k);
    for (int r = 0; r < MR; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * ldx + k);
      for (int c = 0; c < kCols; ++c) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  if (k < K) {
    const __mmask16 m = static_cast<__mmask16>((1u << (K - k)) - 1);
    __m512 wv[kCols];
    for (int c = 0; c < kCols; ++c) wv[c] = _mm512_maskz_loadu_ps(m, w[c] + k);
    for (int r = 0; r < MR; ++r) {
      const __m512 xv = _mm512_maskz_loadu_ps(m, x + r * ldx + k);
      for (int c = 0; c < kCols; ++c) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < kCols; ++c) out[r * kCols + c] = hsum(acc[r][c]);
}

// bf16 -> fp32 lanes (exact: bf16 is fp32's top half)
inline __m512 widen(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

template <int MR>
void tile_bf16(const uint16_t* x, int64_t ldx, const uint16_t* const* w, int64_t K, float* out) {
  __m512 acc[MR][kCols];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < kCols; ++c) acc[r][c] = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
  // vdpbf16ps: lane l += x[2l] w[2l] + x[2l+1] w[2l+1], 32 values of k per step
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512bh wv[kCols];
    for (int c = 0; c < kCols; ++c) wv[c] = (__m512bh)_mm512_loadu_si512(w[c] + k);
    for (int r = 0; r < MR; ++r) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * ldx + k);
      for (int c = 0; c < kCols; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
    }
  }
  if (k < K) {
    const __mmask32 m = static_cast<__mmask32>((uint64_t{1} << (K - k)) - 1);
    __m512bh wv[kCols];
    for (int c = 0; c < kCols; ++c) wv[c] = (__m512bh)_mm512_maskz_loadu_epi16(m, w[c] + k);
    for (int r = 0; r < MR; ++r) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, x + r * ldx + k);
      for (int c = 0; c < kCols; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
    }
  }
#else
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 wv[kCols];
    for (int c = 0; c < kCols; ++c) wv[c] = widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[c] + k)));
    for (int r = 0; r < MR; ++r) {
      const __m512 xv = widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + r * ldx + k)));
      for (int c = 0; c < kCols; ++c) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  if (k < K) {
    const __mmask16 m = static_cast<__mmask16>((1u << (K - k)) - 1);
    __m512 wv[kCols];
    for (int c = 0; c < kCols; ++c) wv[c] = widen(_mm256_maskz_loadu_epi16(m, w[c] + k));
    for (int r = 0; r < MR; ++r) {
      const __m512 xv = widen(_mm256_maskz_loadu_epi16(m, x + r * ldx + k));
      for (int c = 0; c < kCols; ++c) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
#endif
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < kCols; ++c) out[r * kCols + c] = hsum(acc[r][c]);
}

#elif defined(__AVX2__) && defined(__FMA__)
inline float hsum(__m256 v) {
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));
}

// the K tail, zero-padded to a whole vector (8 values), in a buffer
template <class T>
inline const T* tail8(const T* p, int64_t n, T* buf) {
  for (int i = 0; i < 8; ++i) buf[i] = i < n ? p[i] : T{0};
  return buf;
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

template <int MR, class T>
void tile_avx2(const T* x, int64_t ldx, const T* const* w, int64_t K, float* out) {
  __m256 acc[MR][kCols];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < kCols; ++c) acc[r][c] = _mm256_setzero_ps();
  auto step = [&](const T* const* wp, const T* const* xp, int64_t off) {
    __m256 wv[kCols];
    for (int c = 0; c < kCols; ++c) wv[c] = load8(wp[c] + off);
    for (int r = 0; r < MR; ++r) {
      const __m256 xv = load8(xp[r] + off);
      for (int c = 0; c < kCols; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  };
  const T* xp[MR];
  for (int r = 0; r < MR; ++r) xp[r] = x + r * ldx;
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) step(w, xp, k);
  if (k < K) {
    T wbuf[kCols][8], xbuf[MR][8];
    const T* wt[kCols];
    const T* xt[MR];
    for (int c = 0; c < kCols; ++c) wt[c] = tail8(w[c] + k, K - k, wbuf[c]);
    for (int r = 0; r < MR; ++r) xt[r] = tail8(xp[r] + k, K - k, xbuf[r]);
    step(wt, xt, 0);
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < kCols; ++c) out[r * kCols + c] = hsum(acc[r][c]);
}

template <int MR>
void tile_f32(const float* x, int64_t ldx, const float* const* w, int64_t K, float* out) {
  tile_avx2<MR, float>(x, ldx, w, K, out);
}
template <int MR>
void tile_bf16(const uint16_t* x, int64_t ldx, const uint16_t* const* w, int64_t K, float* out) {
  tile_avx2<MR, uint16_t>(x, ldx, w, K, out);
}

#else
inline float to_f32(float v) { return v; }
inline float to_f32(uint16_t v) { return __builtin_bit_cast(float, static_cast<uint32_t>(v) << 16); }

template <int MR, class T>
void tile_scalar(const T* x, int64_t ldx, const T* const* w, int64_t K, float* out) {
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < kCols; ++c) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += to_f32(x[r * ldx + k]) * to_f32(w[c][k]);
      out[r * kCols + c] = s;
    }
}

template <int MR>
void tile_f32(const float* x, int64_t ldx, const float* const* w, int64_t K, float* out) {
  tile_scalar<MR, float>(x, ldx, w, K, out);
}
template <int MR>
void tile_bf16(const uint16_t* x, int64_t ldx, const uint16_t* const* w, int64_t K, float* out) {
  tile_scalar<MR, uint16_t>(x, ldx, w, K, out);
}
#endif

template <class T, class Tile>
void run(const T* x, int64_t ldx, int64_t M, int64_t K, const T* w, int64_t N, const float* bias, float* y,
         Tile tile) {
  LOCALLLM_CHECK(M >= 0 && K > 0 && N > 0, "dense linear: empty shape M=", M, " K=", K, " N=", N);
  if (M == 0) return;
  const int64_t tiles = (N + kCols - 1) / kCols;
  // ~64k multiply-adds per chunk of work at least: below that the fork costs more than it saves
  const int64_t grain = std::max<int64_t>(1, 65536 / (kCols * K * std::min<int64_t>(M, kChunkM)));
  for (int64_t m0 = 0; m0 < M; m0 += kChunkM) {
    const int64_t mc = std::min(kChunkM, M - m0);
    parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
      float out[kRows * kCols];
      for (int64_t t = begin; t < end; ++t) {
        const int64_t n0 = t * kCols, nc = std::min<int64_t>(kCols, N - n0);
        const T* wr[kCols];
        for (int c = 0; c < kCols; ++c) wr[c] = w + (n0 + std::min<int64_t>(c, nc - 1)) * K;
        for (int64_t m = m0; m < m0 + mc; m += kRows) {
          const int64_t mr = std::min<int64_t>(kRows, m0 + mc - m);
          const T* xr = x + m * ldx;
          switch (mr) {
            case 4: tile.template operator()<4>(xr, ldx, wr, K, out); break;
            case 3: tile.template operator()<3>(xr, ldx, wr, K, out); break;
            case 2: tile.template operator()<2>(xr, ldx, wr, K, out); break;
            default: tile.template operator()<1>(xr, ldx, wr, K, out); break;
          }
          for (int64_t r = 0; r < mr; ++r)
            for (int64_t c = 0; c < nc; ++c)
              y[(m + r) * N + n0 + c] = bias ? out[r * kCols + c] + bias[n0 + c] : out[r * kCols + c];
        }
      }
    });
  }
}

struct TileF32 {
  template <int MR>
  void operator()(const float* x, int64_t ldx, const float* const* w, int64_t K, float* out) const {
    tile_f32<MR>(x, ldx, w, K, out);
  }
};
struct TileBf16 {
  template <int MR>
  void operator()(const uint16_t* x, int64_t ldx, const uint16_t* const* w, int64_t K, float* out) const {
    tile_bf16<MR>(x, ldx, w, K, out);
  }
};

}  // namespace

void linear_f32(const float* x, int64_t ldx, int64_t M, int64_t K, const float* w, int64_t N, const float* bias,
                float* y) {
  run(x, ldx, M, K, w, N, bias, y, TileF32{});
}

void linear_bf16(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, const uint16_t* w, int64_t N,
                 const float* bias, float* y) {
  run(x, ldx, M, K, w, N, bias, y, TileBf16{});
}

}  // namespace localllm_cpu::dense
