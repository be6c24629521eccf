"""The Triton paged attention kernel against its SDPA reference, on tiny shapes."""

from __future__ import annotations

import pytest
import torch

from localllm.kernels.paged_attention import (
    paged_attention,
    paged_attention_ref,
    paged_attention_triton,
)

TOL = {torch.float32: 2e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def make_batch(
    lens: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    cache_dtype: torch.dtype | None = None,
) -> dict:
    """lens: (q_len, seq_len) per sequence, decodes first. Blocks are shuffled so the kernel
    really follows the block table, and spare blocks hold garbage that must never be read."""
    num_blocks_per_seq = [-(-s // block_size) for _, s in lens]
    num_blocks = sum(num_blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, device=device)
    max_blocks = max(num_blocks_per_seq, default=1) or 1
    block_tables = torch.zeros((len(lens), max_blocks), dtype=torch.int32, device=device)
    used = 0
    for b, n in enumerate(num_blocks_per_seq):
        block_tables[b, :n] = perm[used : used + n]
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, device=device).to(dtype)
    v_cache = torch.randn(shape, device=device).to(dtype)
    k_scale = v_scale = None
    if cache_dtype is not None:
        k_scale, v_scale = 0.05, 0.03
        k_cache = (k_cache.float() / k_scale).to(cache_dtype)
        v_cache = (v_cache.float() / v_scale).to(cache_dtype)
    q_lens = [ql for ql, _ in lens]
    total = sum(q_lens)
    q = torch.randn((total, num_heads, head_dim), device=device).to(dtype)
    qsl = torch.zeros(len(lens) + 1, dtype=torch.int32, device=device)
    if lens:
        qsl[1:] = torch.tensor(q_lens, device=device).cumsum(0)
    seq_lens = torch.tensor([s for _, s in lens], dtype=torch.int32, device=device)
    num_decodes = 0
    for ql, _ in lens:
        if ql != 1:
            break
        num_decodes += 1
    return dict(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        query_start_loc=qsl,
        seq_lens=seq_lens,
        block_tables=block_tables,
        scale=head_dim**-0.5,
        num_decodes=num_decodes,
        k_scale=k_scale,
        v_scale=v_scale,
    )


def check(batch: dict, **kw: object) -> None:
    q = batch["q"]
    ref_batch = dict(batch)
    if q.dtype != torch.float32:
        # The reference in fp32 is the ground truth for every kernel dtype.
        ref_batch["q"] = q.float()
        if batch["k_cache"].dtype in (torch.float16, torch.bfloat16):
            ref_batch["k_cache"] = batch["k_cache"].float()
            ref_batch["v_cache"] = batch["v_cache"].float()
    ref = paged_attention_ref(**ref_batch)
    out = paged_attention_triton(**batch, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[q.dtype], rtol=TOL[q.dtype])


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_block_boundaries(device: str, num_splits: int) -> None:
    # Lengths 1, one short of a block, exactly a block, one over, and several tiles.
    lens = [(1, 1), (1, 15), (1, 16), (1, 17), (1, 50)]
    batch = make_batch(lens, 8, 2, 64, 16, torch.float32, device)
    check(batch, num_splits=num_splits, tile_n=16)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (6, 2), (4, 1), (8, 1)])
def test_gqa_ratios_mixed_batch(device: str, num_heads: int, num_kv_heads: int) -> None:
    # Two decodes, an extend over a cached prefix, and a fresh prefill, in one call.
    lens = [(1, 9), (1, 23), (7, 20), (13, 13)]
    batch = make_batch(lens, num_heads, num_kv_heads, 64, 8, torch.float32, device)
    check(batch, num_splits=1, block_m=16, tile_n=16)


@pytest.mark.parametrize("head_dim", [80, 96])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_head_dims(device: str, head_dim: int, dtype: torch.dtype) -> None:
    # Padded BLOCK_D (80 -> 128, 96 -> 128) with an odd block size and ragged prefills.
    lens = [(1, 11), (5, 12), (9, 9)]
    batch = make_batch(lens, 4, 2, head_dim, 5, dtype, device)
    check(batch, num_splits=1, block_m=16, tile_n=16)


def test_head_dim_128_decode_split(device: str) -> None:
    lens = [(1, 70), (1, 3)]
    batch = make_batch(lens, 8, 2, 128, 16, torch.float16, device)
    check(batch, num_splits=8, tile_n=16)


def test_prefill_tiles_not_multiple(device: str) -> None:
    # 19 query tokens with 5 rows of 3 heads per tile (ratio 3): tiles end mid-sequence.
    lens = [(19, 19), (3, 40), (0, 6)]
    batch = make_batch(lens, 3, 1, 64, 16, torch.float32, device)
    check(batch, block_m=16, tile_n=16)


def test_split_heuristic_default(device: str) -> None:
    # Default knobs: the decode launch picks its own split count.
    lens = [(1, 33), (1, 64), (2, 40)]
    batch = make_batch(lens, 4, 4, 64, 16, torch.float16, device)
    check(batch)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_fp8_kv_cache(device: str, num_splits: int) -> None:
    lens = [(1, 37), (1, 5), (6, 22)]
    batch = make_batch(lens, 4, 2, 64, 16, torch.float16, device, cache_dtype=torch.float8_e4m3fn)
    check(batch, num_splits=num_splits, block_m=16, tile_n=16)
    # Scales given as tensors (the CUDA-graph-friendly form) give the same result.
    tensors = dict(batch, k_scale=torch.tensor(batch["k_scale"]), v_scale=torch.tensor(batch["v_scale"]))
    a = paged_attention_triton(**batch, num_splits=num_splits, block_m=16, tile_n=16)
    b = paged_attention_triton(**{**tensors, "k_scale": tensors["k_scale"].to(device),
                                  "v_scale": tensors["v_scale"].to(device)},
                               num_splits=num_splits, block_m=16, tile_n=16)  # fmt: skip
    torch.testing.assert_close(a, b)


def test_empty_batch(device: str) -> None:
    batch = make_batch([], 4, 2, 64, 16, torch.float16, device)
    out = paged_attention_triton(**batch)
    assert out.shape == (0, 4, 64)
    # Sequences present but no query tokens at all.
    batch = make_batch([(0, 5)], 4, 2, 64, 16, torch.float16, device)
    assert paged_attention_triton(**batch).shape == (0, 4, 64)


def test_dispatcher_cpu_runs_reference() -> None:
    batch = make_batch([(1, 5), (3, 3)], 4, 2, 64, 4, torch.float32, "cpu")
    torch.testing.assert_close(paged_attention(**batch), paged_attention_ref(**batch))
    # The optional FP8 scale arguments keep the old positional call working.
    args = [batch[k] for k in ("q", "k_cache", "v_cache", "query_start_loc", "seq_lens", "block_tables", "scale")]
    torch.testing.assert_close(paged_attention(*args, batch["num_decodes"]), paged_attention_ref(**batch))


def dense_attention(batch: dict, window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Explicit softmax attention over each sequence's blocks, read one token at a time: an
    implementation that shares nothing with the reference's gather, packing or SDPA. With a
    window, query p sees keys p - window + 1 .. p; with sinks, head h's softmax also spans the
    logit sinks[h], whose value is zero."""
    q, kc, vc = batch["q"].double(), batch["k_cache"], batch["v_cache"]
    if kc.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        kc, vc = kc.double() * batch["k_scale"], vc.double() * batch["v_scale"]
    block_size, group = kc.shape[1], q.shape[1] // kc.shape[2]
    out = torch.empty_like(q)
    qsl, lens = batch["query_start_loc"].tolist(), batch["seq_lens"].tolist()
    for b, kv_len in enumerate(lens):
        table = batch["block_tables"][b].tolist()
        slots = [(table[t // block_size], t % block_size) for t in range(kv_len)]
        k = torch.stack([kc[blk, off] for blk, off in slots]).double()  # [L, KVH, D]
        v = torch.stack([vc[blk, off] for blk, off in slots]).double()
        for j, row in enumerate(range(qsl[b], qsl[b + 1])):
            visible = kv_len - (qsl[b + 1] - qsl[b]) + j + 1
            first = max(0, visible - window) if window else 0
            for h in range(q.shape[1]):
                scores = (k[first:visible, h // group] @ q[row, h]) * batch["scale"]
                if sinks is not None:
                    probs = torch.softmax(torch.cat((scores, sinks[h : h + 1].double())), 0)[:-1]
                else:
                    probs = torch.softmax(scores, 0)
                out[row, h] = probs @ v[first:visible, h // group]
    return out


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(3, 3), (9, 3), (8, 2), (8, 1)])
@pytest.mark.parametrize("lens", [[(1, 40), (1, 40)], [(1, 5), (1, 33), (1, 16), (6, 21), (9, 9)]])
def test_reference_matches_dense_attention(num_heads: int, num_kv_heads: int, lens: list) -> None:
    # equal decode lengths take the unmasked path, ragged ones the masked one
    batch = make_batch(lens, num_heads, num_kv_heads, 32, 16, torch.float32, "cpu")
    torch.testing.assert_close(paged_attention_ref(**batch).double(), dense_attention(batch), atol=1e-5, rtol=1e-5)


def test_reference_fp8_cache_matches_dense_attention() -> None:
    batch = make_batch([(1, 20), (1, 37), (5, 12)], 8, 2, 32, 16, torch.float32, "cpu", torch.float8_e4m3fn)
    torch.testing.assert_close(paged_attention_ref(**batch).double(), dense_attention(batch), atol=1e-4, rtol=1e-4)


# ---- sliding windows: a query sees only the last `window` positions ----

# decodes inside and past the window, an extend whose chunk straddles the window's edge, a
# prefill longer than the window, a window of one token
WINDOW_LENS = [(1, 5), (1, 40), (1, 17), (6, 30), (21, 21)]


@pytest.mark.parametrize("window", [1, 7, 16, 64])
def test_reference_window_matches_dense_attention(window: int) -> None:
    batch = make_batch(WINDOW_LENS, 8, 2, 32, 8, torch.float32, "cpu")
    got = paged_attention_ref(**batch, sliding_window=window).double()
    torch.testing.assert_close(got, dense_attention(batch, window), atol=1e-5, rtol=1e-5)
    if window < 40:  # the window changed the answer: not full attention in disguise
        assert (got - dense_attention(batch)).abs().max() > 1e-3


def test_dispatcher_applies_the_window_on_cpu() -> None:
    batch = make_batch(WINDOW_LENS, 4, 2, 32, 8, torch.float32, "cpu")
    torch.testing.assert_close(paged_attention(**batch, sliding_window=7).double(), dense_attention(batch, 7),
                               atol=1e-5, rtol=1e-5)
    decodes = make_batch([(1, 5), (1, 40), (1, 17)], 4, 2, 32, 8, torch.float32, "cpu")  # the all-decode call
    torch.testing.assert_close(paged_attention(**decodes, sliding_window=7).double(), dense_attention(decodes, 7),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("window", "num_splits"), [(7, 1), (7, 4), (20, 2)])
def test_triton_window(device: str, window: int, num_splits: int) -> None:
    batch = make_batch(WINDOW_LENS, 4, 2, 32, 8, torch.float32, device)
    out = paged_attention_triton(**batch, num_splits=num_splits, block_m=16, tile_n=8, sliding_window=window)
    torch.testing.assert_close(out.double().cpu(), dense_attention({k: v.cpu() if isinstance(v, torch.Tensor) else v
                                                                    for k, v in batch.items()}, window),
                               atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("head_dim", [16, 64, 256])  # 64, 128, 256: the fixed-size fast paths
@pytest.mark.parametrize(("max_q", "splits"), [(1, 0), (16, 0), (16, 1), (32, 3)])
def test_cpu_kernel_window(head_dim: int, max_q: int, splits: int) -> None:
    from localllm.kernels import cpu_ops

    if not cpu_ops.load():
        pytest.skip("no C++ compiler: the CPU kernels are not built here")
    lens = WINDOW_LENS if max_q > 1 else [(1, 5), (1, 40), (1, 17), (1, 300)]
    batch = make_batch(lens, 8, 2, head_dim, 8, torch.float32, "cpu")
    for window in (0, 1, 7, 200):
        out = torch.ops.localllm_cpu.paged_attention(
            batch["q"], batch["k_cache"], batch["v_cache"], batch["query_start_loc"], batch["seq_lens"],
            batch["block_tables"], batch["scale"], max_q, splits, window)
        want = dense_attention(batch, window or None)
        starts = batch["query_start_loc"].tolist()
        rows = [r for b in range(len(lens)) if starts[b + 1] - starts[b] <= max_q for r in range(starts[b], starts[b + 1])]
        torch.testing.assert_close(out[rows].double(), want[rows], atol=1e-5, rtol=1e-5)


# ---- attention sinks (gpt-oss): a per-head logit in every softmax's denominator ----


def _sinks(heads: int) -> torch.Tensor:
    # around the scores' size, so some rows give the sink most of the weight and some little
    return torch.randn(heads) * 3


@pytest.mark.parametrize("window", [0, 7])
def test_sinks_reference_matches_dense_attention(window: int) -> None:
    from localllm.kernels.paged_attention import paged_attention_sinks_ref

    batch = make_batch(WINDOW_LENS, 8, 2, 32, 8, torch.float32, "cpu")
    sinks = _sinks(8)
    got = paged_attention_sinks_ref(batch["q"], batch["k_cache"], batch["v_cache"], batch["query_start_loc"],
                                    batch["seq_lens"], batch["block_tables"], batch["scale"], sinks, window, None, None)
    want = dense_attention(batch, window or None, sinks)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    assert (want - dense_attention(batch, window or None)).abs().max() > 1e-2  # the sinks changed the answer


@pytest.mark.parametrize("head_dim", [16, 64])  # the generic kernel and a fixed-size one
@pytest.mark.parametrize(("max_q", "splits"), [(1, 0), (32, 0), (32, 1), (32, 3)])
def test_cpu_kernel_sinks(head_dim: int, max_q: int, splits: int) -> None:
    """The C++ kernel with sinks, window or none: decodes (one split into slices), extends
    and a prefill, in one slice or several (the sink joins the merged denominator once)."""
    from localllm.kernels import cpu_ops

    if not cpu_ops.load():
        pytest.skip("no C++ compiler: the CPU kernels are not built here")
    lens = WINDOW_LENS if max_q > 1 else [(1, 5), (1, 40), (1, 17), (1, 300)]
    batch = make_batch(lens, 8, 2, head_dim, 8, torch.float32, "cpu")
    sinks = _sinks(8)
    for window in (0, 7):
        out = torch.ops.localllm_cpu.paged_attention(
            batch["q"], batch["k_cache"], batch["v_cache"], batch["query_start_loc"], batch["seq_lens"],
            batch["block_tables"], batch["scale"], max_q, splits, window, sinks)
        torch.testing.assert_close(out.double(), dense_attention(batch, window or None, sinks), atol=1e-5, rtol=1e-5)


def test_dispatcher_takes_sinks_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a gpt-oss layer calls: every row (a prefill too) gets the sinks, window or not,
    from the C++ kernel where it is built (the torch form otherwise)."""
    import sys

    from localllm.kernels import cpu_ops

    if cpu_ops.load():
        def no_torch_form(*args: object) -> torch.Tensor:
            raise AssertionError("the C++ kernel takes sinks")

        monkeypatch.setattr(sys.modules["localllm.kernels.paged_attention"], "paged_attention_sinks_ref", no_torch_form)
    batch = make_batch(WINDOW_LENS, 4, 2, 32, 8, torch.float32, "cpu")
    sinks = _sinks(4)
    for window in (None, 7):
        got = paged_attention(**batch, sliding_window=window, sinks=sinks)
        torch.testing.assert_close(got.double(), dense_attention(batch, window, sinks), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("window", "num_splits"), [(0, 1), (7, 1), (7, 4), (0, 2)])
def test_triton_sinks(device: str, window: int, num_splits: int) -> None:
    """Decodes (split-K or not: the sink joins once, in the merge) and extends/prefills."""
    batch = make_batch(WINDOW_LENS, 4, 2, 32, 8, torch.float32, device)
    sinks = _sinks(4).to(device)
    out = paged_attention_triton(**batch, num_splits=num_splits, block_m=16, tile_n=8, sliding_window=window,
                                 sinks=sinks)
    cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    torch.testing.assert_close(out.double().cpu(), dense_attention(cpu, window or None, sinks.cpu()),
                               atol=2e-4, rtol=2e-4)
