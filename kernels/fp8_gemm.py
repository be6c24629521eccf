"""FP8 (e4m3) W8A8 GEMM with per-output-channel weight scales and dynamic per-token
activation scales.

- w: float8_e4m3fn [N, K] (nn.Linear layout), w_scale: fp32 [N].
- Each row (token) of x is scaled by max|row| / 448 and cast to e4m3; the product of the two
  fp8 matrices accumulates in fp32 and both scales are applied in the epilogue.

The Triton path is int8_gemm's kernels with e4m3 operands: the per-token quantizer, then
``_w8_gemm_kernel``, which feeds the fp8 tiles straight to ``tl.dot`` (fp8 tensor cores: sm89
Ada and sm90 Hopper, where it lowers to wgmma). The dispatcher also times
``torch._scaled_mm`` (cuBLASLt) and keeps whichever is faster per shape; below sm89 it uses
the reference.
"""

from __future__ import annotations

import torch

from localllm.kernels._triton import Config, capability, gemm_backend_choice, m_bucket, use_triton
from localllm.kernels.int8_gemm import launch_w8_gemm, quantize_per_token_ref, quantize_per_token_triton



def quantize_per_token_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_per_token_ref(x, torch.float8_e4m3fn)


def fp8_w8a8_gemm_ref(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """Quantize x per token, dequantize both operands, matmul in fp32, cast to x.dtype.

    On CPU this beats ``torch._scaled_mm`` by far (ENVIRONMENT.md: ~3 ms at any size there).
    """
    shape = x.shape
    k, n = shape[-1], w.shape[0]
    x2 = x.reshape(-1, k)
    xq, x_scale = quantize_per_token_fp8_ref(x2)
    acc = xq.float() @ w.float().t()
    out = acc * x_scale * w_scale.reshape(1, n).float()
    return out.to(x.dtype).view(*shape[:-1], n)


# --- Triton ---------------------------------------------------------------------------------------


def quantize_per_token_fp8_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_per_token_triton(x, torch.float8_e4m3fn)


def fp8_w8a8_gemm_triton(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, *, config: Config | None = None
) -> torch.Tensor:
    """Triton implementation of ``fp8_w8a8_gemm_ref`` (needs sm89+ on a GPU)."""
    assert w.dtype == torch.float8_e4m3fn
    shape = x.shape
    xq, x_scale = quantize_per_token_fp8_triton(x.reshape(-1, shape[-1]))
    return launch_w8_gemm(xq, w, w_scale, x_scale, x.dtype, config).view(*shape[:-1], w.shape[0])


def _scaled_mm_path(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """cuBLASLt fp8 GEMM with row-wise scales, after our quantization kernel."""
    shape = x.shape
    xq, x_scale = quantize_per_token_fp8_triton(x.reshape(-1, shape[-1]))
    out = torch._scaled_mm(
        xq, w.t(), scale_a=x_scale, scale_b=w_scale.float().reshape(1, -1), out_dtype=x.dtype
    )
    return out.view(*shape[:-1], w.shape[0])


def fp8_w8a8_gemm(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] with dynamic per-token e4m3 quantization @ (w e4m3 [N, K] * w_scale).T."""
    if use_triton(x) and capability(x) >= (8, 9):
        k, n = x.shape[-1], w.shape[0]
        key = ("fp8_w8a8", m_bucket(x.numel() // max(k, 1)), n, k, x.dtype, x.device.index)
        choice = gemm_backend_choice(
            key,
            {
                "triton": lambda: fp8_w8a8_gemm_triton(x, w, w_scale),
                "scaled_mm": lambda: _scaled_mm_path(x, w, w_scale),
                "torch": lambda: fp8_w8a8_gemm_ref(x, w, w_scale),
            },
        )
        if choice == "triton":
            return fp8_w8a8_gemm_triton(x, w, w_scale)
        if choice == "scaled_mm":
            return _scaled_mm_path(x, w, w_scale)
    return fp8_w8a8_gemm_ref(x, w, w_scale)
