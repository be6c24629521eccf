"""The fused rotary + KV-write kernel against its reference."""

from __future__ import annotations

import pytest
import torch

from localllm.kernels.rotary_kv import (
    rotary_and_store_kv,
    rotary_and_store_kv_ref,
    rotary_and_store_kv_triton,
)


def cos_sin(max_pos: int, head_dim: int, device: str) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    freqs = torch.arange(max_pos, device=device).float()[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def run_both(
    num_tokens: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str,
    cache_dtype: torch.dtype | None = None,
    fused_qkv: bool = False,
    rotary_dim: int | None = None,
) -> None:
    block_size, num_blocks = 4, 8
    if fused_qkv:
        # q, k, v as strided views of one [T, (H + 2 KVH) * D] projection output.
        qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, device=device).to(dtype)
        q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1)
        q = q.view(num_tokens, num_heads, head_dim)
        k = k.view(num_tokens, num_kv_heads, head_dim)
        v = v.view(num_tokens, num_kv_heads, head_dim)
    else:
        q = torch.randn(num_tokens, num_heads, head_dim, device=device).to(dtype)
        k = torch.randn(num_tokens, num_kv_heads, head_dim, device=device).to(dtype)
        v = torch.randn(num_tokens, num_kv_heads, head_dim, device=device).to(dtype)
    positions = torch.randint(0, 64, (num_tokens,), device=device)
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
    if num_tokens > 2:
        slots[1] = -1  # padding token: rotated q, no cache write
    cache = cos_sin(64, rotary_dim or head_dim, device)
    cdt = cache_dtype or dtype
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    kc_ref = torch.zeros(shape, device=device).to(cdt)
    vc_ref = torch.zeros(shape, device=device).to(cdt)
    kc, vc = kc_ref.clone(), vc_ref.clone()
    scales = (0.02, 0.03) if cache_dtype is not None else (None, None)
    q_ref = rotary_and_store_kv_ref(q, k, v, positions, cache, kc_ref, vc_ref, slots, *scales)
    q_out = rotary_and_store_kv_triton(q, k, v, positions, cache, kc, vc, slots, *scales)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(q_out.float(), q_ref.float(), atol=tol, rtol=tol)
    if cache_dtype is None:
        torch.testing.assert_close(kc.float(), kc_ref.float(), atol=tol, rtol=tol)
        torch.testing.assert_close(vc.float(), vc_ref.float(), atol=tol, rtol=tol)
    else:
        # One fp8 rounding step may differ at a tie; compare in dequantized units.
        torch.testing.assert_close(kc.float() * 0.02, kc_ref.float() * 0.02, atol=0.02 * 32, rtol=0.07)
        torch.testing.assert_close(vc.float() * 0.03, vc_ref.float() * 0.03, atol=0.03 * 32, rtol=0.07)
        assert (kc.float() == kc_ref.float()).float().mean() > 0.98


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 2, 64), (6, 2, 80), (8, 1, 128)])
def test_rotary_store_fp32(device: str, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    run_both(5, num_heads, num_kv_heads, head_dim, torch.float32, device)


def test_rotary_store_fp16_fused_qkv(device: str) -> None:
    run_both(6, 3, 1, 96, torch.float16, device, fused_qkv=True)


def test_rotary_store_fp8_cache(device: str) -> None:
    run_both(7, 4, 2, 64, torch.float16, device, cache_dtype=torch.float8_e4m3fn)


def test_rotary_empty(device: str) -> None:
    run_both(0, 4, 2, 64, torch.float32, device)


def test_dispatcher_cpu_runs_reference() -> None:
    q, k, v = torch.randn(3, 2, 8), torch.randn(3, 1, 8), torch.randn(3, 1, 8)
    kc, vc = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    out = rotary_and_store_kv(q, k, v, torch.arange(3), cos_sin(8, 8, "cpu"), kc, vc, torch.tensor([0, 5, 2]))
    assert out.shape == q.shape and kc.view(-1, 1, 8)[5].abs().sum() > 0


# ---- partial rotary (Phi-4-mini: RoPE on the first 96 of 128 dims, the rest passed) ----


def test_partial_rotary_reference_is_transformers_phi3() -> None:
    """A table narrower than the head rotates its first rotary_dim dims as transformers' Phi-3
    attention does (pairs i, i + rotary_dim / 2) and leaves the rest as they were."""
    phi3 = pytest.importorskip("transformers.models.phi3.modeling_phi3")
    q, k, v = torch.randn(5, 4, 32), torch.randn(5, 2, 32), torch.randn(5, 2, 32)
    positions = torch.tensor([0, 3, 9, 17, 40])
    table = cos_sin(64, 24, "cpu")
    kc, vc = torch.zeros(4, 4, 2, 32), torch.zeros(4, 4, 2, 32)
    slots = torch.tensor([0, 5, 2, 9, 14])
    q_out = rotary_and_store_kv_ref(q, k, v, positions, table, kc, vc, slots)
    cos, sin = table[positions].chunk(2, dim=-1)
    cos, sin = torch.cat((cos, cos), -1)[None], torch.cat((sin, sin), -1)[None]  # HF's [1, T, rotary_dim]
    want_q, want_k = phi3.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(q_out, want_q[0].transpose(0, 1))
    torch.testing.assert_close(kc.view(-1, 2, 32)[slots], want_k[0].transpose(0, 1))
    assert torch.equal(q_out[..., 24:], q[..., 24:])


@pytest.mark.parametrize(("dtype", "cache_dtype"), [(torch.float32, None), (torch.float16, torch.float8_e4m3fn)])
def test_rotary_store_partial(device: str, dtype: torch.dtype, cache_dtype: torch.dtype | None) -> None:
    run_both(5, 4, 2, 128, dtype, device, cache_dtype=cache_dtype, rotary_dim=96)


def test_dispatcher_cpu_partial_rotary() -> None:
    """The CPU path (torch rotary, the C++ cache write where built) with a partial table."""
    q, k, v = torch.randn(3, 4, 32), torch.randn(3, 2, 32), torch.randn(3, 2, 32)
    kc, vc = torch.zeros(2, 4, 2, 32), torch.zeros(2, 4, 2, 32)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    args = (torch.tensor([1, 4, 7]), cos_sin(8, 24, "cpu"))
    slots = torch.tensor([0, 5, 2])
    out = rotary_and_store_kv(q, k, v, *args, kc, vc, slots)
    want = rotary_and_store_kv_ref(q, k, v, *args, kc_ref, vc_ref, slots)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(kc, kc_ref)
    assert torch.equal(vc, vc_ref)
