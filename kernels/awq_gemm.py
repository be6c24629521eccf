"""AWQ int4 GEMM/GEMV with the dequantization inside the kernel.

Format (AutoAWQ ``WQLinear_GEMM``, also what vLLM and HF load):
- qweight: int32 [K, N // 8]; nibble i (bits 4i..4i+3) of word j in a row holds column
  ``8 * j + AWQ_ORDER[i]``, AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]; so column 8j + c sits in
  nibble AWQ_REVERSE_ORDER[c] = [0, 4, 1, 5, 2, 6, 3, 7][c].
- qzeros: int32 [K // G, N // 8], packed the same way; zeros are stored as is (no +1 offset).
- scales: fp16 [K // G, N].
- w[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n]; y = x @ w.

The kernel, ``_awq_gemm_kernel``, reads the packed words once per tile and unpacks all eight
nibbles in registers. For fp16 activations it builds the fp16 value with the magic-number trick
(``0x6400 | q`` is 1024 + q), avoiding int-to-float conversions, which run at a fraction of
the FMA rate and would bound a batch-1 GEMV below the memory roofline. Small M (decode) uses
split-K so that a 4096-wide layer still spreads over every SM; the program that finishes a
tile last sums the slices (no extra launch, no memset).
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
    split_k_range,
    split_k_sum,
    splitk_locks,
    tl,
    triton,
    use_triton,
)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


def awq_pack(intweight: torch.Tensor) -> torch.Tensor:
    """[R, N] integers in 0..15 (K rows of weights, or K // G rows of zeros) -> int32 [R, N // 8]."""
    rows, n = intweight.shape
    assert n % 8 == 0, "AWQ packs 8 columns per int32"
    w = intweight.to(torch.int32).reshape(rows, n // 8, 8) & 0xF
    packed = torch.zeros((rows, n // 8), dtype=torch.int32, device=intweight.device)
    for i, col in enumerate(AWQ_ORDER):
        packed |= w[:, :, col] << (4 * i)  # bit 31 may be set: int32 wraps, as in AutoAWQ
    return packed


def awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, N // 8] -> int32 [R, N] in logical column order (values 0..15)."""
    rows, words = packed.shape
    # arange rather than a tensor from a list: no host-to-device copy, so a CUDA graph can
    # capture the reference too.
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed[:, :, None] >> shifts) & 0xF  # [R, N/8, 8], nibble i
    # Column c = 2a + b sits in nibble 4b + a (AWQ_REVERSE_ORDER): a [2, 4] -> [4, 2] transpose.
    return nibbles.view(rows, words, 2, 4).transpose(-1, -2).reshape(rows, words * 8)


def awq_dequantize(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """[K, N] dense weights (the ``w`` of ``y = x @ w``) in ``dtype`` (default: scales')."""
    k = qweight.shape[0]
    n = scales.shape[1]
    q = awq_unpack(qweight).view(k // group_size, group_size, n)
    z = awq_unpack(qzeros)[:, None, :]
    s = scales.float()[:, None, :]
    # (q - z) is a small exact integer and s has 11 significant bits, so fp32 holds the product
    # exactly: one rounding, to the target dtype, as in the kernel.
    return ((q - z).float() * s).view(k, n).to(dtype or scales.dtype)


def awq_gemm_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
) -> torch.Tensor:
    """Dequantize, then matmul in x's dtype. x: [..., K] -> [..., N]."""
    w = awq_dequantize(qweight, qzeros, scales, group_size, x.dtype)
    return x @ w


# --- Triton ---------------------------------------------------------------------------------------


@triton.jit
def _interleave8(c0, c1, c2, c3, c4, c5, c6, c7, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Eight [ROWS, BLOCK_N // 8] tensors, column offsets 0..7 of each packed word, ->
    [ROWS, BLOCK_N] in column order. Joins add a minor axis held in one thread's registers, so
    unlike a broadcast-and-shift unpack this needs no shared-memory layout conversion."""
    t0 = tl.join(c0, c4)  # [.., b] = c_{0 + 4b}
    t1 = tl.join(c1, c5)
    t2 = tl.join(c2, c6)
    t3 = tl.join(c3, c7)
    u0 = tl.join(t0, t2)  # [.., b, a] = c_{0 + 2a + 4b}
    u1 = tl.join(t1, t3)
    v = tl.join(u0, u1)  # [.., b, a, e] = c_{e + 2a + 4b}
    return tl.reshape(v, (ROWS, BLOCK_N))


@triton.jit
def _unpack_fp16_magic(packed, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, USE_ASM: tl.constexpr):
    """int32 [ROWS, BLOCK_N // 8] -> fp16 [ROWS, BLOCK_N] holding 1024 + q, exactly.

    AWQ's order puts columns 2i and 2i + 1 in nibbles i and i + 4, 16 bits apart, so one
    lop3 ((w >> 4i) & 0x000F000F) | 0x64006400 yields both as an fp16 pair: 7 instructions per
    8 weights on the GPU. The interpreter cannot run PTX and takes the per-column shifts.
    """
    if USE_ASM:
        c0, c1, c2, c3, c4, c5, c6, c7 = tl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 r0, r1, r2, r3, s;
            lop3.b32 r0, $8, 0x000f000f, 0x64006400, 0xea;
            shr.u32 s, $8, 4;
            lop3.b32 r1, s, 0x000f000f, 0x64006400, 0xea;
            shr.u32 s, $8, 8;
            lop3.b32 r2, s, 0x000f000f, 0x64006400, 0xea;
            shr.u32 s, $8, 12;
            lop3.b32 r3, s, 0x000f000f, 0x64006400, 0xea;
            mov.b32 {$0, $1}, r0;
            mov.b32 {$2, $3}, r1;
            mov.b32 {$4, $5}, r2;
            mov.b32 {$6, $7}, r3;
            }
            """,
            constraints="=h,=h,=h,=h,=h,=h,=h,=h,r",
            args=[packed],
            dtype=(tl.float16,) * 8,
            is_pure=True,
            pack=1,
        )
    else:
        # Column offset c sits in nibble AWQ_REVERSE_ORDER[c] = [0, 4, 1, 5, 2, 6, 3, 7][c].
        c0 = ((packed & 0xF) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
        c1 = (((packed >> 16) & 0xF) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
        c2 = (((packed >> 4) & 0xF) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
        c3 = (((packed >> 20) & 0xF) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
        c4 = (((packed >> 8) & 0xF) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
        c5 = (((packed >> 24) & 0xF) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
        c6 = (((packed >> 12) & 0xF) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
        c7 = (((packed >> 28) & 0xF) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
    return _interleave8(c0, c1, c2, c3, c4, c5, c6, c7, ROWS, BLOCK_N)


@triton.jit
def _unpack_fp32_magic(packed, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """int32 [ROWS, BLOCK_N // 8] -> fp32 [ROWS, BLOCK_N] holding 2**23 + q, exactly (the fp32
    activation path, where fp16 rounding of the weights would show)."""
    c0 = ((packed & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
    c1 = (((packed >> 16) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
    c2 = (((packed >> 4) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
    c3 = (((packed >> 20) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
    c4 = (((packed >> 8) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
    c5 = (((packed >> 24) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
    c6 = (((packed >> 12) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
    c7 = (((packed >> 28) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
    return _interleave8(c0, c1, c2, c3, c4, c5, c6, c7, ROWS, BLOCK_N)


@triton.jit
def _awq_gemm_kernel(
    x_ptr,
    qweight_ptr,
    qzeros_ptr,
    scales_ptr,
    out_ptr,
    ws_ptr,
    locks_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    M_BUCKET,  # only an autotune key
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    FP16_MAGIC: tl.constexpr,
    USE_ASM: tl.constexpr,
    DOT_FP32: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    pid_k = tl.program_id(1)
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_pn = pid_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
    m_ok = offs_m < M
    n_ok = offs_n < N
    pn_ok = offs_pn < N // 8

    # A K tile holds GROUPS_PER_TILE whole groups, or lies inside one group.
    GROUPS_PER_TILE: tl.constexpr = (BLOCK_K + GROUP_SIZE - 1) // GROUP_SIZE
    ROWS_PER_GROUP: tl.constexpr = BLOCK_K // GROUPS_PER_TILE
    num_groups = K // GROUP_SIZE

    kt_lo, kt_hi = split_k_range(K, pid_k, BLOCK_K, SPLIT_K)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Pointers advance by one K tile per iteration instead of being rebuilt from indices:
    # per-element address multiplies were the largest instruction class in the loop.
    offs_k = kt_lo * BLOCK_K + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = qweight_ptr + offs_k[:, None].to(tl.int64) * (N // 8) + offs_pn[None, :]
    for kt in range(kt_lo, kt_hi):
        if EVEN_K:  # the usual case: no per-iteration K masks
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            packed = tl.load(w_ptrs, mask=pn_ok[None, :], other=0)
        else:
            k_ok = offs_k < K
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            packed = tl.load(w_ptrs, mask=k_ok[:, None] & pn_ok[None, :], other=0)
        offs_k += BLOCK_K
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * (N // 8)
        offs_g = (kt * BLOCK_K) // GROUP_SIZE + tl.arange(0, GROUPS_PER_TILE)
        g_ok = offs_g < num_groups
        zp = tl.load(
            qzeros_ptr + offs_g[:, None] * (N // 8) + offs_pn[None, :], mask=g_ok[:, None] & pn_ok[None, :], other=0
        )
        s = tl.load(scales_ptr + offs_g[:, None] * N + offs_n[None, :], mask=g_ok[:, None] & n_ok[None, :], other=0.0)
        if FP16_MAGIC:
            # fp16 throughout, as AutoAWQ: (1024 + q) - (1024 + z) is exact, then one rounding
            # in the scale multiply; pairs of columns become packed HSUB2/HMUL2.
            qf = _unpack_fp16_magic(packed, BLOCK_K, BLOCK_N, USE_ASM)
            zf = _unpack_fp16_magic(zp, GROUPS_PER_TILE, BLOCK_N, USE_ASM)
            s = s.to(tl.float16)
        else:
            qf = _unpack_fp32_magic(packed, BLOCK_K, BLOCK_N)
            zf = _unpack_fp32_magic(zp, GROUPS_PER_TILE, BLOCK_N)
            s = s.to(tl.float32)
        if GROUPS_PER_TILE == 1:
            w = (qf - zf) * s
        else:
            w = tl.reshape(
                (tl.reshape(qf, (GROUPS_PER_TILE, ROWS_PER_GROUP, BLOCK_N)) - zf[:, None, :]) * s[:, None, :],
                (BLOCK_K, BLOCK_N),
            )
        if DOT_FP32:
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            # bf16 activations are multiplied in fp16 too, as AutoAWQ does (x.half()).
            acc = tl.dot(x.to(tl.float16), w, acc)

    offs_out = offs_m[:, None] * stride_om + offs_n[None, :]
    out_mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptr + offs_out, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        acc, last = split_k_sum(acc, ws_ptr, locks_ptr, pid_k, pid_m, pid_n, offs_m, offs_n, M, N, out_mask,
                                BLOCK_N, SPLIT_K)
        if last:
            tl.store(out_ptr + offs_out, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


GEMV_MAX_M = 16
MAX_SPLIT_K = 8

# Batch <= 16 is bandwidth-bound: wide N tiles keep each row's read to 64-128 contiguous
# bytes, and split-K gives ~2 programs per SM even for N = 4096.
_GEMV_CONFIGS = [
    Config({"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 4, "GROUP_M": 1}, 4, 4),
    Config({"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 8, "GROUP_M": 1}, 4, 4),
    Config({"BLOCK_M": 16, "BLOCK_N": 256, "BLOCK_K": 128, "SPLIT_K": 8, "GROUP_M": 1}, 8, 3, hopper_only=True),
    Config({"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 256, "SPLIT_K": 2, "GROUP_M": 1}, 8, 2),
    Config({"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "SPLIT_K": 4, "GROUP_M": 1}, 4, 4),
    Config({"BLOCK_M": 16, "BLOCK_N": 256, "BLOCK_K": 64, "SPLIT_K": 1, "GROUP_M": 1}, 4, 4),
]
_GEMM_CONFIGS = [
    Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "SPLIT_K": 1, "GROUP_M": 8}, 4, 4),
    Config({"BLOCK_M": 32, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 1, "GROUP_M": 8}, 4, 3),
    Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "SPLIT_K": 1, "GROUP_M": 8}, 8, 3),
    Config({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "SPLIT_K": 1, "GROUP_M": 8}, 8, 3, hopper_only=True),
    Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 1, "GROUP_M": 8}, 4, 4),
]
# The interpreter's defaults: small tiles that still exercise split-K and multi-group tiles.
_INTERPRET_GEMV = Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 2, "GROUP_M": 1}, 4, 1)
_INTERPRET_GEMM = Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": 1, "GROUP_M": 4}, 4, 1)

_tuned: dict[tuple[bool, int, bool], object] = {}


def _group_fits(block_k: int, group_size: int) -> bool:
    return block_k % group_size == 0 or group_size % block_k == 0


def _autotuned(x: torch.Tensor, gemv: bool, group_size: int) -> object:
    """One autotuner per (GEMV or GEMM, group size, Hopper or not): each gets only the configs
    whose K tile fits the group layout and that the device runs without spilling."""
    key = (gemv, group_size, capability(x)[0] >= 9)
    if key not in _tuned:
        configs = configs_for(x, _GEMV_CONFIGS if gemv else _GEMM_CONFIGS)
        configs = [c for c in configs if _group_fits(c.kwargs["BLOCK_K"], group_size)]
        assert configs, f"no AWQ config fits group size {group_size}"
        _tuned[key] = make_autotuner(
            _awq_gemm_kernel, configs, key=["M_BUCKET", "N", "K", "GROUP_SIZE", "FP16_MAGIC", "USE_ASM", "DOT_FP32"]
        )
    return _tuned[key]


def awq_gemm_triton(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    *,
    config: Config | None = None,
) -> torch.Tensor:
    """Triton implementation of ``awq_gemm_ref``. ``config`` pins the launch (tests); without
    it a GPU autotunes once per shape bucket and the interpreter uses small fixed tiles."""
    k = x.shape[-1]
    n = qweight.shape[1] * 8
    assert qweight.shape[0] == k and scales.shape == (k // group_size, n) and qzeros.shape == (k // group_size, n // 8)
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.view(*x.shape[:-1], n)
    gemv = m <= GEMV_MAX_M
    consts = dict(
        GROUP_SIZE=group_size,
        FP16_MAGIC=x.dtype != torch.float32,
        USE_ASM=x.is_cuda and not INTERPRET,
        DOT_FP32=dot_fp32(x),
    )
    max_split = MAX_SPLIT_K if gemv else 1
    if config is None and not gpu_tiles(x):
        config = _INTERPRET_GEMV if gemv else _INTERPRET_GEMM
    if config is not None:
        max_split = config.kwargs["SPLIT_K"]
    # Split-K scratch: fp32 slices and per-tile arrival counters, used only when SPLIT_K > 1.
    if max_split > 1:
        ws = torch.empty((max_split * m * n,), dtype=torch.float32, device=x.device)
        locks = splitk_locks(x.device, triton.cdiv(m, 16) * triton.cdiv(n, 16))
    else:
        ws = locks = out
    args = (x2, qweight, qzeros, scales, out, ws, locks, m, n, k, x2.stride(0), out.stride(0), m_bucket(m))

    def grid(meta: dict) -> tuple[int, int]:
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"])

    if config is not None:
        _check_group(config.kwargs["BLOCK_K"], group_size)
        _awq_gemm_kernel[grid](
            *args, **consts, **config.kwargs, EVEN_K=k % config.kwargs["BLOCK_K"] == 0,
            num_warps=config.num_warps, num_stages=config.num_stages
        )
    else:
        _autotuned(x, gemv, group_size)[grid](*args, **consts)  # type: ignore[index]
    return out.view(*x.shape[:-1], n)


def _check_group(block_k: int, group_size: int) -> None:
    assert _group_fits(block_k, group_size), f"group size {group_size} does not fit the K tile {block_k}"


def awq_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
) -> torch.Tensor:
    """y = x @ dequant(qweight); x: [..., K] -> [..., N] in x.dtype.

    On CUDA the Triton kernel runs where it was measured faster than dequantize-then-matmul
    for this shape (once, on first use); elsewhere the torch reference runs.
    """
    if use_triton(x):
        k = x.shape[-1]
        n = qweight.shape[1] * 8
        m = x.numel() // k if k else 0
        key = ("awq", m_bucket(m), n, k, group_size, x.dtype, x.device.index)
        choice = gemm_backend_choice(
            key,
            {
                "triton": lambda: awq_gemm_triton(x, qweight, qzeros, scales, group_size),
                "torch": lambda: awq_gemm_ref(x, qweight, qzeros, scales, group_size),
            },
        )
        if choice == "triton":
            return awq_gemm_triton(x, qweight, qzeros, scales, group_size)
    return awq_gemm_ref(x, qweight, qzeros, scales, group_size)
