// The generic GGUF kernels: gguf.h's linear, grouped linear and dense expansion in portable
// C++ (no intrinsics; Arm's dot product instruction where the compiler targets it), for every
// CPU the x86 kernels (kernel.h: AVX2, AVX-512 VNNI, AMX) are not built for (Arm: Apple
// silicon, Graviton, a Raspberry Pi; x86 before AVX2) and wherever LOCALLLM_CPU_ISA=generic
// forces them (dispatch.h). They read the same packed layout (formats.h, made by repack.cpp)
// and quantize the activations the same way (activations.h), so a loaded model runs on either.
//
// Invariants: the integer sums are the x86 kernels' (exact int32, any order), and the float
// part per row and block is tile_kernel's operation for operation with fused multiply-adds
// where the CPU has them, so where codes are unsigned (Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K,
// Q6_K) results equal the x86 kernels' bit for bit; signed codes (Q8_0, IQ4_NL, IQ4_XS, MXFP4)
// equal the AVX2 kernel's, and AVX-512's (which offsets the codes by 128) within fp32 rounding.
// A row's result does not depend on the batch. dequantize() is the gguf package's, bit for bit.
#pragma once

#include <cstdint>

#include "gguf.h"

namespace localllm_cpu::gguf::generic {

// gguf.h's linear, linear_grouped (experts.h) and dequantize, in the generic kernels.
void linear(const float* x, int64_t M, int64_t K, const Packed& w, int64_t N, int64_t type, int64_t levels, float* y);
void linear_grouped(const float* x, int64_t R, int64_t K, const Packed& w, int64_t E, int64_t N,
                    const int64_t* offsets, int64_t type, int64_t levels, float* y);
void dequantize(const Packed& w, int64_t N, int64_t K, int64_t type, bool bf16, void* out);

// What these kernels compiled to here: "generic" or "generic (Arm dot product)".
const char* name();

// The x86 kernels' name as built here ("x86 AVX-512 VNNI + AMX", "x86 AVX2", ...), or nullptr
// where they are not built (dispatch.h).
const char* x86_name();

}  // namespace localllm_cpu::gguf::generic
