"""INT8 (W8A16, W8A8) and FP8 W8A8 kernels and their activation quantizers against the refs."""

from __future__ import annotations

import pytest
import torch

from localllm.kernels._triton import Config
from localllm.kernels.fp8_gemm import (
    fp8_w8a8_gemm,
    fp8_w8a8_gemm_ref,
    fp8_w8a8_gemm_triton,
    quantize_per_token_fp8_ref,
    quantize_per_token_fp8_triton,
)
from localllm.kernels.int8_gemm import (
    int8_w8a8_gemm,
    int8_w8a8_gemm_ref,
    int8_w8a8_gemm_triton,
    int8_w8a16_gemm,
    int8_w8a16_gemm_ref,
    int8_w8a16_gemm_triton,
    quantize_per_token_int8,
    quantize_per_token_int8_ref,
    quantize_per_token_int8_triton,
)

GEMV = Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 2, "GROUP_M": 1}, 4, 1)
GEMV_SPLIT3 = Config({"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 32, "SPLIT_K": 3, "GROUP_M": 1}, 4, 1)
GEMM = Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": 1, "GROUP_M": 2}, 4, 1)
SHAPES = [(1, 256, 64, GEMV), (7, 160, 48, GEMV_SPLIT3), (40, 96, 64, GEMM)]


def int8_weights(n: int, k: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=device)
    return w, (torch.rand(n, device=device) * 0.01 + 0.001)


def fp8_weights(n: int, k: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    w = (torch.randn(n, k, device=device) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    return w, (torch.rand(n, device=device) * 0.01 + 0.001)


def test_quantize_int8(device: str) -> None:
    x = torch.randn(5, 300, device=device) * torch.tensor([1.0, 10.0, 0.01, 0.0, 3.0], device=device)[:, None]
    x[0, 0] = 2.5 / 127 * x[0].abs().max()  # near a rounding tie
    xq, scale = quantize_per_token_int8_triton(x)
    rq, rscale = quantize_per_token_int8_ref(x)
    torch.testing.assert_close(scale, rscale)
    assert (xq.int() - rq.int()).abs().max() <= 1 and (xq == rq).float().mean() > 0.999
    assert xq[3].abs().max() == 0  # an all-zero row stays zero


def test_quantize_fp8(device: str) -> None:
    x = torch.randn(4, 200, device=device) * torch.tensor([1.0, 50.0, 0.02, 0.0], device=device)[:, None]
    xq, scale = quantize_per_token_fp8_triton(x)
    rq, rscale = quantize_per_token_fp8_ref(x)
    torch.testing.assert_close(scale, rscale)
    assert (xq.float() == rq.float()).float().mean() > 0.999
    torch.testing.assert_close(xq.float(), rq.float(), atol=0, rtol=0.07)


@pytest.mark.parametrize(("m", "k", "n", "config"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
def test_int8_w8a16(device: str, m: int, k: int, n: int, config: Config, dtype: torch.dtype) -> None:
    w, w_scale = int8_weights(n, k, device)
    x = torch.randn(m, k, device=device).to(dtype)
    out = int8_w8a16_gemm_triton(x, w, w_scale, config=config)
    ref = int8_w8a16_gemm_ref(x.float(), w, w_scale)
    tol = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize(("m", "k", "n", "config"), SHAPES)
def test_int8_w8a8(device: str, m: int, k: int, n: int, config: Config) -> None:
    w, w_scale = int8_weights(n, k, device)
    x = torch.randn(m, k, device=device).half()
    out = int8_w8a8_gemm_triton(x, w, w_scale, config=config)
    ref = int8_w8a8_gemm_ref(x.float(), w, w_scale)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), ref, atol=5e-3, rtol=5e-3)


@pytest.mark.parametrize(("m", "k", "n", "config"), SHAPES)
def test_fp8_w8a8(device: str, m: int, k: int, n: int, config: Config) -> None:
    if device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 tensor cores need sm89+")
    w, w_scale = fp8_weights(n, k, device)
    x = torch.randn(m, k, device=device).half()
    out = fp8_w8a8_gemm_triton(x, w, w_scale, config=config)
    ref = fp8_w8a8_gemm_ref(x.float(), w, w_scale)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)


def test_default_configs_and_empty(device: str) -> None:
    w, w_scale = int8_weights(32, 64, device)
    for m in (0, 3, 20):  # empty, GEMV default, GEMM default
        x = torch.randn(m, 64, device=device).half()
        torch.testing.assert_close(
            int8_w8a8_gemm_triton(x, w, w_scale).float(), int8_w8a8_gemm_ref(x.float(), w, w_scale), atol=5e-3, rtol=5e-3
        )
    wf, wf_scale = fp8_weights(32, 64, device)
    assert fp8_w8a8_gemm_triton(torch.randn(0, 64, device=device).half(), wf, wf_scale).shape == (0, 32)


def test_dispatchers_cpu_run_reference() -> None:
    w, w_scale = int8_weights(16, 32, "cpu")
    x = torch.randn(3, 32)
    torch.testing.assert_close(int8_w8a16_gemm(x, w, w_scale), int8_w8a16_gemm_ref(x, w, w_scale))
    torch.testing.assert_close(int8_w8a8_gemm(x, w, w_scale), int8_w8a8_gemm_ref(x, w, w_scale))
    xq, s = quantize_per_token_int8(x)
    assert xq.dtype == torch.int8 and s.shape == (3, 1)
    wf, wf_scale = fp8_weights(16, 32, "cpu")
    torch.testing.assert_close(fp8_w8a8_gemm(x, wf, wf_scale), fp8_w8a8_gemm_ref(x, wf, wf_scale))


def test_refs_agree_with_dense_math() -> None:
    """The refs themselves: W8A16 paths (fp32, bf16 CPU fast path) and the W8A8 emulation."""
    w, w_scale = int8_weights(24, 64, "cpu")
    dense = w.float() * w_scale[:, None]
    x = torch.randn(5, 64)
    torch.testing.assert_close(int8_w8a16_gemm_ref(x, w, w_scale), x @ dense.t(), atol=1e-4, rtol=1e-4)
    xb = x.bfloat16()
    torch.testing.assert_close(
        int8_w8a16_gemm_ref(xb, w, w_scale).float(), xb.float() @ dense.t(), atol=3e-2, rtol=3e-2
    )
    # Activation quantization costs at most half a quantization step per element.
    err = (int8_w8a8_gemm_ref(x, w, w_scale) - x @ dense.t()).abs().max()
    assert err <= 0.5 * (x.abs().amax() / 127) * dense.abs().sum(1).max()
