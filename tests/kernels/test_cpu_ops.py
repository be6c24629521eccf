"""The C++ CPU kernels (kernels/cpu/) against their torch references: paged attention
read in place, the KV write, and the GGUF block linear; and the thread binding."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from localllm.kernels import cpu_ops
from localllm.kernels.paged_attention import CPU_INPLACE_MAX_Q, paged_attention_cpu, paged_attention_ref

pytestmark = pytest.mark.skipif(not cpu_ops.load(), reason="CPU kernels could not be built here")


def _paged(lens: list[int], q_lens: list[int], heads: int, kv_heads: int, num_blocks: int = 512, bs: int = 16,
           head_dim: int = 64):
    """A random pool and a batch whose block tables are scattered over it."""
    k = torch.randn(num_blocks, bs, kv_heads, head_dim)
    v = torch.randn(num_blocks, bs, kv_heads, head_dim)
    width = max(-(-n // bs) for n in lens)
    perm = torch.randperm(num_blocks)
    tables = torch.stack([perm[i * width : (i + 1) * width] for i in range(len(lens))]).int()
    qsl = torch.tensor([0, *np.cumsum(q_lens)], dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), heads, head_dim) * 2
    return q, k, v, qsl, torch.tensor(lens, dtype=torch.int32), tables


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 8, 64), (32, 8, 128), (4, 1, 64), (6, 2, 32)])
def test_paged_attention_in_place_matches_reference(heads: int, kv_heads: int, head_dim: int) -> None:
    # decodes of very different lengths (one long enough to split), extends over a cached
    # prefix (up to CPU_INPLACE_MAX_Q new tokens, one of them long enough to split), and one
    # long prefill the SDPA path takes; head_dim 64 and 128 take the kernels compiled for
    # them, 32 the generic one
    lens = [5, 1100, 37, 16 + 3, 40 + 16, 700 + 9, 60]
    q_lens = [1, 1, 1, 3, CPU_INPLACE_MAX_Q, 9, 60]
    q, k, v, qsl, sl, tables = _paged(lens, q_lens, heads, kv_heads, head_dim=head_dim)
    ref = paged_attention_ref(q, k, v, qsl, sl, tables, 0.125, 3)
    out = paged_attention_cpu(q, k, v, qsl, sl, tables, 0.125)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    # the raw op leaves rows of longer sequences to the caller
    raw = torch.ops.localllm_cpu.paged_attention(q, k, v, qsl, sl, tables, 0.125, CPU_INPLACE_MAX_Q)
    assert raw[qsl[-2] :].abs().max() == 0
    torch.testing.assert_close(raw[: qsl[-2]], ref[: qsl[-2]], atol=2e-5, rtol=1e-4)


def test_paged_attention_rejects_block_ids_outside_the_pool() -> None:
    q, k, v, qsl, sl, tables = _paged([20], [1], 4, 2)
    tables[0, 1] = 10_000
    with pytest.raises(RuntimeError, match="outside the KV pool"):
        torch.ops.localllm_cpu.paged_attention(q, k, v, qsl, sl, tables, 0.125, 16)


def test_store_kv_writes_slots_and_skips_padding() -> None:
    kc = torch.zeros(4, 16, 2, 64)
    vc = torch.zeros(4, 16, 2, 64)
    qkv = torch.randn(3, 3 * 128)  # k and v as strided views of one fused projection, as in the model
    k, v = qkv[:, 128:256].view(3, 2, 64), qkv[:, 256:].view(3, 2, 64)
    slots = torch.tensor([17, -1, 63])
    torch.ops.localllm_cpu.store_kv(k, v, kc, vc, slots)
    flat_k, flat_v = kc.view(-1, 2, 64), vc.view(-1, 2, 64)
    assert torch.equal(flat_k[17], k[0]) and torch.equal(flat_v[63], v[2])
    written = (flat_k.abs().sum((1, 2)) > 0).nonzero().flatten().tolist()
    assert written == [17, 63]  # the padding row (slot -1) wrote nothing


def quantized_x(x: torch.Tensor, levels: int) -> torch.Tensor:
    """What the kernel multiplies by: x per 32-block rounded to int8, then (level 2) the
    remainder rounded again."""
    out = torch.zeros_like(x)
    rest = x.clone()
    for _ in range(levels):
        b = rest.view(x.shape[0], -1, 32)
        d = b.abs().amax(-1, keepdim=True) / 127
        q = (torch.round(b / torch.where(d > 0, d, 1)) * d).view_as(x)
        out, rest = out + q, rest - q
    return out


@pytest.mark.skipif(not cpu_ops.has_gguf_kernels(), reason="GGUF kernels need an x86-64-v3 CPU")
@pytest.mark.parametrize("type_", [2, 3, 8], ids=["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("levels", [1, 2])
@pytest.mark.parametrize("out_features", [96, 104])  # an even and an odd number of 8-row tiles
def test_gguf_linear_matches_gguf_reference(type_: int, levels: int, out_features: int) -> None:
    from localllm.quant.gguf import GGUFBlocks, GGUFLinear, dequantize_blocks, quantize_blocks

    w = torch.randn(out_features, 160) * 0.05
    blocks = quantize_blocks(w, type_)
    lin = GGUFLinear(160, out_features, type_, output_sizes=[32, out_features - 32])
    lin.load_weight("weight", GGUFBlocks(type_, blocks[:32].clone()), 0)
    lin.load_weight("weight", GGUFBlocks(type_, blocks[32:].clone()), 1)
    ref_w = dequantize_blocks(blocks, type_)
    assert torch.equal(lin.dequantize(), ref_w)  # the file's own values, not rounded again
    rows = torch.tensor([0, 7, 8, 95, 42])
    assert torch.equal(lin.dequantize_rows(rows), ref_w[rows])
    for m in (1, 5, 16):
        x = torch.randn(m, 160)
        y = torch.ops.localllm_cpu.gguf_linear(x, lin.packed, type_, levels)
        ref = quantized_x(x, levels).double() @ ref_w.double().T
        torch.testing.assert_close(y.double(), ref, atol=1e-5, rtol=1e-5)
    # two levels follow the float activations far more closely than one
    x = torch.randn(4, 160)
    exact = x.double() @ ref_w.double().T
    err = {lv: (torch.ops.localllm_cpu.gguf_linear(x, lin.packed, type_, lv) - exact).abs().max()
           for lv in (1, 2)}
    assert err[2] < err[1] / 20


@pytest.mark.skipif(not cpu_ops.has_gguf_kernels(), reason="GGUF kernels need an x86-64-v3 CPU")
@pytest.mark.parametrize("type_", [2, 3, 8], ids=["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_dequantize_is_the_files_weight(type_: int) -> None:
    """The dense expansion prefill multiplies with: exact in fp32, bf16-rounded in bf16."""
    from localllm.quant.gguf import GGUFBlocks, GGUFLinear, dequantize_blocks, quantize_blocks

    w = torch.randn(64, 96) * 0.05
    blocks = quantize_blocks(w, type_)
    lin = GGUFLinear(96, 64, type_)
    lin.load_weight("weight", GGUFBlocks(type_, blocks), None)
    ref = dequantize_blocks(blocks, type_)
    dense = torch.ops.localllm_cpu.gguf_dequantize(lin.packed, type_, torch.float32)
    assert torch.equal(dense, ref)
    dense16 = torch.ops.localllm_cpu.gguf_dequantize(lin.packed, type_, torch.bfloat16)
    assert torch.equal(dense16, ref.bfloat16())


def test_loading_the_kernels_leaves_subnormal_floats_alone() -> None:
    """The library is compiled with -ffast-math; loading it must not switch the process to
    flush-to-zero (a library linked with -ffast-math does, for every thread and every caller)."""
    import subprocess
    import sys

    code = ("import torch; from localllm.kernels import cpu_ops; assert cpu_ops.load(); "
            "tiny = float.fromhex('0x1p-1074'); "
            "print(tiny * 1.0 > 0, torch.tensor([1e-40]).mul(1.0).item() > 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True"]


@pytest.mark.parametrize("vocab,k", [(49152, 8), (49152, 1), (1000, 8), (300, 300), (7, 3)])
def test_topk_indices_match_torch(vocab: int, k: int) -> None:
    gen = torch.Generator().manual_seed(vocab + k)
    x = torch.randn(6, vocab, generator=gen) * 4
    x[1, : vocab // 2] = float("-inf")  # a masked row
    if vocab > 100:
        x[2, 40:60] = float("nan")  # NaN counts as the smallest
    x[3] = x[3].abs() + 100.0 if vocab < 10 else x[3]  # the top inside one chunk
    got = cpu_ops.topk_indices(x, k)
    clean = torch.nan_to_num(x, nan=float("-inf"))
    want = clean.topk(k, dim=-1).indices
    assert torch.equal(clean.gather(1, got), clean.gather(1, want))  # the same values, in order
    assert torch.equal(got[[0, 4, 5]], want[[0, 4, 5]])  # rows without ties: the same indices


def test_topk_indices_break_ties_by_the_lower_index() -> None:
    x = torch.zeros(1, 5000)
    x[0, [4000, 17, 2500]] = 3.0
    assert cpu_ops.topk_indices(x, 2).tolist() == [[17, 2500]]


def test_argmax_rows_match_torch_and_take_the_first_of_ties() -> None:
    from localllm.engine.sampler import argmax_rows

    x = torch.randn(9, 49152, generator=torch.Generator().manual_seed(5))
    x[2, [30000, 40000]] = 99.0
    x[3] = float("-inf")
    got = argmax_rows(x)
    assert got.tolist() == x.argmax(-1).tolist()
    assert got[2] == 30000 and got[3] == 0


def _threads_bound_to(cpu: int) -> int:
    """Threads of this process whose affinity is exactly ``cpu`` (from /proc, not from the op)."""
    n = 0
    for status in Path("/proc/self/task").glob("*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line)
        except OSError:  # the thread ended meanwhile
            continue
        n += fields.get("Cpus_allowed_list", "").strip() == str(cpu)
    return n


def test_bind_threads_binds_each_thread_of_the_calling_threads_team() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2 or not cpu_ops.load():
        pytest.skip("needs two CPUs and the C++ ops")
    want = allowed[::-1][:2]  # thread 0 (the caller) on the higher CPU: not what the OS would pick
    seen: dict[str, object] = {}

    def run() -> None:  # on its own thread, so the test process's main thread stays unbound
        seen["team"] = torch.get_num_threads()
        seen["bound"] = cpu_ops.bind_threads(want)
        seen["caller"] = os.sched_getaffinity(0)
        seen["workers"] = _threads_bound_to(want[1])
        seen["again"] = cpu_ops.bind_threads(want)  # already bound: the same answer

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if seen["team"] < 2:
        pytest.skip("one OpenMP thread here")
    assert seen["bound"] == want and seen["again"] == want
    assert seen["caller"] == {want[0]} and seen["workers"] >= 1
    assert os.sched_getaffinity(0) == set(allowed)
