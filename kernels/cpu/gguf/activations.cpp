// Activation quantization (activations.h).
#include "activations.h"

#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "../common.h"

namespace localllm_cpu::gguf {

namespace {

#if !(defined(__AVX512F__) && defined(__AVX512BW__))
// One block (32 values at src) in `levels` levels: codes at q0 (level stride MK), scales at
// xd[lv * Mnb], and the offset factors (sum over levels of scale x code sum, whole and per half).
void quantize_block(const float* src, int8_t* q0, int64_t MK, float* xd, int64_t Mnb, int64_t levels, float& offset,
                    float (&half)[2]) {
  offset = 0.f, half[0] = half[1] = 0.f;
  float r[32];
  std::memcpy(r, src, sizeof(r));
  for (int64_t lv = 0; lv < levels; ++lv) {
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(r[j]));
    const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
    int8_t* q = q0 + lv * MK;
    int32_t sum[2] = {0, 0};
    for (int j = 0; j < 32; ++j) {
      const int v = static_cast<int>(std::nearbyint(r[j] * inv));
      q[j] = static_cast<int8_t>(v);
      sum[j / 16] += v;
      r[j] -= static_cast<float>(v) * d;
    }
    xd[lv * Mnb] = d;
    offset += d * static_cast<float>(sum[0] + sum[1]);
    half[0] += d * static_cast<float>(sum[0]);
    half[1] += d * static_cast<float>(sum[1]);
  }
}
#else
// v[j]'s 16 lanes reduced by `op` into lane j of the result (max or integer add: exact in any
// order, so each lane is what _mm512_reduce_* gives on v[j]): four rounds of shuffles halve
// the vectors, then one permute puts lane 4q + k (v[4k + q]) at 4k + q.
template <class Op>
__m512 reduce16(__m512 (&v)[16], Op op) {
  __m512 w[8], u[4], z[2];
  for (int k = 0; k < 8; ++k)
    w[k] = op(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44), _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xee));
  for (int k = 0; k < 4; ++k)
    u[k] = op(_mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], 0x88), _mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], 0xdd));
  for (int k = 0; k < 2; ++k)
    z[k] = op(_mm512_shuffle_ps(u[2 * k], u[2 * k + 1], 0x44), _mm512_shuffle_ps(u[2 * k], u[2 * k + 1], 0xee));
  const __m512 r = op(_mm512_shuffle_ps(z[0], z[1], 0x88), _mm512_shuffle_ps(z[0], z[1], 0xdd));
  const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(idx, r);
}

// 16 consecutive blocks (512 values at src) in `levels` levels: codes at q0 (level stride MK),
// scales at xd[lv * Mnb + j], offset factors xs[j] (sum over levels of scale x code sum) and
// xs16[2j + h] (the same per half). The per-block reductions (max of |r|, the code sums) and
// the scale arithmetic run 16 blocks to a register (reduce16): one block at a time they were
// a chain of shuffles the core waited on (~2.5x slower for 16 rows of 576, docs/benchmarks.md).
// Per value the operations are those of the per-block loop this replaced as GCC compiled it
// with the build's flags (r - v x d contracted to one fused multiply-add there and here), so
// codes and scales are bit for bit the same.
void quantize_16_blocks(const float* src, int8_t* q0, int64_t MK, float* xd, int64_t Mnb, int64_t levels,
                        float* xs, float* xs16) {
  __m512 r[16][2];
  for (int j = 0; j < 16; ++j) r[j][0] = _mm512_loadu_ps(src + 32 * j), r[j][1] = _mm512_loadu_ps(src + 32 * j + 16);
  __m512 offset = _mm512_setzero_ps(), half0 = _mm512_setzero_ps(), half1 = _mm512_setzero_ps();
  const auto max_op = [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); };
  const auto add_op = [](__m512 a, __m512 b) {
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
  };
  for (int64_t lv = 0; lv < levels; ++lv) {
    __m512 m[16];
    for (int j = 0; j < 16; ++j) m[j] = _mm512_max_ps(_mm512_abs_ps(r[j][0]), _mm512_abs_ps(r[j][1]));
    const __m512 amax = reduce16(m, max_op);
    // d = amax / 127 and inv = 1 / d as GCC compiles the scalar loop under the build's
    // -freciprocal-math (amax x fl(1/127), and 127 / amax): the codes and scales of the
    // previous per-block AVX-512 loop, so greedy outputs did not move with this change
    const __m512 d = _mm512_mul_ps(amax, _mm512_set1_ps(1.f / 127.f));
    const __m512 inv = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(d, _mm512_setzero_ps(), _CMP_GT_OQ),
                                           _mm512_set1_ps(127.f), amax);
    alignas(64) float ds[16], invs[16];
    _mm512_store_ps(ds, d);
    _mm512_store_ps(invs, inv);
    int8_t* q = q0 + lv * MK;
    __m512 sums[2][16];
    for (int j = 0; j < 16; ++j)
      for (int h = 0; h < 2; ++h) {
        const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(r[j][h], _mm512_set1_ps(invs[j])));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 * j + 16 * h), _mm512_cvtsepi32_epi8(v));
        sums[h][j] = _mm512_castsi512_ps(v);
        r[j][h] = _mm512_sub_ps(r[j][h], _mm512_mul_ps(_mm512_cvtepi32_ps(v), _mm512_set1_ps(ds[j])));
      }
    const __m512i s0 = _mm512_castps_si512(reduce16(sums[0], add_op));
    const __m512i s1 = _mm512_castps_si512(reduce16(sums[1], add_op));
    _mm512_storeu_ps(xd + lv * Mnb, d);
    offset = _mm512_add_ps(offset, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1))));
    half0 = _mm512_add_ps(half0, _mm512_mul_ps(d, _mm512_cvtepi32_ps(s0)));
    half1 = _mm512_add_ps(half1, _mm512_mul_ps(d, _mm512_cvtepi32_ps(s1)));
  }
  _mm512_storeu_ps(xs, offset);
  const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  _mm512_storeu_ps(xs16, _mm512_permutex2var_ps(half0, lo, half1));
  _mm512_storeu_ps(xs16 + 16, _mm512_permutex2var_ps(half0, hi, half1));
}
#endif

}  // namespace

Activations quantize_rows(const float* x, int64_t M, int64_t K, int64_t levels) {
  const int64_t nb = K / 32;
  thread_local std::vector<int8_t> xq_buf;
  thread_local std::vector<float> xf_buf;
  xq_buf.resize(std::max<size_t>(xq_buf.size(), levels * M * K));
  xf_buf.resize(std::max<size_t>(xf_buf.size(), (levels + 3) * M * nb));
  int8_t* xq = xq_buf.data();
  float* xd = xf_buf.data();
  float* xs = xd + levels * M * nb;
  float* xs16 = xs + M * nb;
  LOCALLLM_CHECK(levels >= 1 && levels <= 4, "activation levels: 1 to 4, not ", levels);
  // rows are contiguous, so block i of the [M, K / 32] grid is x + 32 i, its codes xq + 32 i
  parallel_for(0, M * nb, 64, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    for (; i + 16 <= end; i += 16)
      quantize_16_blocks(x + 32 * i, xq + 32 * i, M * K, xd + i, M * nb, levels, xs + i, xs16 + 2 * i);
    if (i < end) {  // the last < 16 blocks through the same code (zeros after them), so every
                    // block's codes are the same function of its values wherever it falls
      const int64_t n = end - i;
      alignas(64) float src[512] = {}, d[4][16], s[16], s16[32];
      alignas(64) int8_t q[4][512];
      std::memcpy(src, x + 32 * i, n * 32 * sizeof(float));
      quantize_16_blocks(src, q[0], 512, d[0], 16, levels, s, s16);
      for (int64_t lv = 0; lv < levels; ++lv) {
        std::memcpy(xq + lv * M * K + 32 * i, q[lv], n * 32);
        std::memcpy(xd + lv * M * nb + i, d[lv], n * sizeof(float));
      }
      std::memcpy(xs + i, s, n * sizeof(float));
      std::memcpy(xs16 + 2 * i, s16, 2 * n * sizeof(float));
    }
#else
    for (; i < end; ++i) {
      float half[2];
      quantize_block(x + 32 * i, xq + 32 * i, M * K, xd + i, M * nb, levels, xs[i], half);
      xs16[2 * i] = half[0];
      xs16[2 * i + 1] = half[1];
    }
#endif
  });
  return {xq, xd, xs, xs16, M, K};
}

}  // namespace localllm_cpu::gguf
