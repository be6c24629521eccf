"""The batch-invariant float linear (kernels/cpu/dense/, op ``localllm_cpu::dense_linear``):
a row's outputs are the same bits whatever rows come with it, wherever it sits in the batch
and however many threads run, for fp32 and bf16 weights; and they are the linear's values."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from localllm.kernels import cpu_ops
from tests.tiers import matrix

pytestmark = pytest.mark.skipif(not cpu_ops.load(), reason="CPU kernels could not be built here")

# (K, N): the default model's hidden size into a non-multiple of the 4-column tile, and a K
# with a tail shorter than a vector (and an odd one: bf16 pairs)
SHAPES = matrix([(576, 30), (77, 9), (1536, 64)], ci=[(576, 30), (77, 9)])


# "weight_dtype", not "dtype": this conftest skips bf16 "dtype" cases under the Triton
# interpreter, and this is C++, not Triton
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("K, N", SHAPES)
def test_every_row_is_the_same_bits_alone_or_in_any_batch(weight_dtype: torch.dtype, K: int, N: int) -> None:
    dtype = weight_dtype
    gen = torch.Generator().manual_seed(K * N)
    rows = 23
    x = torch.randn(rows, K, generator=gen)
    w = (torch.randn(N, K, generator=gen) / K**0.5).to(dtype)
    bias = torch.randn(N, generator=gen)
    full = torch.ops.localllm_cpu.dense_linear(x, w, bias)
    assert full.dtype == torch.float32 and full.shape == (rows, N)
    # the linear's values: fp32 sums of the exact products (x rounded to bf16 for a bf16 weight)
    ref = F.linear(x.to(dtype).double(), w.double(), bias.double())
    torch.testing.assert_close(full.double(), ref, rtol=1e-5, atol=1e-5)
    threads = torch.get_num_threads()
    try:
        for n_threads in sorted({1, threads}):
            torch.set_num_threads(n_threads)
            for m in range(1, rows + 1):  # every batch size, the rows at its end and at its start
                assert torch.equal(torch.ops.localllm_cpu.dense_linear(x[rows - m:], w, bias), full[rows - m:])
                assert torch.equal(torch.ops.localllm_cpu.dense_linear(x[:m], w, bias), full[:m])
    finally:
        torch.set_num_threads(threads)


def test_wrong_shapes_and_dtypes_are_refused_in_one_line() -> None:
    w = torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="x must be"):
        torch.ops.localllm_cpu.dense_linear(torch.randn(2, 15), w)
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        torch.ops.localllm_cpu.dense_linear(torch.randn(2, 16), w.half())
    with pytest.raises(RuntimeError, match="bias must be"):
        torch.ops.localllm_cpu.dense_linear(torch.randn(2, 16), w, torch.randn(7))
