// GGUF block-quantized linear: y = x @ W^T with W kept in GGUF's own blocks, repacked once at
// load into the tiles the kernel reads (formats.h: the layouts, one per block type), and
// multiplied on integer dot products against int8-quantized activations (activations.h).
// The entry points ops.cpp calls; built on x86-64-v3 CPUs and up (LOCALLLM_GGUF_KERNELS).
#pragma once

#include <cstdint>

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define LOCALLLM_GGUF_KERNELS 1
#endif

namespace localllm_cpu::gguf {

// The packed tensors of one [N, K] weight, in gguf_repack's order (sizes: layout()).
struct Packed {
  const uint8_t* codes;   // [N / 8, K / 32, code_bytes]
  const uint8_t* hi;      // [N / 8, K / 32, hi_bytes]
  const uint8_t* scales;  // [N / 8, K / 32, scale_bytes]
  const uint16_t* d;      // fp16 [N / 8, K / super, d_halves]
};

// A type's file block and packed sizes; block_weights == 0: no layout (not a kernel type).
struct Layout {
  int64_t block_weights, block_bytes;  // of the file
  int64_t code_bytes, hi_bytes, scale_bytes, super, d_halves;  // per 8-row tile
};
Layout layout(int64_t type);

// weight: the file's [N, K / block_weights * block_bytes] bytes -> the packed tensors.
void repack(const uint8_t* weight, int64_t N, int64_t K, int64_t type, uint8_t* codes, uint8_t* hi, uint8_t* scales,
            uint16_t* d);

// y [M, N] = x [M, K] @ W^T, activations quantized in `levels` int8 levels.
void linear(const float* x, int64_t M, int64_t K, const Packed& w, int64_t N, int64_t type, int64_t levels, float* y);

// The packed weight as dense [N, K] fp32 (bf16 == false) or bf16 (uint16 bits): the gguf
// package's dequantization, bit for bit (before the bf16 rounding).
void dequantize(const Packed& w, int64_t N, int64_t K, int64_t type, bool bf16, void* out);

}  // namespace localllm_cpu::gguf
