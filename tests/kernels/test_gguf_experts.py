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


def _block_reference(x, weights, ids, w13, t13, w3, t3, w2, t2, b13, b2, limit, alpha, levels, E):  # type: ignore[no-untyped-def]
    """The block as torch ops around the grouped calls (what moe_experts_gguf ran before)."""
    from localllm.models.moe import activate

    grouped = torch.ops.localllm_cpu.gguf_linear_grouped
    T, k = ids.shape
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    offsets = torch.zeros(E + 1, dtype=torch.long)
    offsets[1:] = torch.bincount(flat, minlength=E).cumsum(0)
    rows = x[order // k]
    h = grouped(rows, w13, t13, levels, offsets)
    if w3:
        h = torch.cat([h, grouped(rows, w3, t3, levels, offsets)], 1)
    if b13 is not None:
        h = h + b13[expert]
    out = grouped(activate(h, limit, alpha), w2, t2, levels, offsets)
    if b2 is not None:
        out = out + b2[expert]
    out = out * weights.flatten()[order].unsqueeze(1)
    return torch.zeros(T, x.shape[1]).index_add_(0, order // k, out)


@pytest.mark.parametrize(("gate", "up", "down"), [("Q4_K", "Q4_K", "Q6_K"), ("Q4_K", "Q6_K", "Q4_K"),
                                                  ("MXFP4", "MXFP4", "MXFP4")])
def test_moe_block_equals_the_torch_composition(gate: str, up: str, down: str) -> None:
    """``gguf_moe_experts`` (the whole block in C++: sort, both projections, activation, weighted
    sum) gives the grouped calls' composition in torch, fused or split gate/up, with and without
    biases and gpt-oss's clamp; experts no token picked and one token alone included."""
    H, I, k = 256, 256, 3
    g = torch.Generator().manual_seed(2)
    fused = gate == up
    w13 = list(torch.ops.localllm_cpu.gguf_repack(random_blocks(gate, E * (2 * I if fused else I), H),
                                                   gf.fmt(gate).type_id, H))
    w3 = [] if fused else list(torch.ops.localllm_cpu.gguf_repack(random_blocks(up, E * I, H), gf.fmt(up).type_id, H))
    w2 = list(torch.ops.localllm_cpu.gguf_repack(random_blocks(down, E * H, I), gf.fmt(down).type_id, I))
    t13, t3, t2 = gf.fmt(gate).type_id, gf.fmt(up).type_id if not fused else -1, gf.fmt(down).type_id
    for T in (1, 6):
        x = torch.randn(T, H, generator=g)
        ids = torch.stack([torch.randperm(E - 1, generator=g)[:k] for _ in range(T)])  # expert E - 1: no rows
        weights = torch.softmax(torch.randn(T, k, generator=g), 1)
        for bias, limit in ((False, 0.0), (True, 0.0), (True, 0.7)):
            b13 = torch.randn(E, 2 * I, generator=g) if bias else None
            b2 = torch.randn(E, H, generator=g) if bias else None
            for levels in (1, 2):
                got = torch.ops.localllm_cpu.gguf_moe_experts(x, weights, ids, w13, t13, w3, t3, w2, t2, b13, b2,
                                                              limit, 1.702, levels)
                want = _block_reference(x, weights, ids, w13, t13, w3, t3, w2, t2, b13, b2, limit, 1.702, levels, E)
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_moe_block_refuses_bad_input() -> None:
    t = gf.fmt("Q8_0").type_id
    gate_up = list(torch.ops.localllm_cpu.gguf_repack(random_blocks("Q8_0", E * 64, K), t, K))  # I = 32
    down = list(torch.ops.localllm_cpu.gguf_repack(random_blocks("Q8_0", E * K, 32), t, 32))
    x, w = torch.randn(2, K), torch.ones(2, 1)
    with pytest.raises(RuntimeError, match="outside"):
        torch.ops.localllm_cpu.gguf_moe_experts(x, w, torch.tensor([[0], [E]]), gate_up, t, [], -1, down, t,
                                                None, None, 0.0, 1.0, 2)
    with pytest.raises(RuntimeError, match="gate_up does not match down"):  # 24 rows an expert, not 2 x 32
        torch.ops.localllm_cpu.gguf_moe_experts(x, w, torch.zeros(2, 1, dtype=torch.long), _packed("Q8_0"), t, [], -1,
                                                down, t, None, None, 0.0, 1.0, 2)
