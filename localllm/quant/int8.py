"""INT8 weights, per output channel, symmetric: weight-only (W8A16) and W8A8 with dynamic
per-token activation scales.

Checkpoint layout is compressed-tensors' "int-quantized": ``weight`` int8 ``[out, in]`` and
``weight_scale`` ``[out, 1]``, plus ``input_scale`` for static activation scales.
"""

from __future__ import annotations

import torch

from localllm.quant.linear import ChannelScaledLinear, cpu_backend

INT8_MAX = 127.0
# Rows (tokens) up to which _weight_int8pack_mm beats upcast-to-bf16-then-matmul on CPU
# (bench/quant_cpu.py: packed wins at 1 and 16 rows, loses 2-4x at 128).
PACKED_MAX_ROWS = 32


def quantize_int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [out, in]`` -> int8 codes in -127..127 and float32 scales ``[out]``."""
    wf = w.float()
    scale = (wf.abs().amax(dim=1) / INT8_MAX).clamp(min=1e-12)
    return torch.round(wf / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def quantize_per_token_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> int8 codes and float32 scales ``[M, 1]``, one per row (token)."""
    try:
        from localllm.kernels.int8_gemm import quantize_per_token_int8 as kernel
    except ImportError:
        kernel = None
    if kernel is not None and x.is_cuda:
        return kernel(x)
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / INT8_MAX).clamp(min=1e-10)
    return torch.round(xf / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def _kernels():  # noqa: ANN202 - (w8a16, w8a8) kernel functions or Nones
    try:
        from localllm.kernels.int8_gemm import int8_w8a8_gemm, int8_w8a16_gemm
    except ImportError:
        return None, None
    return int8_w8a16_gemm, int8_w8a8_gemm


class Int8Linear(ChannelScaledLinear):
    """W8A16. CPU: ``_weight_int8pack_mm`` with bf16 activations (measured faster than
    dequantize-then-matmul in fp32 at decode sizes and up, see bench/quant_cpu.py);
    ``LOCALLLM_QUANT_CPU_INT8=dequant`` selects the reference instead."""

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
        if self.weight.device.type == "cpu" and cpu_backend("int8") != "dequant":
            self._cpu_scale = self.weight_scale.to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        w8a16, _ = _kernels() if x.is_cuda else (None, None)
        if w8a16 is not None:
            y = w8a16(x2, self.weight, self.weight_scale)
        elif self._cpu_scale is not None and x.device.type == "cpu":
            if x2.shape[0] <= PACKED_MAX_ROWS:
                y = torch.ops.aten._weight_int8pack_mm(x2.to(torch.bfloat16), self.weight, self._cpu_scale)
            else:  # prefill: oneDNN's bf16 GEMM beats the packed kernel, even after the upcast
                y = self._dequant_matmul(x2, torch.bfloat16)
        else:
            y = self._dequant_matmul(x2)
        return self._add_bias(y.to(x.dtype)).reshape(*shape[:-1], self.out_features)


class Int8W8A8Linear(Int8Linear):
    """W8A8: activations quantized per token at run time (or with a checkpoint's static
    ``input_scale``), int8 x int8 -> int32 on ``torch._int_mm`` (CPU, oneDNN VNNI) or the
    int8 tensor-core kernel (CUDA); both scales are applied to the int32 result."""

    method = "int8-w8a8"

    def _finish_loading(self) -> None:
        pass  # no derived layout: _int_mm reads the int8 weight as is

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        _, w8a8 = _kernels() if x.is_cuda else (None, None)
        if w8a8 is not None and not self.has_input_scale:
            y = w8a8(x2, self.weight, self.weight_scale)
        elif x.device.type != "cpu" or cpu_backend("int8_w8a8") == "dequant":
            # torch._int_mm on CUDA wants M > 16; without our kernel, stay weight-only there
            y = self._dequant_matmul(x2)
        else:
            if self.has_input_scale:
                xs = self.input_scale.reshape(1, 1)
                xq = torch.round(x2.float() / xs).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
            else:
                xq, xs = quantize_per_token_int8(x2)
            acc = torch._int_mm(xq, self.weight.t())
            y = acc.float() * xs * self.weight_scale
        return self._add_bias(y.to(x.dtype)).reshape(*shape[:-1], self.out_features)
