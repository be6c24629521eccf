// Activation quantization (activations.h).
#include "activations.h"

#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "../common.h"

namespace localllm_cpu::gguf {

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
  parallel_for(0, M * nb, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* src = x + (i / nb) * K + (i % nb) * 32;
      int8_t* q0 = xq + (i / nb) * K + (i % nb) * 32;
      float offset = 0.f, half[2] = {0.f, 0.f};
#if defined(__AVX512F__) && defined(__AVX512BW__)
      // the scalar loop below in 16-lane registers, the same operations on each value (max
      // of |r|, RNE rounding of r * inv as nearbyint does, r - v * d with no fused multiply-add:
      // the build's -std=c++17 keeps the scalar one unfused), so the codes and scales are equal
      __m512 r[2] = {_mm512_loadu_ps(src), _mm512_loadu_ps(src + 16)};
      for (int64_t lv = 0; lv < levels; ++lv) {
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(r[0]), _mm512_abs_ps(r[1])));
        const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
        int8_t* q = q0 + lv * M * K;
        int32_t sum[2];
        for (int h = 0; h < 2; ++h) {
          const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(r[h], _mm512_set1_ps(inv)));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * h), _mm512_cvtsepi32_epi8(v));
          sum[h] = _mm512_reduce_add_epi32(v);
          r[h] = _mm512_sub_ps(r[h], _mm512_mul_ps(_mm512_cvtepi32_ps(v), _mm512_set1_ps(d)));
        }
#else
      float r[32];
      std::memcpy(r, src, sizeof(r));
      for (int64_t lv = 0; lv < levels; ++lv) {
        float amax = 0.f;
        for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(r[j]));
        const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
        int8_t* q = q0 + lv * M * K;
        int32_t sum[2] = {0, 0};
        for (int j = 0; j < 32; ++j) {
          const int v = static_cast<int>(std::nearbyint(r[j] * inv));
          q[j] = static_cast<int8_t>(v);
          sum[j / 16] += v;
          r[j] -= static_cast<float>(v) * d;
        }
#endif
        xd[lv * M * nb + i] = d;
        offset += d * static_cast<float>(sum[0] + sum[1]);
        half[0] += d * static_cast<float>(sum[0]);
        half[1] += d * static_cast<float>(sum[1]);
      }
      xs[i] = offset;
      xs16[2 * i] = half[0];
      xs16[2 * i + 1] = half[1];
    }
  });
  return {xq, xd, xs, xs16, M, K};
}

}  // namespace localllm_cpu::gguf
