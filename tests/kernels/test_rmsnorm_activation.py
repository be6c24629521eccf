"""Fused RMSNorm (+ residual) and SiLU*mul kernels against their references."""

from __future__ import annotations

import pytest
import torch

from localllm.kernels.activation import silu_and_mul, silu_and_mul_ref, silu_and_mul_triton
from localllm.kernels.rmsnorm import rms_norm, rms_norm_ref, rms_norm_triton

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def tol(dtype: torch.dtype) -> dict[str, float]:
    if dtype == torch.bfloat16:
        return {"atol": 2e-2, "rtol": 2e-2}
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-3, "rtol": 2e-3}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 576, 100])
def test_rms_norm(device: str, dtype: torch.dtype, hidden: int) -> None:
    x = torch.randn(5, hidden, device=device).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, device=device)).to(dtype)
    torch.testing.assert_close(rms_norm_triton(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_residual(device: str, dtype: torch.dtype) -> None:
    x = torch.randn(2, 3, 96, device=device).to(dtype)  # leading dims are flattened
    res = torch.randn(2, 3, 96, device=device).to(dtype)
    w = torch.randn(96, device=device).to(dtype)
    out, new_res = rms_norm_triton(x, w, 1e-6, res)
    ref_out, ref_res = rms_norm_ref(x, w, 1e-6, res)
    torch.testing.assert_close(new_res, ref_res, atol=0, rtol=0)
    torch.testing.assert_close(out, ref_out, **tol(dtype))


def test_rms_norm_fp32_residual_stream(device: str) -> None:
    """The model keeps its residual stream in fp32 with fp16 weights: the normalised output must
    come back in the weights' dtype (it feeds a matmul), the residual in fp32."""
    x = torch.randn(5, 64, device=device).to(torch.float16)
    res = torch.randn(5, 64, device=device)
    w = torch.randn(64, device=device).to(torch.float16)
    out, new_res = rms_norm_triton(x, w, 1e-6, res)
    ref_out, ref_res = rms_norm_ref(x, w, 1e-6, res)
    assert out.dtype == ref_out.dtype == torch.float16 and new_res.dtype == ref_res.dtype == torch.float32
    torch.testing.assert_close(new_res, ref_res)
    torch.testing.assert_close(out, ref_out, atol=2e-3, rtol=2e-3)


def test_rms_norm_empty(device: str) -> None:
    x = torch.randn(0, 64, device=device)
    w = torch.ones(64, device=device)
    assert rms_norm_triton(x, w, 1e-5).shape == (0, 64)
    out, res = rms_norm_triton(x, w, 1e-5, x.clone())
    assert out.shape == res.shape == (0, 64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [64, 1536 // 4, 1100])
def test_silu_and_mul(device: str, dtype: torch.dtype, inter: int) -> None:
    x = torch.randn(3, 2 * inter, device=device).to(dtype)
    torch.testing.assert_close(silu_and_mul_triton(x), silu_and_mul_ref(x), **tol(dtype))


def test_silu_and_mul_empty(device: str) -> None:
    assert silu_and_mul_triton(torch.randn(0, 32, device=device)).shape == (0, 16)


def test_dispatchers_cpu_run_reference() -> None:
    x, w = torch.randn(2, 8), torch.randn(8)
    torch.testing.assert_close(rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5))
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x))
