"""The GPU side of ``--deterministic``'s float linear: y = x w^T (+ bias), each row's numbers
independent of the batch (the CPU side is the C++ ``dense_linear``, kernels/cpu/dense/).

cuBLAS picks its kernel, tile and split-K by the shape, M included, so a row's sums there are
grouped differently in a batch of 1 and one of 40. Here one configuration serves every M: fixed
BLOCK_M, BLOCK_N, BLOCK_K, warps and stages, one program per output tile, K walked from 0 in
BLOCK_K steps into one fp32 accumulator (no split-K, no autotuning, no atomics). A row's
outputs are then the same instructions on the same operands wherever it sits: rows past M are
masked to zeros, which change no sum. Written and checked in the rehearsal (the interpreter
on CPU tensors, tests/engine/test_rehearsal.py) and run on an H200 (2026-12-04).
"""

from __future__ import annotations

import torch

from localllm.kernels._triton import dot_fp32, tl, triton

# On an H200 the MMA path gave every row the same bits alone and in batches of 40 and 512
# (docs/benchmarks.md); the interpreter's dot is made row-invariant too (kernels/_triton.py).
# One configuration for all shapes (the point); 64x64x64 with 4 warps is a middle tile that
# every architecture compiles: decode rows waste the tile's rows, which a GEMV-bound step hides.
BLOCK_M, BLOCK_N, BLOCK_K, WARPS, STAGES = 64, 64, 64, 4, 3


@triton.jit
def _invariant_gemm_kernel(
    y_ptr, x_ptr, w_ptr, b_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        a = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        # [BLOCK_K, BLOCK_N] view of the [N, K] weight
        b = tl.load(w_ptr + offs_n[None, :] * stride_wn + k[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        if DOT_FP32:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def invariant_gemm_triton(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """x [M, K] (cast to the weight's dtype), weight [N, K] -> [M, N] in ``out_dtype``, from
    fp32 sums; the one launch configuration above whatever M is."""
    x = x.to(weight.dtype)
    if x.stride(-1) != 1:
        x = x.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    M, K = x.shape
    N = w.shape[0]
    y = torch.empty((M, N), dtype=out_dtype, device=x.device)
    if M == 0:
        return y
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    _invariant_gemm_kernel[grid](
        y, x, w, bias if bias is not None else y, M, N, K, x.stride(0), w.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, DOT_FP32=dot_fp32(x),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=WARPS, num_stages=STAGES,
    )  # fmt: skip
    return y
