"""FP8 E4M3 weights with per-output-channel scales, activations scaled per token at run time.

Checkpoint layout is compressed-tensors' "float-quantized" (the RedHatAI / neuralmagic
``*-FP8-dynamic`` repos): ``weight`` float8_e4m3fn ``[out, in]``, ``weight_scale`` ``[out, 1]``
(or one per tensor), and ``input_scale`` when activations use a static scale.
"""

from __future__ import annotations

from functools import cache

import torch

from localllm.kernels._triton import use_triton
from localllm.kernels.fp8_gemm import fp8_w8a8_gemm
from localllm.quant.linear import ChannelScaledLinear

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448


def quantize_fp8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [out, in]`` -> float8_e4m3fn codes and float32 scales ``[out]``; values are
    saturated to +-448 because a plain cast turns out-of-range values into NaN."""
    wf = w.float()
    scale = (wf.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    return (wf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


@cache
def _fp8_table(dtype: torch.dtype) -> torch.Tensor:
    """Value of every float8_e4m3fn bit pattern, in ``dtype`` (CPU)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPE).to(dtype)


class FP8Linear(ChannelScaledLinear):
    """CUDA: ``localllm.kernels.fp8_gemm`` (activations quantized per token; FP8 tensor cores
    from compute capability 8.9, its dequantizing reference below). CPU: the weight is
    upcast on the fly and activations stay float, so FP8 saves memory, not time (CPU
    ``_scaled_mm`` measured ~3 ms per call)."""

    method = "fp8"
    storage_dtype = FP8_DTYPE
    # A checkpoint without input_activations is FP8 W8A16: keep activations float everywhere.
    weight_only = False

    def set_weight(self, weight: torch.Tensor) -> None:
        q, s = quantize_fp8_per_channel(weight.to(self.weight.device))
        self.weight.copy_(q)
        self.weight_scale.copy_(s)

    def _upcast(self, dtype: torch.dtype) -> torch.Tensor:
        if self.weight.device.type != "cpu":
            return self.weight.to(dtype)
        # torch's CPU float8 -> float cast runs ~5x slower than a 256-entry table lookup
        codes = self.weight.view(torch.uint8).reshape(-1).int()
        return _fp8_table(dtype).index_select(0, codes).view(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if not use_triton(x) or self.weight_only:
            y = self._dequant_matmul(x2)
        else:  # the kernel quantizes activations per token; below sm89 it runs its reference
            y = fp8_w8a8_gemm(x2, self.weight, self.weight_scale)
        return self._add_bias(y.to(x.dtype)).reshape(*shape[:-1], self.out_features)
