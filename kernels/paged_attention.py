"""Attention of a flat varlen batch of queries over the paged KV cache.

Layout shared by every implementation:
- q: [T, H, D], the new tokens of B sequences packed back to back, decodes first.
- k_cache, v_cache: [num_blocks, block_size, KVH, D]; H is a multiple of KVH (GQA).
- query_start_loc: [B + 1] int32, cumulative query lengths (cu_seqlens_q).
- seq_lens: [B] int32, each sequence's total length after this step (cached prefix + new).
- block_tables: [B, max_blocks] int32, row b lists sequence b's blocks in order.
Query j of sequence b sits at position seq_lens[b] - q_len[b] + j and attends causally to
keys 0..that position, all already written to the cache; with ``sliding_window`` W only to
the last W of them (positions p - W + 1 .. p, transformers' sliding_attention). The cache
keeps every position either way, so a prefix-cache hit reads the same keys.

An FP8 (e4m3) cache stores ``k / k_scale`` and ``v / v_scale``; pass the same per-tensor
scales here (a python float or a 1-element fp32 tensor; tensors keep CUDA graphs replayable).

The Triton path is one kernel, ``_paged_attention_kernel``, launched up to twice per call:
- the ``num_decodes`` leading one-token sequences, one program per (sequence, KV head), with
  the query heads of that KV head packed into the rows of one tile; when that gives too few
  programs for the GPU, the same kernel runs split-K (flash-decoding): each program covers a
  slice of the context and ``_reduce_splits_kernel`` merges the slices by their log-sum-exp;
- the prefill/extend sequences, one program per (tile of query tokens x packed heads, KV head),
  located by a binary search over query_start_loc so no host sync is needed.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from localllm.kernels._triton import (
    FP8_DTYPES,
    ScaleArg,
    capability,
    dot_fp32,
    gpu_tiles,
    next_power_of_2,
    num_sms,
    scale_tensor,
    tl,
    triton,
    use_triton,
)
from localllm.kernels import cpu_ops
from localllm.kernels.opaque_op import opaque_op


def _gather_blocks(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size, KVH, D] gathered by block ids [..., n] -> [..., n * block_size, KVH, D].

    ``index_select`` copies whole rows; advanced indexing (``cache[tables]``) goes element by
    element and measured 4-6x slower on CPU, where this gather is most of decode attention.
    """
    src = cache.view(torch.uint8) if cache.dtype in FP8_DTYPES else cache  # no fp8 index_select
    rows = src.index_select(0, tables.reshape(-1)).view(cache.dtype)
    return rows.view(*tables.shape[:-1], tables.shape[-1] * cache.shape[1], *cache.shape[2:])


def _dequant(kv: torch.Tensor, scale: ScaleArg, dtype: torch.dtype) -> torch.Tensor:
    """Upcasts gathered FP8 cache entries; a no-op for an unquantized cache."""
    if kv.dtype not in FP8_DTYPES:
        return kv
    kv = kv.to(dtype)
    return kv if scale is None else kv * (scale.to(dtype) if isinstance(scale, torch.Tensor) else scale)


def _prefill_rows(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    seqs: Iterable[int],
    k_scale: ScaleArg = None,
    v_scale: ScaleArg = None,
    sliding_window: int | None = None,
) -> None:
    """Fills ``out``'s rows of sequences ``seqs`` with one SDPA call each: the O(n) gather of a
    sequence's context is cheap next to its O(n^2) prefill work. With a window only the keys
    some query of the chunk sees are gathered."""
    starts = query_start_loc.tolist()
    lens_list = seq_lens.tolist()
    block_size = k_cache.shape[1]
    fp8 = k_cache.dtype in FP8_DTYPES
    for b in seqs:
        qs, qe, kv_len = starts[b], starts[b + 1], lens_list[b]
        n_q = qe - qs
        if n_q == 0:
            continue
        ctx = kv_len - n_q  # the first query's position
        first = max(0, ctx - sliding_window + 1) // block_size * block_size if sliding_window else 0
        blocks = block_tables[b, first // block_size : -(-kv_len // block_size)]
        k = _gather_blocks(k_cache, blocks)[: kv_len - first].transpose(0, 1).unsqueeze(0)  # [1, KVH, L, D]
        v = _gather_blocks(v_cache, blocks)[: kv_len - first].transpose(0, 1).unsqueeze(0)
        if fp8:
            k, v = _dequant(k, k_scale, q.dtype), _dequant(v, v_scale, q.dtype)
        qb = q[qs:qe].transpose(0, 1).unsqueeze(0).to(k.dtype)  # [1, H, n_q, D]
        if n_q == kv_len and not (sliding_window and sliding_window < kv_len):
            o = F.scaled_dot_product_attention(qb, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            mask = _visible(ctx + torch.arange(n_q, device=q.device), first, kv_len, sliding_window)
            o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[qs:qe] = o.squeeze(0).transpose(0, 1).to(q.dtype)


def _visible(q_pos: torch.Tensor, first: int, kv_len: int, sliding_window: int | None) -> torch.Tensor:
    """[n_q, kv_len - first] bool: query at position q_pos[i] sees key first + j."""
    k_pos = torch.arange(first, kv_len, device=q_pos.device)
    mask = k_pos[None, :] <= q_pos[:, None]
    if sliding_window:
        mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
    return mask


# Sequences with at most this many new tokens (decodes, short extends over a cached prefix)
# take the in-place C++ kernel on CPU; longer prefills gather once and run SDPA, whose
# blocked matmuls win once the O(n^2) work dominates.
CPU_INPLACE_MAX_Q = 16


@opaque_op("localllm::paged_attention_cpu")
def paged_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_inplace_q: int = CPU_INPLACE_MAX_Q,
    max_splits: int = 0,
    sliding_window: int = 0,
) -> torch.Tensor:
    """The CPU path for an fp32 cache once ``cpu_ops.load()`` succeeded: the C++ kernel reads
    the blocks of each sequence with at most ``max_inplace_q`` new tokens where they lie (its
    keys in at most ``max_splits`` slices; 0: as many as keep the threads busy); the remaining
    (long prefill) rows go through ``_prefill_rows``. One custom op, so torch.compile sees one
    opaque call per layer."""
    max_inplace_q = min(max_inplace_q, q.shape[0])  # the kernel's scratch is sized by it
    out = torch.ops.localllm_cpu.paged_attention(
        q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, max_inplace_q, max_splits,
        sliding_window,
    )
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    long = (q_lens > max_inplace_q).nonzero().flatten().tolist()
    if long:
        _prefill_rows(out, q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, long,
                      sliding_window=sliding_window or None)
    return out


@paged_attention_cpu.register_fake
def _(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, max_inplace_q=CPU_INPLACE_MAX_Q,  # type: ignore[no-untyped-def]
      max_splits=0, sliding_window=0):
    return torch.empty_like(q)


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    num_decodes: int = 0,
    k_scale: ScaleArg = None,
    v_scale: ScaleArg = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Computes in the cache dtype through SDPA (fp32 on CPU, where bf16 SDPA is 6-8x slower).

    ``num_decodes`` leading sequences have exactly one query token; they are batched into one
    SDPA call (masked only when their lengths differ). The remaining (prefill/extend)
    sequences run one SDPA call each, which is cheap next to their O(n^2) work. An FP8 cache
    is dequantized per gathered block, in q's dtype, so the whole cache is never upcast.
    """
    out = torch.empty_like(q)
    block_size = k_cache.shape[1]
    fp8 = k_cache.dtype in FP8_DTYPES
    if num_decodes:
        lens = seq_lens[:num_decodes]
        max_len = int(lens.max())
        n_blocks = -(-max_len // block_size)
        tables = block_tables[:num_decodes, :n_blocks]
        k = _gather_blocks(k_cache, tables)[:, :max_len].transpose(1, 2)  # [B, KVH, L, D]
        v = _gather_blocks(v_cache, tables)[:, :max_len].transpose(1, 2)
        if fp8:
            k, v = _dequant(k, k_scale, q.dtype), _dequant(v, v_scale, q.dtype)
        mask = None
        if int(lens.min()) < max_len or (sliding_window and sliding_window < max_len):
            k_pos = torch.arange(max_len, device=q.device)[None, :]
            visible = k_pos < lens[:, None]
            if sliding_window:
                visible &= k_pos >= lens[:, None] - sliding_window
            mask = visible[:, None, None, :]
        # GQA packing: the query heads of one KV head are the rows of one query block, so each
        # K/V head is read once (1.7-1.9x faster than SDPA's enable_gqa on CPU, measured)
        num_heads, head_dim = q.shape[1:]
        qd = q[:num_decodes].view(num_decodes, k.shape[1], -1, head_dim).to(k.dtype)  # [B, KVH, H/KVH, D]
        o = F.scaled_dot_product_attention(qd, k, v, attn_mask=mask, scale=scale)
        out[:num_decodes] = o.reshape(num_decodes, num_heads, head_dim).to(q.dtype)
    if num_decodes == seq_lens.shape[0]:
        return out
    _prefill_rows(out, q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale,
                  range(num_decodes, seq_lens.shape[0]), k_scale, v_scale, sliding_window)
    return out


@opaque_op("localllm::paged_attention_windowed_ref")
def paged_attention_windowed_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    num_decodes: int,
    sliding_window: int,
) -> torch.Tensor:
    """``paged_attention_ref`` of a windowed layer over an fp32 cache, as one opaque op: its
    host-side lengths would stop torch.compile's CPU decode graph (data-dependent guards)."""
    return paged_attention_ref(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, num_decodes,
                               sliding_window=sliding_window)


@paged_attention_windowed_ref.register_fake
def _(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, num_decodes, sliding_window):  # type: ignore[no-untyped-def]
    return torch.empty_like(q)


@opaque_op("localllm::paged_attention_sinks_ref")
def paged_attention_sinks_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sinks: torch.Tensor,
    sliding_window: int,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> torch.Tensor:
    """Attention with a learned sink per head (gpt-oss): each query's softmax also spans one
    extra logit, its head's ``sinks[h]``, whose value row is zero, so the weights sum to less
    than one and a head may attend to nothing. Per sequence: softmax over [q.k * scale for
    the visible keys, sink] in fp32, the sink's column dropped, times V. ``sliding_window``
    0: none. The torch form of what the C++ and Triton kernels compute with ``sinks``; one
    opaque op, so a compiled CPU decode step keeps its graph where it runs."""
    out = torch.empty_like(q)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    block_size = k_cache.shape[1]
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    window = sliding_window or None
    sink = sinks.float().view(heads, 1, 1)
    for b, kv_len in enumerate(lens):
        qs, qe = starts[b], starts[b + 1]
        n = qe - qs
        if n == 0:
            continue
        ctx = kv_len - n  # the first query's position
        first = max(0, ctx - sliding_window + 1) // block_size * block_size if window else 0
        blocks = block_tables[b, first // block_size : -(-kv_len // block_size)]
        k = _dequant(_gather_blocks(k_cache, blocks)[: kv_len - first], k_scale, torch.float32).float()
        v = _dequant(_gather_blocks(v_cache, blocks)[: kv_len - first], v_scale, torch.float32).float()
        group = heads // kv_heads
        k = k.transpose(0, 1).repeat_interleave(group, dim=0)  # [H, L, D]
        v = v.transpose(0, 1).repeat_interleave(group, dim=0)
        scores = q[qs:qe].float().transpose(0, 1) @ k.transpose(1, 2) * scale  # [H, n, L]
        visible = _visible(ctx + torch.arange(n, device=q.device), first, kv_len, window)
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(torch.cat((scores, sink.expand(heads, n, 1)), dim=-1), dim=-1)[..., :-1]
        out[qs:qe] = (probs @ v).transpose(0, 1).to(q.dtype)
    return out


@paged_attention_sinks_ref.register_fake
def _(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, sinks, sliding_window, k_scale, v_scale):  # type: ignore[no-untyped-def]
    return torch.empty_like(q)


# --- Triton ---------------------------------------------------------------------------------------

_LOG2E = 1.4426950408889634


@triton.jit
def _find_seq_idx(qsl_ptr, target, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest b whose first query tile index (qsl[b] - qsl[0]) // BLOCK_Q + b is <= target.

    Giving every sequence one spare tile slot makes tile b's index computable from
    query_start_loc alone, so the grid size needs no device-to-host copy.
    """
    base = tl.load(qsl_ptr)
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = (tl.load(qsl_ptr + mid) - base) // BLOCK_Q + mid
        if first <= target:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    qsl_ptr,
    part_out_ptr,
    part_lse_ptr,
    k_scale_ptr,
    v_scale_ptr,
    sinks_ptr,
    qk_scale,
    num_seqs,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    QPKV: tl.constexpr,
    HEAD_D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    IS_DECODE: tl.constexpr,
    FP8_KV: tl.constexpr,
    DOT_FP32: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    if IS_DECODE:
        seq = pid
        q_block = 0
    else:
        seq = _find_seq_idx(qsl_ptr, pid, num_seqs, BLOCK_Q)
        q_block = pid - ((tl.load(qsl_ptr + seq) - tl.load(qsl_ptr)) // BLOCK_Q + seq)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len

    # Row r of the tile is query token r // QPKV of this q-block, query head r % QPKV of this
    # KV head's group: the group shares every K/V tile load and fills the MMA's M dimension.
    rows = tl.arange(0, BLOCK_M)
    tok = q_block * BLOCK_Q + rows // QPKV
    head = kv_head * QPKV + rows % QPKV
    row_ok = (rows // QPKV < BLOCK_Q) & (tok < q_len)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_D
    q = tl.load(
        q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)
    q_pos = ctx_len + tok

    score_scale = qk_scale
    if FP8_KV:
        # k_scale is folded into the scores and v_scale into the output, so the FP8 tiles are
        # only converted, never multiplied element by element.
        score_scale = qk_scale * tl.load(k_scale_ptr)

    # Causal: the last query of this tile sees keys [0, kv_end); with a window (> 0) the
    # first query sees none before kv_start, so the tiles before it are skipped.
    kv_end = tl.minimum(seq_len, ctx_len + (q_block + 1) * BLOCK_Q)
    num_tiles = tl.cdiv(kv_end, TILE_N)
    first_tile = tl.where(window > 0, tl.maximum(ctx_len + q_block * BLOCK_Q - window + 1, 0) // TILE_N, 0)
    if NUM_SPLITS == 1:
        tile_lo = first_tile
        tile_hi = num_tiles
    else:
        per_split = tl.cdiv(num_tiles - first_tile, NUM_SPLITS)
        tile_lo = first_tile + split * per_split
        tile_hi = tl.minimum(tile_lo + per_split, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    offs_n = tl.arange(0, TILE_N)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for j in range(tile_lo, tile_hi):
        k_pos = j * TILE_N + offs_n
        k_ok = k_pos < kv_end
        phys = tl.load(bt_row + k_pos // KV_BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        slot = k_pos % KV_BLOCK_SIZE
        k = tl.load(
            k_cache_ptr
            + phys[None, :] * stride_kb
            + slot[None, :] * stride_ks
            + kv_head * stride_kh
            + offs_d[:, None],
            mask=k_ok[None, :] & d_ok[:, None],
            other=0.0,
        )
        v = tl.load(
            v_cache_ptr
            + phys[:, None] * stride_vb
            + slot[:, None] * stride_vs
            + kv_head * stride_vh
            + offs_d[None, :],
            mask=k_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        if DOT_FP32:
            s = tl.dot(q, k.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, k.to(q.dtype))
        s = s * score_scale
        visible = row_ok[:, None] & (k_pos[None, :] <= q_pos[:, None])
        visible = visible & ((window <= 0) | (k_pos[None, :] > q_pos[:, None] - window))
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with nothing visible yet keeps m = -inf; subtracting 0 instead avoids NaNs.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_FP32:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    if HAS_SINKS and NUM_SPLITS == 1:
        # the head's sink joins the denominator (in log2 units, as the scores); with splits
        # the reduction adds it once, over the merged sum
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        l_safe = l_i + tl.math.exp2(sink - tl.where(m_i == float("-inf"), sink, m_i))
        l_safe = tl.where(l_safe == 0.0, 1.0, l_safe)
    o = acc / l_safe[:, None]
    if FP8_KV:
        o = o * tl.load(v_scale_ptr)
    out_mask = row_ok[:, None] & d_ok[None, :]
    tok_abs = q_start + tok
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + tok_abs[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        # Partial results: normalised output plus log2-sum-exp per (token, head, split).
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
        part_row = (tok_abs * (QPKV * tl.num_programs(1)) + head) * NUM_SPLITS + split
        tl.store(part_lse_ptr + part_row, lse, mask=row_ok)
        tl.store(part_out_ptr + part_row[:, None] * HEAD_D + offs_d[None, :], o, mask=out_mask)


@triton.jit
def _reduce_splits_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    sinks_ptr,
    stride_ot,
    stride_oh,
    num_heads,
    HEAD_D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    tok = tl.program_id(0)
    head = tl.program_id(1)
    row = tok * num_heads + head
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_D
    lse = tl.load(part_lse_ptr + row * NUM_SPLITS + offs_s)
    m = tl.max(lse, 0)  # split 0 always holds the first visible key, so m is finite
    w = tl.math.exp2(lse - m)
    o = tl.load(
        part_out_ptr + (row * NUM_SPLITS + offs_s)[:, None] * HEAD_D + offs_d[None, :],
        mask=d_ok[None, :],
        other=0.0,
    )
    total = tl.sum(w, 0)
    if HAS_SINKS:  # the sink joins the denominator once, over every split's keys
        total += tl.math.exp2(tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634 - m)
    o = tl.sum(o * w[:, None], 0) / total
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty), mask=d_ok)


def _tile_config(
    q: torch.Tensor, qpkv: int, head_dim: int, decode: bool, fp8: bool
) -> tuple[int, int, int, int]:
    """(BLOCK_M, TILE_N, num_warps, num_stages) for this device.

    Decode is bandwidth-bound: one token's packed heads fill the rows and three stages keep
    the next block-table entries and K/V tile in flight. Prefill is compute-bound: 128 query
    rows x 64 keys with 8 warps (wgmma on sm90). On sm8x the accumulators live in registers;
    bench/aot_check.py showed 64 rows with 4 warps spilling at head dim 128, and an FP8
    cache needing 64 rows to stay spill-free.
    """
    min_rows = max(16, next_power_of_2(qpkv))
    if not gpu_tiles(q):
        # Under the interpreter a bigger tile costs less (numpy ops), but tests pin sizes.
        return (min_rows, 32, 4, 1) if decode else (max(min_rows, 32), 32, 4, 1)
    if decode:
        return min_rows, 64, 4, 3
    if head_dim > 128:
        return max(min_rows, 64), 32, 8, 2
    hopper = capability(q)[0] >= 9
    if fp8 and not hopper:
        return max(min_rows, 64), 64, 8, 2
    return max(min_rows, 128), 64, 8, 2


def _num_splits(q: torch.Tensor, num_decodes: int, num_kv_heads: int, max_seq_len: int | None, tile_n: int) -> int:
    """Split-K factor for the decode launch, chosen without reading seq_lens (no host sync).

    Enough (sequence, KV head) programs already fill the GPU; otherwise split each context so
    that about two programs run per SM. A ``max_seq_len`` hint caps the split so that every
    slice still holds a few tiles.
    """
    programs = num_decodes * num_kv_heads
    target = 2 * num_sms(q)
    if programs >= target:
        return 1
    want = -(-target // programs)
    splits = min(1 << (want.bit_length() - 1), 64)  # round down: slices stay a few tiles long
    if max_seq_len is not None:
        useful = max(1, max_seq_len // (4 * tile_n))
        splits = min(splits, next_power_of_2(useful) if useful > 1 else 1)
    return splits


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    num_decodes: int = 0,
    k_scale: ScaleArg = None,
    v_scale: ScaleArg = None,
    *,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    block_m: int | None = None,
    tile_n: int | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton implementation; same contract as ``paged_attention_ref``; ``sinks`` [H]: one
    logit per query head that joins each softmax's denominator (``paged_attention_sinks_ref``).

    Keyword-only knobs (tests and benchmarks): ``num_splits`` forces the decode split-K factor
    (1 = no split), ``block_m``/``tile_n`` override the tile sizes, ``max_seq_len`` is an
    optional host-side hint for the split heuristic. Nothing here reads device memory on the
    host, so a decode step can be captured in a CUDA graph (pass scales as tensors).
    """
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    num_kv_heads, kv_block_size = k_cache.shape[2], k_cache.shape[1]
    assert num_heads % num_kv_heads == 0
    qpkv = num_heads // num_kv_heads
    fp8 = k_cache.dtype in FP8_DTYPES
    # Without an FP8 cache the scale pointers are never read; any tensor will do.
    k_scale_t = scale_tensor(k_scale, q.device) if fp8 else q
    v_scale_t = scale_tensor(v_scale, q.device) if fp8 else q
    block_d = max(16, next_power_of_2(head_dim))
    fp32 = dot_fp32(q)
    common = dict(
        QPKV=qpkv,
        HEAD_D=head_dim,
        BLOCK_D=block_d,
        KV_BLOCK_SIZE=kv_block_size,
        FP8_KV=fp8,
        DOT_FP32=fp32,
        HAS_SINKS=sinks is not None,
    )
    sinks_t = q if sinks is None else sinks.float().contiguous()  # never read without sinks

    def launch(grid: tuple[int, int, int], seqs: slice, part_out: torch.Tensor, part_lse: torch.Tensor,
               bm: int, bq: int, tn: int, warps: int, stages: int, splits: int, decode: bool) -> None:
        _paged_attention_kernel[grid](
            out, q, k_cache, v_cache,
            block_tables[seqs], seq_lens[seqs], query_start_loc[seqs.start:],
            part_out, part_lse, k_scale_t, v_scale_t, sinks_t,
            scale * _LOG2E, seqs.stop - seqs.start, sliding_window or 0,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            block_tables.stride(0),
            BLOCK_M=bm, BLOCK_Q=bq, TILE_N=tn, NUM_SPLITS=splits, IS_DECODE=decode,
            num_warps=warps, num_stages=stages, **common,
        )  # fmt: skip

    if num_decodes > 0:
        bm, tn, warps, stages = _tile_config(q, qpkv, head_dim, decode=True, fp8=fp8)
        bm = max(bm, block_m or 0, next_power_of_2(qpkv))
        tn = tile_n or tn
        splits = num_splits or _num_splits(q, num_decodes, num_kv_heads, max_seq_len, tn)
        splits = next_power_of_2(splits)
        if splits == 1:
            dummy = out  # never touched when NUM_SPLITS == 1
            launch((num_decodes, num_kv_heads, 1), slice(0, num_decodes), dummy, dummy,
                   bm, 1, tn, warps, stages, 1, True)  # fmt: skip
        else:
            part_out = torch.empty((num_decodes, num_heads, splits, head_dim), dtype=torch.float32, device=q.device)
            part_lse = torch.empty((num_decodes, num_heads, splits), dtype=torch.float32, device=q.device)
            launch((num_decodes, num_kv_heads, splits), slice(0, num_decodes), part_out, part_lse,
                   bm, 1, tn, warps, stages, splits, True)  # fmt: skip
            _reduce_splits_kernel[(num_decodes, num_heads)](
                out, part_out, part_lse, sinks_t, out.stride(0), out.stride(1), num_heads,
                HEAD_D=head_dim, BLOCK_D=block_d, NUM_SPLITS=splits, HAS_SINKS=sinks is not None, num_warps=4,
            )  # fmt: skip

    if num_decodes < num_seqs:
        bm, tn, warps, stages = _tile_config(q, qpkv, head_dim, decode=False, fp8=fp8)
        bm = max(block_m or bm, next_power_of_2(qpkv))
        tn = tile_n or tn
        bq = bm // qpkv
        # Decodes come first, so the prefill tokens are q[num_decodes:]; each prefill sequence
        # gets one spare tile slot (see _find_seq_idx).
        n_prefill_seqs = num_seqs - num_decodes
        grid = ((num_tokens - num_decodes) // bq + n_prefill_seqs, num_kv_heads, 1)
        launch(grid, slice(num_decodes, num_seqs), out, out, bm, bq, tn, warps, stages, 1, False)
    return out


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    num_decodes: int = 0,
    k_scale: ScaleArg = None,
    v_scale: ScaleArg = None,
    batch_invariant: bool = False,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``batch_invariant``: every row's numbers depend on its own sequence only. On CUDA, decode
    rows take one key slice. On the CPU every
    prompt chunk takes the in-place C++ kernel (longer ones otherwise take SDPA, whose rows change
    with the chunk's length) with its keys in one slice (otherwise the slices follow the batch's
    size and longest context). ``sliding_window``: see the module docstring. ``sinks`` [H]:
    gpt-oss's per-head sink logit (``paged_attention_sinks_ref``), which every path takes."""
    if use_triton(q):
        # batch_invariant: one key slice per decode row (the split count follows the batch)
        return paged_attention_triton(
            q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, num_decodes,
            k_scale, v_scale, sliding_window=sliding_window, sinks=sinks, num_splits=1 if batch_invariant else None,
        )  # fmt: skip
    if cpu_ops.usable(q, k_cache):
        splits = 1 if batch_invariant else 0
        window = sliding_window or 0
        decodes = num_decodes == q.shape[0]
        if decodes or sinks is not None:
            # all one-token rows: the C++ kernel alone, no Python around it; with sinks every
            # row, prefills too (SDPA has no sink): max_q is then the whole batch (a constant 1
            # for decodes, so a compiled decode step does not specialise on the batch size)
            return torch.ops.localllm_cpu.paged_attention(
                q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale,
                1 if decodes else q.shape[0], splits, window, sinks,
            )  # fmt: skip
        return paged_attention_cpu(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale,
                                   q.shape[0] if batch_invariant else CPU_INPLACE_MAX_Q, splits, window)
    if sinks is not None:
        return paged_attention_sinks_ref(
            q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, sinks, sliding_window or 0,
            *(None if x is None or k_cache.dtype not in FP8_DTYPES else scale_tensor(x, q.device) for x in (k_scale, v_scale)),
        )  # fmt: skip
    if sliding_window and k_cache.dtype == torch.float32 and q.dtype == torch.float32:
        # no C++ kernels here: one opaque op still, so a compiled decode step keeps its graph
        return paged_attention_windowed_ref(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale,
                                            num_decodes, sliding_window)
    return paged_attention_ref(
        q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, num_decodes,
        k_scale, v_scale, sliding_window,
    )  # fmt: skip

