// A float linear whose every output is one fixed computation of its own row and column:
// y[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]) reduced in an order set by K alone, never by
// the number of rows M, the row's place in the batch, N's split across threads or the thread
// count. It is what --deterministic runs fp32 and bf16 weights through
// (localllm/engine/batch_invariant.py): a BLAS GEMM picks its kernel and its K split by the
// shape, so a row's numbers there change with the batch it came in.
//
// Order, per output: one vector accumulator per (row, column), lane l summing the products
// at k = l, l + L, l + 2L, ... (L the vector width: 16 fp32 lanes with AVX-512, 8 with AVX2,
// 32 bf16 pairs per vdpbf16ps), the K tail zero-padded, then one fixed horizontal sum, then
// the bias. The scalar fallback sums k in order. Which path runs is fixed at build time
// (-march=native), so one machine gives one answer.
#pragma once

#include <cstdint>

namespace localllm_cpu::dense {

// x [M, K] fp32 rows (row stride ldx), w [N, K] fp32 contiguous, bias [N] or null -> y [M, N] fp32.
void linear_f32(const float* x, int64_t ldx, int64_t M, int64_t K, const float* w, int64_t N, const float* bias,
                float* y);

// The same with bf16 x and w (raw bits; the products are exact in fp32, the sums fp32).
void linear_bf16(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, const uint16_t* w, int64_t N,
                 const float* bias, float* y);

}  // namespace localllm_cpu::dense
