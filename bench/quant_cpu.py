"""Which CPU path each quantized linear should take: torch's packed matmuls against
dequantize-then-matmul, on the default model's linear shapes, in one run so the ratios are
comparable (absolute times on shared machines drift by +-30%).

    OMP_WAIT_POLICY=PASSIVE python bench/quant_cpu.py [--m 1,16,128] [--reps 30]

Prints one row per (shape, rows M) with microseconds per call and the ratio to fp32
``F.linear`` of the unquantized weight. Columns:
- int8: ``_weight_int8pack_mm`` (bf16 activations) | upcast to bf16 + bf16 GEMM | upcast to fp32
- w8a8: per-token int8 activations + ``torch._int_mm``
- int4: ``_weight_int4pack_mm_for_cpu`` (bf16) | AWQ unpack + fp32 GEMM
- fp8: table-lookup upcast + fp32 GEMM | ``.float()`` upcast + fp32 GEMM | ``torch._scaled_mm``
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # must precede the torch import

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from localllm.quant.fp8 import FP8_DTYPE, FP8_MAX
from localllm.quant.linear import QuantLinear
from localllm.quant.methods import make_quant_linear

# (name, in, out) of SmolLM2-135M's linears
SHAPES = [("qkv", 576, 960), ("o", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576)]


def timeit(fn: Callable[[], object], reps: int) -> float:
    """Median seconds per call over ``reps`` calls, after warm-up."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def quantized(method: str, w: torch.Tensor) -> QuantLinear:
    m = make_quant_linear(method, w.shape[1], w.shape[0], None, False, group_size=64)
    m.set_weight(w)
    m.mark_loaded()
    return m


def measure(x: torch.Tensor, w: torch.Tensor, reps: int) -> dict[str, float]:
    """Seconds per call of every path for ``x @ w.T``."""
    w_bf16, x_bf16 = w.bfloat16(), x.bfloat16()
    i8, w8a8, i4, f8 = (quantized(m, w) for m in ("int8", "int8-w8a8", "rtn4", "fp8"))
    scale_bf16 = i8.weight_scale.bfloat16()
    s_w = f8.weight_scale.reshape(1, -1)

    def scaled_mm() -> torch.Tensor:
        s_x = x.abs().amax(-1, keepdim=True).clamp(min=1e-10) / FP8_MAX
        xq = (x / s_x).to(FP8_DTYPE)
        return torch._scaled_mm(xq, f8.weight.t(), scale_a=s_x, scale_b=s_w, out_dtype=torch.float32)

    calls: dict[str, Callable[[], object]] = {
        "fp32": lambda: F.linear(x, w),
        "bf16": lambda: F.linear(x_bf16, w_bf16),
        "int8 pack": lambda: torch.ops.aten._weight_int8pack_mm(x_bf16, i8.weight, scale_bf16),
        "int8 up-bf16": lambda: i8._dequant_matmul(x, torch.bfloat16),
        "int8 up-fp32": lambda: i8._dequant_matmul(x, torch.float32),
        "w8a8 int_mm": lambda: w8a8(x),
        "int4 pack": lambda: i4(x),
        "int4 unpack": lambda: F.linear(x, i4.dequantize()),
        "fp8 lut": lambda: f8._dequant_matmul(x),
        "fp8 cast": lambda: F.linear(x, f8.weight.float()) * f8.weight_scale,
        "fp8 scaled_mm": scaled_mm,
    }
    with torch.inference_mode():
        return {c: timeit(fn, reps if "scaled_mm" not in c else max(5, reps // 5)) for c, fn in calls.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description="CPU paths of the quantized linears")
    ap.add_argument("--m", default="1,16,128", help="rows of x (tokens in the step)")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, OMP_WAIT_POLICY="
          f"{os.environ.get('OMP_WAIT_POLICY')}; microseconds (ratio to fp32 F.linear)")
    cols = ["fp32", "bf16", "int8 pack", "int8 up-bf16", "int8 up-fp32", "w8a8 int_mm", "int4 pack",
            "int4 unpack", "fp8 lut", "fp8 cast", "fp8 scaled_mm"]
    print(f"{'shape':>8} {'M':>4} " + " ".join(f"{c:>15}" for c in cols))
    for name, k, n in SHAPES:
        w = torch.randn(n, k) * 0.02
        for rows in (int(v) for v in args.m.split(",")):
            t = measure(torch.randn(rows, k), w, args.reps)
            base = t["fp32"]
            print(f"{name:>8} {rows:>4} " + " ".join(f"{t[c] * 1e6:>7.0f} ({t[c] / base:4.2f})" for c in cols),
                  flush=True)


if __name__ == "__main__":
    main()
