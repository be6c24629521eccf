"""Rotary embedding of q and k, fused with writing k and v into the paged cache.

The Triton kernel runs one program per token: it reads the token's cos/sin row once, rotates
all query heads and all KV heads, and writes k and v straight to their cache slot, so the
rotated k never makes a round trip through memory. Any rope scaling (llama3, linear, ...) is
already baked into ``cos_sin_cache`` by the model.

``cos_sin_cache`` is [max_pos, rotary_dim]: cos in its first half, sin in its second. A table
narrower than the head (partial rotary: Phi-4-mini rotates 96 of 128 dims) rotates the first
rotary_dim dims of each head, pairing dim i with i + rotary_dim / 2 as transformers does, and
passes the rest through unchanged.
"""

from __future__ import annotations

import torch

from localllm.kernels._triton import (
    FP8_DTYPES,
    INTERPRET,
    ScaleArg,
    next_power_of_2,
    round_to_e4m3_grid,
    scale_tensor,
    tl,
    triton,
    use_triton,
)
from localllm.kernels import cpu_ops


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim] in HF (rotate-half) layout; cos, sin: [T, 1, rotary_dim / 2].
    Computes in fp32 and returns x's dtype; dims past rotary_dim pass through."""
    xf = x.float()
    half = cos.shape[-1]
    x1, x2, rest = xf[..., :half], xf[..., half : 2 * half], xf[..., 2 * half :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1).to(x.dtype)


def rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary half of ``rotary_and_store_kv`` alone, in torch (fp32 math, the inputs'
    dtypes out), for a caller that transforms k between the rotary and the cache write."""
    cos, sin = cos_sin_cache[positions].float().unsqueeze(1).chunk(2, dim=-1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _to_cache(x: torch.Tensor, cache: torch.Tensor, scale: ScaleArg) -> torch.Tensor:
    """Casts to the cache dtype; an FP8 cache stores x / scale, saturated to the format's range
    (a plain cast would turn outliers into NaN)."""
    if cache.dtype not in FP8_DTYPES:
        return x.to(cache.dtype)
    xf = x.float()
    if scale is not None:
        xf = xf / (scale.float() if isinstance(scale, torch.Tensor) else float(scale))
    fmax = torch.finfo(cache.dtype).max
    return xf.clamp(-fmax, fmax).to(cache.dtype)


def rotary_and_store_kv_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: ScaleArg = None,
    v_scale: ScaleArg = None,
) -> torch.Tensor:
    """Rotates q [T, H, D] and k [T, KVH, D], writes k and v to slot ``slot_mapping[t]`` of the
    cache ([num_blocks, block_size, KVH, D]; slot = block * block_size + offset) and returns the
    rotated q. Slots are distinct within a call; a negative slot (padding) writes nothing.
    An FP8 cache receives ``k / k_scale`` and ``v / v_scale``."""
    # cos_sin_cache: [max_pos, head_dim], cos in the first half and sin in the second
    q, k = rotary(q, k, positions, cos_sin_cache)
    num_kv_heads, head_dim = k_cache.shape[-2:]
    if bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        slot_mapping, k, v = slot_mapping[keep], k[keep], v[keep]
    for cache, x, s in ((k_cache, k, k_scale), (v_cache, v, v_scale)):
        x = _to_cache(x, cache, s)
        if cache.dtype in FP8_DTYPES:  # index_copy_ has no fp8 kernels; copy the raw bytes
            cache, x = cache.view(torch.uint8), x.view(torch.uint8)
        cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, x)
    return q


# --- Triton ---------------------------------------------------------------------------------------


@triton.jit
def _rotate_heads(
    src_ptr,
    dst_ptr,
    stride_src_h,
    stride_dst_h,
    cos,
    sin,
    dst_scale,
    NUM_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    TO_FP8: tl.constexpr,
    EXACT_FP8_ROUND: tl.constexpr,
    PASS: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
):
    """Rotate-half RoPE of NUM_HEADS heads of one token, [BLOCK_H, BLOCK_HALF] per half; the
    PASS dims after the rotated 2 * HALF are copied (partial rotary)."""
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_HALF)
    mask = (h[:, None] < NUM_HEADS) & (d[None, :] < HALF)
    src = src_ptr + h[:, None] * stride_src_h + d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    if TO_FP8:
        o1 = tl.clamp(o1 / dst_scale, -448.0, 448.0)
        o2 = tl.clamp(o2 / dst_scale, -448.0, 448.0)
        if EXACT_FP8_ROUND:
            o1 = round_to_e4m3_grid(o1)
            o2 = round_to_e4m3_grid(o2)
    dst = dst_ptr + h[:, None] * stride_dst_h + d[None, :]
    tl.store(dst, o1.to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, o2.to(dst_ptr.dtype.element_ty), mask=mask)
    if PASS > 0:
        p = tl.arange(0, BLOCK_PASS)
        pmask = (h[:, None] < NUM_HEADS) & (p[None, :] < PASS)
        x = tl.load(src_ptr + h[:, None] * stride_src_h + 2 * HALF + p[None, :], mask=pmask, other=0.0)
        x = x.to(tl.float32)
        if TO_FP8:
            x = tl.clamp(x / dst_scale, -448.0, 448.0)
            if EXACT_FP8_ROUND:
                x = round_to_e4m3_grid(x)
        tl.store(dst_ptr + h[:, None] * stride_dst_h + 2 * HALF + p[None, :], x.to(dst_ptr.dtype.element_ty),
                 mask=pmask)


@triton.jit
def _rotary_and_store_kv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    q_out_ptr,
    positions_ptr,
    cos_sin_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_qot,
    stride_qoh,
    stride_cos,
    stride_cb,
    stride_cs,
    stride_ch,
    KV_BLOCK_SIZE: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_KVH: tl.constexpr,
    HEAD_D: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8_KV: tl.constexpr,
    EXACT_FP8_ROUND: tl.constexpr,
    PASS: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    cs_row = cos_sin_ptr + pos * stride_cos
    cos = tl.load(cs_row + d, mask=d < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cs_row + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)

    _rotate_heads(q_ptr + t * stride_qt, q_out_ptr + t * stride_qot, stride_qh, stride_qoh,
                  cos, sin, 1.0, NUM_HEADS, BLOCK_H, HALF, BLOCK_HALF, False, False, PASS, BLOCK_PASS)  # fmt: skip

    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot >= 0:
        blk = slot // KV_BLOCK_SIZE
        off = slot % KV_BLOCK_SIZE
        cache_off = blk * stride_cb + off * stride_cs
        k_scale = 1.0
        v_scale = 1.0
        if FP8_KV:
            k_scale = tl.load(k_scale_ptr)
            v_scale = tl.load(v_scale_ptr)
        _rotate_heads(k_ptr + t * stride_kt, k_cache_ptr + cache_off, stride_kh, stride_ch,
                      cos, sin, k_scale, NUM_KV_HEADS, BLOCK_KVH, HALF, BLOCK_HALF, FP8_KV,
                      EXACT_FP8_ROUND, PASS, BLOCK_PASS)  # fmt: skip
        h = tl.arange(0, BLOCK_KVH)
        dd = tl.arange(0, BLOCK_D)
        mask = (h[:, None] < NUM_KV_HEADS) & (dd[None, :] < HEAD_D)
        v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + dd[None, :], mask=mask, other=0.0)
        if FP8_KV:
            v = tl.clamp(v.to(tl.float32) / v_scale, -448.0, 448.0)
            if EXACT_FP8_ROUND:
                v = round_to_e4m3_grid(v)
        tl.store(v_cache_ptr + cache_off + h[:, None] * stride_ch + dd[None, :],
                 v.to(v_cache_ptr.dtype.element_ty), mask=mask)  # fmt: skip


def rotary_and_store_kv_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: ScaleArg = None,
    v_scale: ScaleArg = None,
) -> torch.Tensor:
    """Triton implementation; same contract as ``rotary_and_store_kv_ref``. q, k and v may be
    strided views of one fused qkv output (only the head dim must be contiguous)."""
    num_tokens, num_heads, head_dim = q.shape
    q_out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    # Caches may be views into a larger KV pool; only the head dim must be contiguous, and k
    # and v must share strides (one set is passed).
    assert k_cache.stride(-1) == 1 and cos_sin_cache.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride()
    num_kv_heads = k.shape[1]
    half = cos_sin_cache.shape[1] // 2  # the rotary dims; partial rotary passes the rest
    assert cos_sin_cache.shape[1] % 2 == 0 and 2 * half <= head_dim
    fp8 = k_cache.dtype in FP8_DTYPES
    fp8 = fp8 and k_cache.dtype == torch.float8_e4m3fn  # the clamp in the kernel is e4m3's range
    assert k_cache.dtype not in FP8_DTYPES or fp8, "FP8 KV cache must be e4m3"
    _rotary_and_store_kv_kernel[(num_tokens,)](
        q, k, v, q_out, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
        scale_tensor(k_scale, q.device) if fp8 else q, scale_tensor(v_scale, q.device) if fp8 else q,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1), cos_sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        KV_BLOCK_SIZE=k_cache.shape[1],
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        BLOCK_H=next_power_of_2(num_heads),
        BLOCK_KVH=next_power_of_2(num_kv_heads),
        HEAD_D=head_dim,
        HALF=half,
        BLOCK_HALF=next_power_of_2(half),
        BLOCK_D=next_power_of_2(head_dim),
        FP8_KV=fp8,
        EXACT_FP8_ROUND=INTERPRET,
        PASS=head_dim - 2 * half,
        BLOCK_PASS=next_power_of_2(max(head_dim - 2 * half, 1)),
        num_warps=4 if num_heads * head_dim <= 4096 else 8,
    )  # fmt: skip
    return q_out


def rotary_and_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: ScaleArg = None,
    v_scale: ScaleArg = None,
) -> torch.Tensor:
    if use_triton(q):
        return rotary_and_store_kv_triton(
            q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale, v_scale
        )
    if cpu_ops.usable(q, k_cache):
        # rotary in torch (torch.compile fuses it with its neighbours), the cache write in C++:
        # it skips padding slots without the host sync the reference's mask needs.
        cos, sin = cos_sin_cache[positions].float().unsqueeze(1).chunk(2, dim=-1)
        k_rot = _rotate(k.float(), cos, sin)
        torch.ops.localllm_cpu.store_kv(k_rot, v.float(), k_cache, v_cache, slot_mapping)
        return _rotate(q, cos, sin)
    return rotary_and_store_kv_ref(
        q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale, v_scale
    )
