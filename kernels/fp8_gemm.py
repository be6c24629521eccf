"""FP8 (e4m3) W8A8 GEMM with per-output-channel weight scales and dynamic per-token
activation scales.

- w: float8_e4m3fn [N, K] (nn.Linear layout), w_scale: fp32 [N].
- Each row (token) of x is scaled by max|row| / 448 and cast to e4m3; the product of the two
  fp8 matrices accumulates in fp32 and both scales are applied in the epilogue.

``_fp8_gemm_kernel`` feeds fp8 tiles straight to ``tl.dot`` (fp8 tensor cores: sm89 Ada and
sm90 Hopper, where it lowers to wgmma); ``_quant_fp8_kernel`` is the per-token quantization
prologue. The dispatcher also times ``torch._scaled_mm`` (cuBLASLt) and keeps whichever is
faster per shape; below sm89 it uses the reference. Small M uses split-K with in-kernel
reduction, as in awq_gemm.
"""

from __future__ import annotations

import torch

from localllm.kernels._triton import (
    INTERPRET,
    Config,
    capability,
    configs_for,
    gemm_backend_choice,
    m_bucket,
    make_autotuner,
    next_power_of_2,
    round_to_e4m3_grid,
    splitk_locks,
    tl,
    triton,
    use_triton,
)

FP8_MAX = 448.0
_EPS = 1e-10


def quantize_per_token_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (xq float8_e4m3fn [M, K], x_scale fp32 [M, 1]) with x ~= xq * x_scale."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=_EPS) / FP8_MAX
    xq = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return xq, scale


def fp8_w8a8_gemm_ref(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """Quantize x per token, dequantize both operands, matmul in fp32, cast to x.dtype.

    On CPU this beats ``torch._scaled_mm`` by far (ENVIRONMENT.md: ~3 ms at any size there).
    """
    shape = x.shape
    k, n = shape[-1], w.shape[0]
    x2 = x.reshape(-1, k)
    xq, x_scale = quantize_per_token_fp8_ref(x2)
    acc = xq.float() @ w.float().t()
    out = acc * x_scale * w_scale.reshape(1, n).float()
    return out.to(x.dtype).view(*shape[:-1], n)


# --- Triton ---------------------------------------------------------------------------------------


@triton.jit
def _quant_fp8_kernel(
    x_ptr, xq_ptr, scale_ptr, K, stride_xm, stride_qm, BLOCK_K: tl.constexpr, EXACT_FP8_ROUND: tl.constexpr
):
    """One row per program: pass 1 finds max|x|, pass 2 scales and casts (re-read from L2)."""
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_xm + offs, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, 0), 1e-10) / 448.0
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_xm + offs, mask=offs < K, other=0.0).to(tl.float32)
        q = tl.clamp(tl.math.div_rn(x, scale), -448.0, 448.0)
        if EXACT_FP8_ROUND:
            q = round_to_e4m3_grid(q)
        tl.store(xq_ptr + row * stride_qm + offs, q.to(xq_ptr.dtype.element_ty), mask=offs < K)


@triton.jit
def _fp8_epilogue(acc, w_scale_ptr, x_scale_ptr, out_ptr, offs_m, offs_n, m_ok, n_ok, offs_out):
    ws = tl.load(w_scale_ptr + offs_n, mask=n_ok, other=0.0)
    xs = tl.load(x_scale_ptr + offs_m, mask=m_ok, other=0.0)
    y = acc * xs[:, None] * ws[None, :]
    tl.store(out_ptr + offs_out, y.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _fp8_gemm_kernel(
    x_ptr,
    w_ptr,
    w_scale_ptr,
    x_scale_ptr,
    out_ptr,
    ws_ptr,
    locks_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    M_BUCKET,  # only an autotune key
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_FP32: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pids_per_group = GROUP_M * num_pid_n
    first_m = (pid // pids_per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % pids_per_group) % group_rows
    pid_n = (pid % pids_per_group) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_tiles = tl.cdiv(K, BLOCK_K)
    tiles_per_split = tl.cdiv(k_tiles, SPLIT_K)
    kt_lo = pid_k * tiles_per_split
    kt_hi = tl.minimum(kt_lo + tiles_per_split, k_tiles)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    offs_k = kt_lo * BLOCK_K + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    # K-contiguous [BLOCK_K, BLOCK_N] tile of the [N, K] weight: the operand layout Hopper's
    # fp8 wgmma requires.
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    for _ in range(kt_lo, kt_hi):
        if EVEN_K:  # the usual case: no per-iteration K masks
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < K
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        offs_k += BLOCK_K
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        if DOT_FP32:
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)

    offs_out = offs_m[:, None] * stride_om + offs_n[None, :]
    if SPLIT_K > 1:
        out_mask = m_ok[:, None] & n_ok[None, :]
        offs_ws = offs_m[:, None] * N + offs_n[None, :]
        tl.store(ws_ptr + pid_k * M * N + offs_ws, acc, mask=out_mask)
        tile = pid_m * num_pid_n + pid_n
        arrived = tl.atomic_add(locks_ptr + tile, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            acc = tl.load(ws_ptr + offs_ws, mask=out_mask, other=0.0, cache_modifier=".cg")
            for s_idx in range(1, SPLIT_K):
                acc += tl.load(ws_ptr + s_idx * M * N + offs_ws, mask=out_mask, other=0.0, cache_modifier=".cg")
            _fp8_epilogue(acc, w_scale_ptr, x_scale_ptr, out_ptr, offs_m, offs_n, m_ok, n_ok, offs_out)
            tl.atomic_xchg(locks_ptr + tile, 0)
    else:
        _fp8_epilogue(acc, w_scale_ptr, x_scale_ptr, out_ptr, offs_m, offs_n, m_ok, n_ok, offs_out)


GEMV_MAX_M = 16
MAX_SPLIT_K = 8

_GEMV_CONFIGS = [
    Config({"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "SPLIT_K": 4, "GROUP_M": 1}, 4, 4),
    Config({"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 4, "GROUP_M": 1}, 4, 4),
    Config({"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 8, "GROUP_M": 1}, 4, 4),
    Config({"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 256, "SPLIT_K": 2, "GROUP_M": 1}, 8, 3),
    Config({"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "SPLIT_K": 1, "GROUP_M": 1}, 4, 4),
]
_GEMM_CONFIGS = [
    Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 1, "GROUP_M": 8}, 4, 4),
    Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 1, "GROUP_M": 8}, 8, 3),
    Config({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 128, "SPLIT_K": 1, "GROUP_M": 8}, 8, 3, hopper_only=True),
    Config({"BLOCK_M": 32, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 1, "GROUP_M": 8}, 4, 4),
    Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 256, "SPLIT_K": 1, "GROUP_M": 8}, 4, 3),
]
_INTERPRET_GEMV = Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 2, "GROUP_M": 1}, 4, 1)
_INTERPRET_GEMM = Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": 1, "GROUP_M": 4}, 4, 1)

_tuned: dict[tuple[bool, bool], object] = {}


def _autotuned(x: torch.Tensor, gemv: bool) -> object:
    key = (gemv, capability(x)[0] >= 9)
    if key not in _tuned:
        configs = configs_for(x, _GEMV_CONFIGS if gemv else _GEMM_CONFIGS)
        _tuned[key] = make_autotuner(_fp8_gemm_kernel, configs, key=["M_BUCKET", "N", "K", "DOT_FP32"])
    return _tuned[key]


def quantize_per_token_fp8_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    xq = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        block_k = min(next_power_of_2(k), 4096)
        _quant_fp8_kernel[(m,)](
            x2, xq, scale, k, x2.stride(0), xq.stride(0), BLOCK_K=block_k, EXACT_FP8_ROUND=INTERPRET, num_warps=4
        )
    return xq, scale


def quantize_per_token_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (xq e4m3 [M, K], x_scale fp32 [M, 1]); see ``quantize_per_token_fp8_ref``."""
    if use_triton(x):
        return quantize_per_token_fp8_triton(x)
    return quantize_per_token_fp8_ref(x.reshape(-1, x.shape[-1]))


def fp8_w8a8_gemm_triton(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, *, config: Config | None = None
) -> torch.Tensor:
    """Triton implementation of ``fp8_w8a8_gemm_ref`` (needs sm89+ on a GPU)."""
    shape = x.shape
    k, n = shape[-1], w.shape[0]
    assert w.shape[1] == k and w.stride(1) == 1 and w.dtype == torch.float8_e4m3fn
    xq, x_scale = quantize_per_token_fp8_triton(x.reshape(-1, k))
    m = xq.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.view(*shape[:-1], n)
    gemv = m <= GEMV_MAX_M
    if config is None and INTERPRET:
        config = _INTERPRET_GEMV if gemv else _INTERPRET_GEMM
    max_split = config.kwargs["SPLIT_K"] if config is not None else (MAX_SPLIT_K if gemv else 1)
    if max_split > 1:
        ws = torch.empty((max_split * m * n,), dtype=torch.float32, device=x.device)
        locks = splitk_locks(x.device, triton.cdiv(m, 16) * triton.cdiv(n, 16))
    else:
        ws = locks = out
    w_scale = w_scale.reshape(n).to(torch.float32)
    args = (xq, w, w_scale, x_scale, out, ws, locks, m, n, k, xq.stride(0), w.stride(0), out.stride(0), m_bucket(m))
    # fp8 tl.dot needs fp8 tensor cores; the interpreter emulates it in fp32.
    consts = dict(DOT_FP32=INTERPRET)

    def grid(meta: dict) -> tuple[int, int]:
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"])

    if config is not None:
        _fp8_gemm_kernel[grid](*args, **consts, **config.kwargs, EVEN_K=k % config.kwargs["BLOCK_K"] == 0,
            num_warps=config.num_warps, num_stages=config.num_stages)
    else:
        _autotuned(x, gemv)[grid](*args, **consts)  # type: ignore[index]
    return out.view(*shape[:-1], n)


def _scaled_mm_path(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """cuBLASLt fp8 GEMM with row-wise scales, after our quantization kernel."""
    shape = x.shape
    xq, x_scale = quantize_per_token_fp8_triton(x.reshape(-1, shape[-1]))
    out = torch._scaled_mm(
        xq, w.t(), scale_a=x_scale, scale_b=w_scale.float().reshape(1, -1), out_dtype=x.dtype
    )
    return out.view(*shape[:-1], w.shape[0])


def fp8_w8a8_gemm(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] with dynamic per-token e4m3 quantization @ (w e4m3 [N, K] * w_scale).T."""
    if use_triton(x) and capability(x) >= (8, 9):
        k, n = x.shape[-1], w.shape[0]
        key = ("fp8_w8a8", m_bucket(x.numel() // max(k, 1)), n, k, x.dtype, x.device.index)
        choice = gemm_backend_choice(
            key,
            {
                "triton": lambda: fp8_w8a8_gemm_triton(x, w, w_scale),
                "scaled_mm": lambda: _scaled_mm_path(x, w, w_scale),
                "torch": lambda: fp8_w8a8_gemm_ref(x, w, w_scale),
            },
        )
        if choice == "triton":
            return fp8_w8a8_gemm_triton(x, w, w_scale)
        if choice == "scaled_mm":
            return _scaled_mm_path(x, w, w_scale)
    return fp8_w8a8_gemm_ref(x, w, w_scale)
