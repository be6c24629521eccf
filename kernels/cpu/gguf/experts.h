// A mixture of experts' GGUF linear, all routed experts in one call (experts.cpp).
#pragma once

#include <cstdint>

#include "gguf.h"

namespace localllm_cpu::gguf {

// For every expert e: y[r] = x[r] @ W_e^T for the rows r in [offsets[e], offsets[e + 1]) (x's
// rows sorted by expert), W_e the packed tiles [e * N / 8, (e + 1) * N / 8) of `w`, the E
// experts' [E * N, K] stack. Each row's result is linear()'s on that row and W_e, bit for bit.
void linear_grouped(const float* x, int64_t R, int64_t K, const Packed& w, int64_t E, int64_t N,
                    const int64_t* offsets, int64_t type, int64_t levels, float* y);

}  // namespace localllm_cpu::gguf
