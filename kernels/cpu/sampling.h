// The sampler's row kernels: one row of logits to one token (localllm/engine/sampler.py's
// sample_rows and argmax_rows hold their torch reference and the semantics), and top-k
// indices. Rows are fp32 [R, V], contiguous; outputs int64.
#pragma once

#include <cstdint>

namespace localllm_cpu {

void argmax_rows(const float* x, int64_t R, int64_t V, int64_t* out);

// out [R, k]: each row's k largest, largest first (ties: lower index first; NaN smallest)
void topk_indices(const float* x, int64_t R, int64_t V, int64_t k, int64_t* out);

// One value per row in each list; top_ks[r] >= V is no top-k cut.
void sample_rows(const float* x, int64_t R, int64_t V, const double* temps, const int64_t* top_ks,
                 const double* top_ps, const double* min_ps, const double* u, int64_t* out);

}  // namespace localllm_cpu
