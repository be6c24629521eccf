// What every kernel translation unit shares: parallel_for and LOCALLLM_CHECK (parallel.h: no
// torch header; the tensor API is ops.cpp's alone, ATen's thread pool parallel.cpp's, so a
// kernel file's cold compile is its own code, not torch's headers) and the vectorisable e^x.
//
// The kernels take raw pointers and sizes; ops.cpp, the one place that sees at::Tensor,
// checks shapes and dtypes, allocates outputs and calls them.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "parallel.h"

namespace localllm_cpu {

// e^x for the softmax and the sampler (x <= 0 there), written so the loops that call it
// vectorise: glibc's expf is scalar. Range reduction to r in [-ln2/2, ln2/2], a degree-6
// polynomial, then the exponent by bit manipulation; relative error ~1e-7, and -inf gives
// ~1e-38 (not 0), which the callers only ever multiply by zeros.
inline float fast_exp(float x) {
  x = std::max(x, -87.f);
  const float n = std::floor(x * 1.44269504f + 0.5f);
  const float r = x - n * 0.693145752f - n * 1.42860677e-6f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  return p * __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
}

}  // namespace localllm_cpu
