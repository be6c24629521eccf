"""Fused kernels for the CUDA path, each beside the torch reference that the CPU runs.

Every public function here dispatches on the device of its first tensor: CUDA tensors go to
the Triton kernel, everything else to the reference, so the model code is the same on both.
Installed as ``localllm.kernels``; never import a top-level ``kernels`` (another PyPI package).
"""

from __future__ import annotations

from localllm.kernels.activation import silu_and_mul
from localllm.kernels.paged_attention import paged_attention
from localllm.kernels.rmsnorm import rms_norm
from localllm.kernels.rotary_kv import rotary_and_store_kv

__all__ = ["paged_attention", "rms_norm", "rotary_and_store_kv", "silu_and_mul"]
