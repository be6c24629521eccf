// The activations' side of the GGUF linear: x quantized per 32-block to int8.
#pragma once

#include <cstdint>

namespace localllm_cpu::gguf {

// x [M, K] as `levels` levels of int8 codes with a scale per 32-block (round-to-nearest,
// like ggml's Q8): level 2 quantizes what level 1 left over, so the pair carries ~14 bits per
// activation (measured on the default model: max logit error 2.2 with one level, 0.007 with
// two, against fp32 activations on the same weights).
struct Activations {
  const int8_t* xq;   // [levels, M, K]
  const float* xd;    // [levels, M, K / 32] scales
  const float* xs;    // [M, K / 32]: sum over levels of scale x code sum (the offset's factor)
  const float* xs16;  // [M, K / 16]: the same per 16-weight half (Q6_K's two scales per block)
  int64_t M, K;
};

// Quantizes x into per-thread scratch that only grows (a decode step makes ~120 of these
// calls, and allocations each were ~0.3 ms of it); valid until the thread's next call.
Activations quantize_rows(const float* x, int64_t M, int64_t K, int64_t levels);

}  // namespace localllm_cpu::gguf
