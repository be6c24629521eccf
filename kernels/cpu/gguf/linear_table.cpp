// The GGUF linear's kernels for IQ4_NL, IQ4_XS and MXFP4 (4-bit indices into a value table): one file per group of
// types, so that their template instantiations compile in parallel (kernel.h).
#include "kernel.h"

#ifdef LOCALLLM_GGUF_KERNELS
namespace localllm_cpu::gguf {

bool tile_kernels_table(int64_t type, TileKernels& out) {
  switch (type) {
    case kIQ4_NL: out = tile_kernels<Format<kIQ4_NL>>(); return true;
    case kIQ4_XS: out = tile_kernels<Format<kIQ4_XS>>(); return true;
    case kMXFP4: out = tile_kernels<Format<kMXFP4>>(); return true;
  }
  return false;
}

}  // namespace localllm_cpu::gguf
#endif  // LOCALLLM_GGUF_KERNELS
