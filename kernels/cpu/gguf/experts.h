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

// One projection of the experts' stack: its packed blocks and block type.
struct Projection {
  Packed w;
  int64_t type;
};

// A GGUF mixture-of-experts block, models/moe.py's moe_experts on packed experts: y [T, H] =
// sum over k of weights[t, k] * expert_{ids[t, k]}(x[t]), expert e = down(act(gate_up(x) + b13[e])) + b2[e].
// gate_up: `w13` of 2I rows an expert (gate, then up), or with `w3` (up) given, `w13` gate alone
// of I rows. act: SiLU(gate) * up, or with limit > 0 gpt-oss's clamped SwiGLU (models/moe.py's
// activate). b13 [E, 2I], b2 [E, H] may be null. The (token, slot) pairs run sorted by expert,
// stable, as moe_experts_gguf sorted them; each output row sums its k products in that order.
// Runs on the dispatched kernels (x86 or generic), so on every CPU with GGUF kernels.
void moe_experts(const float* x, int64_t T, int64_t H, const float* weights, const int64_t* ids, int64_t k,
                 int64_t E, int64_t I, const Projection& w13, const Projection* w3, const Projection& w2,
                 const float* b13, const float* b2, float limit, float alpha, int64_t levels, float* y);

}  // namespace localllm_cpu::gguf
