"""Fused kernels for the CUDA path, each beside the torch reference that the CPU runs.

Every public function here dispatches on the device of its first tensor: CUDA tensors go to
the Triton kernel, everything else to the reference, so the model code is the same on both.
The quantized GEMMs additionally keep the torch path on CUDA for shapes where it measured
faster. Installed as ``localllm.kernels``; never import a top-level ``kernels`` (another PyPI
package).
"""

from __future__ import annotations

from localllm.kernels.activation import silu_and_mul
from localllm.kernels.awq_gemm import awq_gemm
from localllm.kernels.fp8_gemm import fp8_w8a8_gemm
from localllm.kernels.gguf_linear import GGUFPacked, gguf_linear, pack_gguf_blocks
from localllm.kernels.int8_gemm import int8_w8a8_gemm, int8_w8a16_gemm
from localllm.kernels.paged_attention import paged_attention
from localllm.kernels.rmsnorm import rms_norm
from localllm.kernels.rotary_kv import rotary, rotary_and_store_kv

__all__ = [
    "GGUFPacked",
    "awq_gemm",
    "fp8_w8a8_gemm",
    "gguf_linear",
    "int8_w8a16_gemm",
    "int8_w8a8_gemm",
    "pack_gguf_blocks",
    "paged_attention",
    "rms_norm",
    "rotary",
    "rotary_and_store_kv",
    "silu_and_mul",
]
