"""The grouped GGUF linear of a mixture of experts (kernels/cpu/gguf/experts.cpp): one call
runs every routed expert's rows on its slice of the stacked packed weight, and each row's
result is the per-expert ``gguf_linear``'s bit for bit (AMX and VNNI/AVX2 row tiles alike)."""

from __future__ import annotations

import pytest
import torch

from localllm.kernels import cpu_ops
from localllm.quant import gguf_formats as gf
from localllm.quant.gguf_experts import expert_slice
from tests.kernels.test_gguf_kquants import random_blocks

pytestmark = pytest.mark.skipif(not cpu_ops.has_gguf_kernels(), reason="GGUF CPU kernels not built here")

E, N, K = 5, 24, 256
# rows per expert: none, one, a 4+2+1 tail, an AMX group of 16 plus a tail, two
COUNTS = [0, 1, 7, 19, 2]


def _packed(name: str) -> list[torch.Tensor]:
    return list(torch.ops.localllm_cpu.gguf_repack(random_blocks(name, E * N, K), gf.fmt(name).type_id, K))


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0", "MXFP4"])
@pytest.mark.parametrize("amx", ["", "0"])
def test_grouped_rows_equal_per_expert_linears(name: str, amx: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCALLLM_GGUF_AMX", amx)  # "0": the VNNI/AVX2 row tiles only (read per call)
    packed, t = _packed(name), gf.fmt(name).type_id
    offsets = torch.tensor([0, *COUNTS]).cumsum(0)
    x = torch.randn(int(offsets[-1]), K, generator=torch.Generator().manual_seed(1))
    for levels in (1, 2):
        got = torch.ops.localllm_cpu.gguf_linear_grouped(x, packed, t, levels, offsets)
        want = torch.cat([torch.ops.localllm_cpu.gguf_linear(x[offsets[e]:offsets[e + 1]], expert_slice(packed, E, e),
                                                             t, levels) for e in range(E)])
        assert got.shape == (x.shape[0], N) and torch.equal(got, want)


def test_no_rows_and_bad_offsets() -> None:
    packed, t = _packed("Q8_0"), gf.fmt("Q8_0").type_id
    empty = torch.ops.localllm_cpu.gguf_linear_grouped(torch.empty(0, K), packed, t, 2, torch.zeros(E + 1, dtype=torch.long))
    assert empty.shape == (0, N)
    with pytest.raises(RuntimeError, match="offsets must run from 0"):
        torch.ops.localllm_cpu.gguf_linear_grouped(torch.randn(3, K), packed, t, 2, torch.zeros(E + 1, dtype=torch.long))
    with pytest.raises(RuntimeError, match="whole 8-row tiles"):
        torch.ops.localllm_cpu.gguf_linear_grouped(torch.randn(0, K), packed, t, 2, torch.zeros(8, dtype=torch.long))
