"""SiLU(gate) * up over the fused gate_up projection output.

The Triton kernel reads each [gate | up] row once and writes the product once; eager torch
materialises silu(gate) in between.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from localllm.kernels._triton import next_power_of_2, tl, triton, use_triton


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2*I] laid out as [gate | up]. Returns [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


# --- Triton ---------------------------------------------------------------------------------------


@triton.jit
def _silu_and_mul_kernel(out_ptr, x_ptr, n_cols, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    act = gate / (1.0 + tl.exp(-gate))
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """Triton implementation of ``silu_and_mul_ref`` (any leading dims)."""
    two_i = x.shape[-1]
    n = two_i // 2
    x2 = x.reshape(-1, two_i)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    rows = x2.shape[0]
    if rows and n:
        block = min(next_power_of_2(n), 1024)
        _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](
            out.view(-1, n), x2, n, x2.stride(0), n, BLOCK=block, num_warps=4
        )
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if use_triton(x):
        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)
