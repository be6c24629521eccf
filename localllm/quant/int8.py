"""INT8 weights, per output channel, symmetric: weight-only (W8A16) and W8A8 with dynamic
per-token activation scales.

Checkpoint layout is compressed-tensors' "int-quantized": ``weight`` int8 ``[out, in]`` and
``weight_scale`` ``[out, 1]``, plus ``input_scale`` for static activation scales.
"""

from __future__ import annotations

import torch

from localllm.kernels._triton import use_triton
from localllm.kernels.int8_gemm import int8_w8a8_gemm, int8_w8a16_gemm, quantize_per_token_int8
from localllm.quant.linear import ChannelScaledLinear, cpu_backend

__all__ = ["Int8Linear", "Int8W8A8Linear", "quantize_int8_per_channel", "quantize_per_token_int8"]

INT8_MAX = 127.0
# Rows (tokens) up to which _weight_int8pack_mm beats upcast-to-bf16-then-matmul on CPU
# (bench/quant_cpu.py: packed wins at 1 and 16 rows, loses 2-4x at 128).
PACKED_MAX_ROWS = 32


def quantize_int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [out, in]`` -> int8 codes in -127..127 and float32 scales ``[out]``."""
    wf = w.float()
    scale = (wf.abs().amax(dim=1) / INT8_MAX).clamp(min=1e-12)
    return torch.round(wf / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


class Int8Linear(ChannelScaledLinear):
    """W8A16. CUDA: ``localllm.kernels.int8_gemm``. CPU (bench/quant_cpu.py): up to
    ``PACKED_MAX_ROWS`` tokens ``_weight_int8pack_mm`` with bf16 activations, beyond that an
    upcast to bf16 and oneDNN's bf16 GEMM; ``LOCALLLM_QUANT_CPU_INT8=dequant`` selects the
    fp32 reference instead."""

    method = "int8"
    storage_dtype = torch.int8

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._cpu_scale: torch.Tensor | None = None

    def set_weight(self, weight: torch.Tensor) -> None:
        q, s = quantize_int8_per_channel(weight.to(self.weight.device))
        self.weight.copy_(q)
        self.weight_scale.copy_(s)

    def _finish_loading(self) -> None:
        if not use_triton(self.weight) and cpu_backend("int8") != "dequant":
            self._cpu_scale = self.weight_scale.to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if use_triton(x):  # CUDA, or the CPU in rehearsal mode
            y = int8_w8a16_gemm(x2, self.weight, self.weight_scale)
        elif self._cpu_scale is not None and x2.shape[0] <= PACKED_MAX_ROWS:
            y = torch.ops.aten._weight_int8pack_mm(x2.to(torch.bfloat16), self.weight, self._cpu_scale)
        elif self._cpu_scale is not None:  # prefill: oneDNN's bf16 GEMM beats the packed kernel
            y = self._dequant_matmul(x2, torch.bfloat16)
        else:
            y = self._dequant_matmul(x2, torch.float32)
        return self._add_bias(y.to(x.dtype)).reshape(*shape[:-1], self.out_features)


class Int8W8A8Linear(Int8Linear):
    """W8A8: activations quantized per token at run time (or with a checkpoint's static
    ``input_scale``), int8 x int8 -> int32 on ``torch._int_mm`` (CPU: oneDNN VNNI) or the
    int8 tensor-core kernel (CUDA), both via ``localllm.kernels.int8_gemm``; both scales are
    applied to the int32 result."""

    method = "int8-w8a8"

    def _finish_loading(self) -> None:
        pass  # no derived layout: _int_mm reads the int8 weight as is

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.has_input_scale:  # a checkpoint's static per-tensor activation scale
            xs = self.input_scale.reshape(1, 1)
            xq = torch.round(x2.float() / xs).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
            if x.device.type == "cpu":
                acc = torch._int_mm(xq, self.weight.t()).float()
            else:  # cuBLAS int8 wants M > 16; integers below 2^24 are exact in fp32 anyway
                acc = xq.float() @ self.weight.float().t()
            y = acc * xs * self.weight_scale
        else:
            y = int8_w8a8_gemm(x2, self.weight, self.weight_scale)
        return self._add_bias(y.to(x.dtype)).reshape(*shape[:-1], self.out_features)
