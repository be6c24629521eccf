"""A GGUF linear's rows do not depend on what else is in the batch: each row's kernel is chosen
by its own sequence's chunk (decodes and short prompt chunks on the integer kernel, long
prompt chunks on the dense GEMM), never by the batch's total row count."""

from __future__ import annotations

import pytest
import torch

from localllm.kernels import cpu_ops
from localllm.models import forward_context

pytestmark = pytest.mark.skipif(not (cpu_ops.load() and cpu_ops.has_gguf_kernels()),
                                reason="GGUF kernels need the CPU kernels on an x86-64-v3 CPU")

K, N = 96, 64


@pytest.fixture(scope="module")
def lin():
    from localllm.quant.gguf import Q4_1, GGUFBlocks, GGUFLinear, quantize_blocks

    torch.manual_seed(0)
    blocks = quantize_blocks(torch.randn(N, K) * 0.05, Q4_1)
    layer = GGUFLinear(K, N, Q4_1)
    layer.load_weight("weight", GGUFBlocks(Q4_1, blocks), None)
    return layer


def _alone(lin, x: torch.Tensor, num_decodes: int = 0) -> torch.Tensor:
    """Rows run as their own batch: decodes one at a time, a prompt chunk by itself."""
    if num_decodes:
        with forward_context.batch_rows(1, []):
            return torch.cat([lin(row[None]) for row in x])
    with forward_context.batch_rows(0, [x.shape[0]]):
        return lin(x)


def test_rows_equal_their_solo_runs_whatever_the_batch(lin) -> None:
    torch.manual_seed(1)
    decodes, short_a, short_b, long_ = (torch.randn(n, K) for n in (5, 40, 30, lin.dense_rows + 36))
    batch = torch.cat((decodes, short_a, long_, short_b))
    with forward_context.batch_rows(5, [40, long_.shape[0], 30]):
        out = lin(batch)
    # The old rule (dense for every row once the batch reached dense_rows) rounded the decodes'
    # and the short chunks' activations to bf16 on a CPU with fast bf16: their bits changed.
    expected = torch.cat((_alone(lin, decodes, num_decodes=5), _alone(lin, short_a), _alone(lin, long_),
                          _alone(lin, short_b)))
    assert torch.equal(out, expected)


def test_short_chunks_packed_past_the_dense_size_stay_on_the_integer_kernel(lin) -> None:
    torch.manual_seed(2)
    chunks = [torch.randn(n, K) for n in (30, 30, 30)]  # 90 rows together, each chunk short
    with forward_context.batch_rows(0, [30, 30, 30]):
        out = lin(torch.cat(chunks))
    assert torch.equal(out, torch.cat([_alone(lin, c) for c in chunks]))
    integer = torch.ops.localllm_cpu.gguf_linear(torch.cat(chunks), lin.packed, lin.block_type, 2)
    assert torch.equal(out, integer)


def test_a_forward_outside_a_scheduled_batch_sees_one_prompt_chunk(lin) -> None:
    """Callers that run the model directly (quantization passes, benchmarks) keep the rule by
    row count."""
    torch.manual_seed(3)
    x = torch.randn(lin.dense_rows, K)
    assert forward_context.row_split() is None
    with forward_context.batch_rows(0, [lin.dense_rows]):
        as_chunk = lin(x)
    assert torch.equal(lin(x), as_chunk)
    assert forward_context.row_split() is None  # the context is gone after the pass
