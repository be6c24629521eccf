"""Paged attention with a learned sink per head (gpt-oss): each query's softmax also spans
one extra logit, the head's ``sink``, whose value row is zero. Its weights then sum to less
than one, so a head may attend to nothing.

Neither the C++ CPU kernel nor the Triton one takes sinks, so a layer with sinks runs this
torch form on every device; as one custom op, the compiled CPU decode step keeps its graph.
It reads the paged cache as the other paths do (see kernels/paged_attention.py's layout), a
window included, and a FP8 cache through its scales.
"""

from __future__ import annotations

import torch

from localllm.kernels.paged_attention import _dequant, _gather_blocks, _visible


@torch.library.custom_op("localllm::paged_attention_sinks", mutates_args=())
def paged_attention_sinks(
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
    """[T, H, D] like q: per sequence, softmax over [q.k * scale for the visible keys, sink]
    (in fp32), the sink's column dropped, times V. ``sliding_window`` 0: no window. Under a
    CUDA graph capture (every row a decode) it takes ``decode_with_sinks``, which reads no
    length on the host."""
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        return decode_with_sinks(q, k_cache, v_cache, seq_lens, block_tables, scale, sinks, sliding_window,
                                 k_scale, v_scale)
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
        blocks = block_tables[b, first // block_size: -(-kv_len // block_size)]
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


@paged_attention_sinks.register_fake
def _(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, sinks, sliding_window, k_scale, v_scale):  # type: ignore[no-untyped-def]
    return torch.empty_like(q)


def decode_with_sinks(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sinks: torch.Tensor,
    sliding_window: int,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> torch.Tensor:
    """``paged_attention_sinks`` of a batch of one-token sequences (row b is sequence b) with
    no host-side length: every block of the tables' width is gathered and the keys past each
    sequence's length (or before its window) are masked, so a CUDA graph can hold it."""
    B, heads, _ = q.shape
    kv_heads = k_cache.shape[2]
    k = _dequant(_gather_blocks(k_cache, block_tables), k_scale, torch.float32).float()  # [B, L, KVH, D]
    v = _dequant(_gather_blocks(v_cache, block_tables), v_scale, torch.float32).float()
    group = heads // kv_heads
    k = k.permute(0, 2, 1, 3).repeat_interleave(group, dim=1)  # [B, H, L, D]
    v = v.permute(0, 2, 1, 3).repeat_interleave(group, dim=1)
    scores = (q.float().unsqueeze(2) @ k.transpose(2, 3)).squeeze(2) * scale  # [B, H, L]
    pos = torch.arange(k.shape[2], device=q.device)[None, :]
    lens = seq_lens.to(torch.int64)[:, None]
    visible = pos < lens
    if sliding_window:
        visible &= pos >= lens - sliding_window
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    sink = sinks.float().view(1, heads, 1).expand(B, heads, 1)
    probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    return (probs.unsqueeze(2) @ v).squeeze(2).to(q.dtype)
