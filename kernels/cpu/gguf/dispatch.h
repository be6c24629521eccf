// The one place the GGUF ops (ops.cpp) choose their kernels: the x86 ones (kernel.h; within
// them linear.cpp picks AMX, AVX-512 VNNI or AVX2 by what the build targets and the rows) where
// they are built (x86-64-v3 and up, LOCALLLM_GGUF_KERNELS), else the generic ones (generic.h:
// Arm, older x86). LOCALLLM_CPU_ISA=generic forces the generic kernels on any CPU; it is read
// per call, as LOCALLLM_GGUF_AMX is, so one process (a test, a benchmark) can run both on the
// same packed weights. Repacking is the same for both (repack.cpp).
#pragma once

#include <cstdlib>
#include <cstring>

#include "experts.h"
#include "generic.h"
#include "gguf.h"

namespace localllm_cpu::gguf {

// Whether this call runs the x86 kernels.
inline bool use_x86() {
#ifdef LOCALLLM_GGUF_KERNELS
  const char* isa = std::getenv("LOCALLLM_CPU_ISA");
  return isa == nullptr || std::strcmp(isa, "generic") != 0;
#else
  return false;
#endif
}

// The kernels a call made now runs, in words (the planner's reason line names them).
inline const char* kernels_name() { return use_x86() ? generic::x86_name() : generic::name(); }

inline void run_linear(const float* x, int64_t M, int64_t K, const Packed& w, int64_t N, int64_t type, int64_t levels,
                       float* y) {
#ifdef LOCALLLM_GGUF_KERNELS
  if (use_x86()) return linear(x, M, K, w, N, type, levels, y);
#endif
  generic::linear(x, M, K, w, N, type, levels, y);
}

inline void run_linear_grouped(const float* x, int64_t R, int64_t K, const Packed& w, int64_t E, int64_t N,
                               const int64_t* offsets, int64_t type, int64_t levels, float* y) {
#ifdef LOCALLLM_GGUF_KERNELS
  if (use_x86()) return linear_grouped(x, R, K, w, E, N, offsets, type, levels, y);
#endif
  generic::linear_grouped(x, R, K, w, E, N, offsets, type, levels, y);
}

inline void run_dequantize(const Packed& w, int64_t N, int64_t K, int64_t type, bool bf16, void* out) {
#ifdef LOCALLLM_GGUF_KERNELS
  if (use_x86()) return dequantize(w, N, K, type, bf16, out);
#endif
  generic::dequantize(w, N, K, type, bf16, out);
}

}  // namespace localllm_cpu::gguf
