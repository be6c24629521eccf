"""AWQ packing helpers and the int4 GEMM/GEMV kernel against dequantize-then-matmul."""

from __future__ import annotations

import pytest
import torch

from localllm.kernels._triton import Config
from localllm.kernels.awq_gemm import (
    AWQ_ORDER,
    awq_dequantize,
    awq_gemm,
    awq_gemm_ref,
    awq_gemm_triton,
    awq_pack,
    awq_unpack,
)


def naive_pack(intweight: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's WQLinear_GEMM packing loop, restated column by column."""
    rows, n = intweight.shape
    packed = torch.zeros((rows, n // 8), dtype=torch.int64)
    for col in range(n // 8):
        for i in range(8):
            packed[:, col] |= intweight[:, col * 8 + AWQ_ORDER[i]].long() << (4 * i)
    return packed.to(torch.int32)  # keep the low 32 bits, as the int32 buffer does


def test_pack_known_word() -> None:
    # Columns 0..7 hold 1..8: nibbles from low to high hold columns 0, 2, 4, 6, 1, 3, 5, 7.
    w = torch.arange(1, 9, dtype=torch.int32)[None, :]
    word = awq_pack(w).item() & 0xFFFFFFFF
    assert word == 0x86427531
    assert awq_unpack(awq_pack(w)).tolist() == w.tolist()


def test_pack_matches_autoawq_loop_and_roundtrips() -> None:
    w = torch.randint(0, 16, (6, 32), dtype=torch.int32)
    assert torch.equal(awq_pack(w), naive_pack(w))
    assert torch.equal(awq_unpack(awq_pack(w)), w)


def make_awq(k: int, n: int, group_size: int, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = torch.randint(0, 16, (k, n), dtype=torch.int32)
    z = torch.randint(0, 16, (k // group_size, n), dtype=torch.int32)
    s = (torch.rand(k // group_size, n) * 0.02 + 0.005).half()
    return awq_pack(q).to(device), awq_pack(z).to(device), s.to(device)


def test_dequantize_formula() -> None:
    qweight, qzeros, scales = make_awq(64, 16, 32, "cpu")
    w = awq_dequantize(qweight, qzeros, scales, 32, torch.float32)
    q, z = awq_unpack(qweight), awq_unpack(qzeros)
    k, n = 37, 9
    assert w[k, n].item() == pytest.approx(((q[k, n] - z[k // 32, n]) * scales[k // 32, n].float()).item())


GEMV = Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 2, "GROUP_M": 1}, 4, 1)
GEMV_SPLIT3 = Config({"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 32, "SPLIT_K": 3, "GROUP_M": 1}, 4, 1)
GEMM = Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": 1, "GROUP_M": 2}, 4, 1)
GEMM_WIDE_K = Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 1, "GROUP_M": 4}, 4, 1)


@pytest.mark.parametrize(
    ("m", "k", "n", "group_size", "config"),
    [
        (1, 256, 64, 32, GEMV),  # two groups per K tile, split-K 2
        (5, 256, 64, 128, GEMV),  # K tile inside one group
        (16, 192, 64, 64, GEMV_SPLIT3),  # split count that does not divide the K tiles
        (3, 96, 40, 32, GEMV),  # K and N not multiples of the tile
        (40, 128, 64, 32, GEMM),  # several M tiles, grouped ordering
        (19, 256, 32, 64, GEMM_WIDE_K),  # 2 groups per K tile on the GEMM path
    ],
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
def test_awq_kernel(device: str, m: int, k: int, n: int, group_size: int, config: Config, dtype: torch.dtype) -> None:
    qweight, qzeros, scales = make_awq(k, n, group_size, device)
    x = torch.randn(m, k, device=device).to(dtype)
    out = awq_gemm_triton(x, qweight, qzeros, scales, group_size, config=config)
    ref = awq_gemm_ref(x.float(), qweight, qzeros, scales, group_size)
    tol = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_awq_kernel_default_config_and_leading_dims(device: str) -> None:
    qweight, qzeros, scales = make_awq(128, 64, 64, device)
    x = torch.randn(2, 3, 128, device=device).half()
    out = awq_gemm_triton(x, qweight, qzeros, scales, 64)
    ref = awq_gemm_ref(x.float(), qweight, qzeros, scales, 64)
    assert out.shape == (2, 3, 64)
    torch.testing.assert_close(out.float(), ref, atol=5e-3, rtol=5e-3)
    # The split-K counters are left at zero, so a second launch is also right.
    torch.testing.assert_close(awq_gemm_triton(x, qweight, qzeros, scales, 64), out)


def test_awq_empty(device: str) -> None:
    qweight, qzeros, scales = make_awq(64, 32, 32, device)
    assert awq_gemm_triton(torch.randn(0, 64, device=device).half(), qweight, qzeros, scales, 32).shape == (0, 32)


def test_dispatcher_cpu_runs_reference() -> None:
    qweight, qzeros, scales = make_awq(64, 32, 32, "cpu")
    x = torch.randn(2, 64)
    torch.testing.assert_close(awq_gemm(x, qweight, qzeros, scales, 32), awq_gemm_ref(x, qweight, qzeros, scales, 32))
