// The GGUF linear's kernels for Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0: one file per group of
// types, so that their template instantiations compile in parallel (kernel.h).
#include "kernel.h"

#ifdef LOCALLLM_GGUF_KERNELS
namespace localllm_cpu::gguf {

bool tile_kernels_legacy(int64_t type, TileKernels& out) {
  switch (type) {
    case kQ4_0: out = tile_kernels<Format<kQ4_0>>(); return true;
    case kQ4_1: out = tile_kernels<Format<kQ4_1>>(); return true;
    case kQ5_0: out = tile_kernels<Format<kQ5_0>>(); return true;
    case kQ5_1: out = tile_kernels<Format<kQ5_1>>(); return true;
    case kQ8_0: out = tile_kernels<Format<kQ8_0>>(); return true;
  }
  return false;
}

}  // namespace localllm_cpu::gguf
#endif  // LOCALLLM_GGUF_KERNELS
