"""RMSNorm, optionally fused with the residual add that precedes it.

The Triton kernel runs one program per row (token) and holds the whole row in registers, so
x, residual and weight are read once and the output and new residual written once: one pass
over memory where eager torch makes four or five.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from localllm.kernels._triton import next_power_of_2, tl, triton, use_triton


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Normalises the last dim in fp32.

    With ``residual``: computes ``h = x + residual`` and returns ``(rms_norm(h), h)``, the new
    residual stream, so a decoder layer does one pass over memory instead of two.
    """
    if residual is not None:
        x = x + residual
        residual = x
    out = F.rms_norm(x.float(), x.shape[-1:], None, eps).to(weight.dtype) * weight
    return out if residual is None else (out, residual)


# --- Triton ---------------------------------------------------------------------------------------


@triton.jit
def _rms_norm_kernel(
    out_ptr,
    res_out_ptr,
    x_ptr,
    res_ptr,
    w_ptr,
    eps,
    n_cols,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        # Round the sum to the activation dtype, as the unfused add would: the stored residual
        # and the normalised value then agree bit for bit with the reference.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    # As the reference: normalise in fp32, round once to the weight dtype, then scale.
    normed = (xf * rstd).to(w_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton implementation; same contract and output dtypes as ``rms_norm_ref``."""
    shape = x.shape
    n = shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    sum_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    # The output feeds the next matmul, so it takes the weights' dtype even when the residual
    # stream is fp32 (the model keeps it so).
    out = torch.empty(shape, dtype=weight.dtype, device=x.device)
    out2 = out.view(-1, n)
    if residual is not None:
        assert residual.shape == shape
        r2 = residual.reshape(-1, n)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        res_out = torch.empty(shape, dtype=sum_dtype, device=x.device)
        ro2 = res_out.view(-1, n)
    else:
        r2 = ro2 = x2  # never read: HAS_RESIDUAL is False
        res_out = None
    if rows:
        block_n = next_power_of_2(n)
        assert block_n <= 65536, "rows longer than 64K need a looped kernel"
        # About 8-16 fp32 values per thread keeps the row in registers without spilling.
        num_warps = min(max(block_n // 256, 1), 16)
        _rms_norm_kernel[(rows,)](
            out2, ro2, x2, r2, weight, eps, n,
            x2.stride(0), r2.stride(0), out2.stride(0), ro2.stride(0),
            HAS_RESIDUAL=residual is not None, BLOCK_N=block_n, num_warps=num_warps,
        )  # fmt: skip
    return out if res_out is None else (out, res_out)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if use_triton(x):
        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_ref(x, weight, eps, residual)
