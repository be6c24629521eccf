"""GEMMs over 8-bit weights with per-output-channel weight scales: INT8 W8A16 and W8A8 here,
and FP8 W8A8 (``fp8_gemm``), which calls the same kernel with e4m3 operands.

- w: int8 [N, K] (nn.Linear layout), w_scale: fp32 [N]; y = x @ (w * w_scale[:, None]).T.
- W8A16 multiplies the activations as they are. W8A8 first quantizes each row (token) of x
  symmetrically to 8 bits with its own scale (``quantize_per_token_int8``), multiplies the two
  8-bit matrices (int8 into int32, e4m3 into fp32), and applies both scales in the epilogue.

``_w8_gemm_kernel`` serves all three; ``_quant_per_token_kernel`` is W8A8's per-token
quantization prologue, for int8 and e4m3 alike. Small M (decode) uses split-K with in-kernel
reduction by the last-arriving program, as in awq_gemm.
"""

from __future__ import annotations

import torch

from localllm.kernels._triton import (
    INTERPRET,
    Config,
    capability,
    configs_for,
    dot_fp32,
    gemm_backend_choice,
    gpu_tiles,
    grouped_tile,
    m_bucket,
    make_autotuner,
    next_power_of_2,
    round_half_even,
    round_to_e4m3_grid,
    split_k_range,
    split_k_sum,
    splitk_locks,
    tl,
    triton,
    use_triton,
)

_EPS = 1e-10


def quantize_per_token_ref(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (xq [M, K] in ``dtype``, int8 or e4m3, x_scale fp32 [M, 1]) with
    x ~= xq * x_scale.

    Symmetric, scale = max|row| / the type's largest value (127 or 448); int8 rounds half to
    even, the e4m3 cast rounds to nearest. An all-zero row gets a tiny scale and zeros. The
    [M, 1] scale shape is vLLM's (``scaled_int8_quant``, ``scaled_fp8_quant``)."""
    is_int = dtype == torch.int8
    qmax = 127.0 if is_int else torch.finfo(dtype).max
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=_EPS) / qmax
    q = xf / scale
    if is_int:
        q = torch.round(q)
    return q.clamp(-qmax, qmax).to(dtype), scale


def quantize_per_token_int8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_per_token_ref(x, torch.int8)


def int8_w8a16_gemm_ref(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] (fp16/bf16/fp32) @ dequant(w).T -> [..., N] in x.dtype.

    CPU bf16 uses ``_weight_int8pack_mm`` (the fast CPU int8 path); fp32 scales after the
    matmul (no [N, K] scaled copy, and fp32 cannot overflow); fp16/bf16 on GPU dequantize
    first, since unscaled int8 sums could overflow fp16.
    """
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    w_scale = w_scale.reshape(-1)
    if x.dtype == torch.bfloat16 and not x.is_cuda and x2.shape[0] > 0:
        out = torch._weight_int8pack_mm(x2.contiguous(), w, w_scale.to(torch.bfloat16))
    elif x.dtype == torch.float32:
        out = (x2 @ w.t().to(torch.float32)) * w_scale
    else:
        out = x2 @ (w.to(torch.float32) * w_scale[:, None]).to(x.dtype).t()
    return out.view(*shape[:-1], w.shape[0])


def _int_mm_ok(x: torch.Tensor, m: int, k: int, n: int) -> bool:
    # cuBLAS int8 GEMM needs M > 16 and K, N multiples of 8; the CPU kernel takes any shape.
    return not x.is_cuda or (m > 16 and k % 8 == 0 and n % 8 == 0)


def int8_w8a8_gemm_ref(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """Per-token int8 quantization of x, int8 x int8 -> int32 matmul, both scales applied.

    ``torch._int_mm`` where the shape allows (on CPU it is the fastest int8 matmul there is),
    else an fp32 emulation of the integer product.
    """
    shape = x.shape
    k, n = shape[-1], w.shape[0]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    xq, x_scale = quantize_per_token_int8_ref(x2)
    if m == 0:
        acc = torch.zeros((0, n), dtype=torch.float32, device=x.device)
    elif _int_mm_ok(x, m, k, n):
        acc = torch._int_mm(xq, w.t()).float()
    else:
        acc = xq.float() @ w.float().t()
    out = acc * x_scale * w_scale.reshape(1, n).float()
    return out.to(x.dtype).view(*shape[:-1], n)


# --- Triton ---------------------------------------------------------------------------------------


@triton.jit
def _quant_per_token_kernel(
    x_ptr, xq_ptr, scale_ptr, K, stride_xm, stride_qm, BLOCK_K: tl.constexpr, QMAX: tl.constexpr,
    ROUND_INT: tl.constexpr, EXACT_FP8_ROUND: tl.constexpr,
):
    """One row per program: pass 1 finds max|x|, pass 2 quantizes (the row is re-read from L2)."""
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_xm + offs, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, 0), 1e-10) / QMAX
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_xm + offs, mask=offs < K, other=0.0).to(tl.float32)
        q = tl.math.div_rn(x, scale)
        if ROUND_INT:
            q = round_half_even(q)
        q = tl.clamp(q, -QMAX, QMAX)
        if EXACT_FP8_ROUND:  # the interpreter's fp8 cast mis-rounds across powers of two
            q = round_to_e4m3_grid(q)
        tl.store(xq_ptr + row * stride_qm + offs, q.to(xq_ptr.dtype.element_ty), mask=offs < K)


@triton.jit
def _int8_to_fp16_magic(w, USE_ASM: tl.constexpr):
    """int8 -> fp16 holding 1152 + w. On the GPU one xor and two byte permutes turn four
    weights into two fp16 pairs ((w + 128) as the low byte under an 0x64 high byte); the
    interpreter cannot run PTX and takes the integer add."""
    if USE_ASM:
        return tl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 u;
            xor.b32 u, $2, 0x80808080;
            prmt.b32 $0, u, 0x64646464, 0x4140;
            prmt.b32 $1, u, 0x64646464, 0x4342;
            }
            """,
            constraints="=r,=r,r",
            args=[w],
            dtype=tl.float16,
            is_pure=True,
            pack=4,
        )
    else:
        return (w.to(tl.int16) + 0x6480).to(tl.float16, bitcast=True)


@triton.jit
def _w8_epilogue(acc, w_scale_ptr, x_scale_ptr, out_ptr, offs_m, offs_n, m_ok, n_ok, offs_out, A8: tl.constexpr):
    y = acc.to(tl.float32) * tl.load(w_scale_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
    if A8:
        y = y * tl.load(x_scale_ptr + offs_m, mask=m_ok, other=0.0)[:, None]
    tl.store(out_ptr + offs_out, y.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _w8_gemm_kernel(
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
    A8: tl.constexpr,
    INT8_DOT: tl.constexpr,
    FP16_MAGIC: tl.constexpr,
    USE_ASM: tl.constexpr,
    DOT_FP32: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    pid_k = tl.program_id(1)
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    kt_lo, kt_hi = split_k_range(K, pid_k, BLOCK_K, SPLIT_K)

    if INT8_DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    offs_k = kt_lo * BLOCK_K + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    # [BLOCK_K, BLOCK_N] view of the [N, K] weight: each column is a contiguous K run.
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
        if INT8_DOT:
            acc = tl.dot(x, w, acc, out_dtype=tl.int32)
        elif FP16_MAGIC:
            # 0x6480 + w is the fp16 bit pattern of 1152 + w for w in [-128, 127]: exact, and
            # no int-to-float conversions (I2F issues at a quarter of the ALU rate).
            wf = _int8_to_fp16_magic(w, USE_ASM) - 1152.0
            if DOT_FP32:
                acc = tl.dot(x.to(tl.float32), wf.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, wf, acc)
        elif DOT_FP32:
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:  # 16-bit activations, or e4m3 x e4m3 on fp8 tensor cores (sm89+, wgmma on sm90)
            acc = tl.dot(x, w.to(x.dtype), acc)

    offs_out = offs_m[:, None] * stride_om + offs_n[None, :]
    if SPLIT_K > 1:
        acc, last = split_k_sum(acc, ws_ptr, locks_ptr, pid_k, pid_m, pid_n, offs_m, offs_n, M, N,
                                m_ok[:, None] & n_ok[None, :], BLOCK_N, SPLIT_K)
        if last:
            _w8_epilogue(acc, w_scale_ptr, x_scale_ptr, out_ptr, offs_m, offs_n, m_ok, n_ok, offs_out, A8)
    else:
        _w8_epilogue(acc, w_scale_ptr, x_scale_ptr, out_ptr, offs_m, offs_n, m_ok, n_ok, offs_out, A8)


GEMV_MAX_M = 16
MAX_SPLIT_K = 8

_GEMV_CONFIGS = [
    Config({"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "SPLIT_K": 4, "GROUP_M": 1}, 8, 4),
    Config({"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 4, "GROUP_M": 1}, 4, 4),
    Config({"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 8, "GROUP_M": 1}, 4, 4),
    Config({"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 256, "SPLIT_K": 2, "GROUP_M": 1}, 8, 3),
    Config({"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "SPLIT_K": 1, "GROUP_M": 1}, 4, 4),
]
_GEMM_CONFIGS = [
    Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 1, "GROUP_M": 8}, 8, 4),
    Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 1, "GROUP_M": 8}, 8, 3),
    Config({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "SPLIT_K": 1, "GROUP_M": 8}, 8, 3, hopper_only=True),
    Config({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 128, "SPLIT_K": 1, "GROUP_M": 8}, 8, 3, hopper_only=True),
    Config({"BLOCK_M": 32, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 1, "GROUP_M": 8}, 4, 4),
    Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 1, "GROUP_M": 8}, 4, 4),
]
_INTERPRET_GEMV = Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 2, "GROUP_M": 1}, 4, 1)
_INTERPRET_GEMM = Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": 1, "GROUP_M": 4}, 4, 1)

_tuned: dict[tuple[bool, bool], object] = {}


def _autotuned(x: torch.Tensor, gemv: bool) -> object:
    key = (gemv, capability(x)[0] >= 9)
    if key not in _tuned:
        _tuned[key] = make_autotuner(
            _w8_gemm_kernel,
            configs_for(x, _GEMV_CONFIGS if gemv else _GEMM_CONFIGS),
            key=["M_BUCKET", "N", "K", "A8", "INT8_DOT", "FP16_MAGIC", "USE_ASM", "DOT_FP32"],
        )
    return _tuned[key]


def quantize_per_token_triton(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (xq [M, K] in ``dtype``, int8 or e4m3, x_scale fp32 [M, 1])."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    xq = torch.empty((m, k), dtype=dtype, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        is_int = dtype == torch.int8
        block_k = min(next_power_of_2(k), 4096)
        _quant_per_token_kernel[(m,)](
            x2, xq, scale, k, x2.stride(0), xq.stride(0), BLOCK_K=block_k,
            QMAX=127.0 if is_int else float(torch.finfo(dtype).max), ROUND_INT=is_int,
            EXACT_FP8_ROUND=INTERPRET and not is_int, num_warps=4,
        )
    return xq, scale


def quantize_per_token_int8_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_per_token_triton(x, torch.int8)


def quantize_per_token_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (xq int8 [M, K], x_scale fp32 [M, 1]); see ``quantize_per_token_int8_ref``."""
    if use_triton(x):
        return quantize_per_token_int8_triton(x)
    return quantize_per_token_int8_ref(x.reshape(-1, x.shape[-1]))


def launch_w8_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    a_scale: torch.Tensor | None,
    out_dtype: torch.dtype,
    config: Config | None,
) -> torch.Tensor:
    """a [M, K] (16/32-bit activations, or per-token quantized ones with ``a_scale`` [M, 1])
    @ (w [N, K] int8 or e4m3 * w_scale[:, None]).T -> [M, N] in ``out_dtype``."""
    m, k = a.shape
    n = w.shape[0]
    assert w.shape[1] == k and w.stride(1) == 1 and w_scale.numel() == n
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    a8 = a_scale is not None
    int8_dot = a.dtype == torch.int8
    gemv = m <= GEMV_MAX_M
    if config is None and not gpu_tiles(a):
        config = _INTERPRET_GEMV if gemv else _INTERPRET_GEMM
    max_split = config.kwargs["SPLIT_K"] if config is not None else (MAX_SPLIT_K if gemv else 1)
    if max_split > 1:
        ws = torch.empty((max_split * m * n,), dtype=torch.int32 if int8_dot else torch.float32, device=a.device)
        locks = splitk_locks(a.device, triton.cdiv(m, 16) * triton.cdiv(n, 16))
    else:
        ws = locks = out
    w_scale = w_scale.reshape(n).to(torch.float32)
    args = (a, w, w_scale, a_scale if a8 else w_scale, out, ws, locks, m, n, k,
            a.stride(0), w.stride(0), out.stride(0), m_bucket(m))  # fmt: skip
    consts = dict(
        A8=a8,
        INT8_DOT=int8_dot,
        FP16_MAGIC=w.dtype == torch.int8 and a.dtype == torch.float16,
        USE_ASM=a.is_cuda and not INTERPRET,
        DOT_FP32=not int8_dot and dot_fp32(a),  # e4m3 dots run in fp32 only in the interpreter
    )

    def grid(meta: dict) -> tuple[int, int]:
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"])

    if config is not None:
        _w8_gemm_kernel[grid](*args, **consts, **config.kwargs, EVEN_K=k % config.kwargs["BLOCK_K"] == 0,
            num_warps=config.num_warps, num_stages=config.num_stages)
    else:
        _autotuned(a, gemv)[grid](*args, **consts)  # type: ignore[index]
    return out


def int8_w8a16_gemm_triton(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, *, config: Config | None = None
) -> torch.Tensor:
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return launch_w8_gemm(x2, w, w_scale, None, x.dtype, config).view(*shape[:-1], w.shape[0])


def int8_w8a8_gemm_triton(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, *, config: Config | None = None
) -> torch.Tensor:
    shape = x.shape
    xq, x_scale = quantize_per_token_int8_triton(x.reshape(-1, shape[-1]))
    return launch_w8_gemm(xq, w, w_scale, x_scale, x.dtype, config).view(*shape[:-1], w.shape[0])


def _int_mm_path(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """The best torch route on CUDA: our quantization kernel, then cuBLAS int8."""
    shape = x.shape
    xq, x_scale = quantize_per_token_int8_triton(x.reshape(-1, shape[-1]))
    acc = torch._int_mm(xq, w.t())
    out = (acc.float() * x_scale * w_scale.reshape(1, -1).float()).to(x.dtype)
    return out.view(*shape[:-1], w.shape[0])


def int8_w8a16_gemm(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ (w int8 [N, K] * w_scale[:, None]).T -> [..., N] in x.dtype."""
    if use_triton(x):
        k, n = x.shape[-1], w.shape[0]
        key = ("int8_w8a16", m_bucket(x.numel() // max(k, 1)), n, k, x.dtype, x.device.index)
        choice = gemm_backend_choice(
            key,
            {
                "triton": lambda: int8_w8a16_gemm_triton(x, w, w_scale),
                "torch": lambda: int8_w8a16_gemm_ref(x, w, w_scale),
            },
        )
        if choice == "triton":
            return int8_w8a16_gemm_triton(x, w, w_scale)
    return int8_w8a16_gemm_ref(x, w, w_scale)


def int8_w8a8_gemm(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """Dynamic per-token int8 activations times int8 [N, K] weights -> [..., N] in x.dtype."""
    if use_triton(x):
        k, n = x.shape[-1], w.shape[0]
        m = x.numel() // max(k, 1)
        key = ("int8_w8a8", m_bucket(m), n, k, x.dtype, x.device.index)
        candidates = {"triton": lambda: int8_w8a8_gemm_triton(x, w, w_scale)}
        if _int_mm_ok(x, m, k, n):
            candidates["int_mm"] = lambda: _int_mm_path(x, w, w_scale)
        candidates["torch"] = lambda: int8_w8a8_gemm_ref(x, w, w_scale)
        choice = gemm_backend_choice(key, candidates)
        if choice == "triton":
            return int8_w8a8_gemm_triton(x, w, w_scale)
        if choice == "int_mm":
            return _int_mm_path(x, w, w_scale)
    return int8_w8a8_gemm_ref(x, w, w_scale)
