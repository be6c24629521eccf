// The GGUF linear's kernels for Q4_K, Q5_K and Q6_K: one file per group of
// types, so that their template instantiations compile in parallel (kernel.h).
#include "kernel.h"

#ifdef LOCALLLM_GGUF_KERNELS
namespace localllm_cpu::gguf {

bool tile_kernels_kquant(int64_t type, TileKernels& out) {
  switch (type) {
    case kQ4_K: out = tile_kernels<Format<kQ4_K>>(); return true;
    case kQ5_K: out = tile_kernels<Format<kQ5_K>>(); return true;
    case kQ6_K: out = tile_kernels<Format<kQ6_K>>(); return true;
  }
  return false;
}

}  // namespace localllm_cpu::gguf
#endif  // LOCALLLM_GGUF_KERNELS
