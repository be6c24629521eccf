"""Group-wise int4 with zero points in AutoAWQ's "GEMM" checkpoint layout.

Layout (what AutoAWQ writes and vLLM's ``awq`` method reads), for a linear ``in -> out``
with group size G:
- ``qweight`` int32 ``[in, out/8]``: the 4-bit codes of ``W^T`` packed eight to an int32
  along the output dim; nibble i (bits 4i..4i+3) of word j holds column ``8j + AWQ_ORDER[i]``,
  AWQ_ORDER = 0, 2, 4, 6, 1, 3, 5, 7.
- ``qzeros``  int32 ``[in/G, out/8]``: the integer zero point of each group, packed the same.
- ``scales``  fp16  ``[in/G, out]``.
- ``w[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n]``.

Packing, unpacking and the GEMM live in ``localllm.kernels.awq_gemm``, the one copy of the
layout; this module quantizes float weights into it and owns the module around it.

RTN int4 (``rtn4``) and AWQ share this module: AWQ only changes the float weights it is given
(scaled and clipped, see ``awq_search``), so both write and load the same format.
"""

from __future__ import annotations

import torch

from localllm.errors import LocalLLMError
from localllm.kernels._triton import use_triton
from localllm.kernels.awq_gemm import awq_dequantize, awq_gemm, awq_gemm_ref, awq_pack, awq_unpack
from localllm.quant.linear import QuantLinear, cpu_backend

__all__ = ["AWQLinear", "awq_pack", "awq_unpack", "fake_quant_int4", "quantize_int4"]

def _int4_grid(wg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``wg [out, groups, G]`` float32 -> (float codes 0..15, scales, zeros), the last two
    ``[out, groups, 1]``. The scale is rounded to fp16 first, as the checkpoint stores it, so
    codes and dequantized values match what a loader reconstructs."""
    w_max, w_min = wg.amax(-1, keepdim=True), wg.amin(-1, keepdim=True)
    scales = ((w_max - w_min).clamp_(min=1e-5) / 15).half().float()
    zeros = (-w_min / scales).round_().clamp_(0, 15)
    codes = (wg / scales).round_().add_(zeros).clamp_(0, 15)
    return codes, scales, zeros


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric round-to-nearest of ``w [out, in]`` per group of ``group_size`` inputs.

    Returns codes ``[out, in]`` (int32, 0..15), scales ``[out, in/G]`` (fp16) and integer
    zeros ``[out, in/G]`` (int32).
    """
    out_f, in_f = w.shape
    codes, scales, zeros = _int4_grid(w.float().reshape(out_f, in_f // group_size, group_size))
    return codes.reshape(out_f, in_f).to(torch.int32), scales.squeeze(-1).half(), zeros.squeeze(-1).to(torch.int32)


def fake_quant_int4(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """``w`` quantized and dequantized again (float32), for AWQ's error searches."""
    out_f, in_f = w.shape
    codes, scales, zeros = _int4_grid(w.float().reshape(out_f, in_f // group_size, group_size))
    return codes.sub_(zeros).mul_(scales).reshape(out_f, in_f)


class AWQLinear(QuantLinear):
    """4-bit weights, fp16 group scales, integer zero points; the AutoAWQ GEMM format.

    CUDA: ``localllm.kernels.awq_gemm`` (Triton, or dequantize-then-matmul where that was
    measured faster for the shape). CPU: torch's tinygemm int4 matmul
    (``_weight_int4pack_mm_for_cpu``, bf16 activations) on a repacked copy made once at load,
    which bench/quant_cpu.py measured faster than dequantize-then-matmul at every batch size;
    ``LOCALLLM_QUANT_CPU_INT4=dequant`` selects the reference instead.
    """

    method = "awq"
    shard_tensors = ("qweight", "qzeros", "scales")
    row_wise = True  # groups run along the input; output rows (and so shards) are independent

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group_size: int,
        output_sizes: list[int] | None = None,
        bias: bool = False,
        online: bool = False,
    ) -> None:
        super().__init__(in_features, out_features, output_sizes, bias, online)
        if in_features % group_size:
            raise LocalLLMError(
                f"AWQ group_size {group_size} does not divide the input dim {in_features}; "
                "fix quantization_config.group_size (or pick 64/32 with --group-size)"
            )
        if any(s % 8 for s in self.output_sizes):
            raise LocalLLMError(f"AWQ needs output dims that are multiples of 8, got {self.output_sizes}")
        self.group_size = group_size
        groups = in_features // group_size
        self.register_buffer("qweight", torch.zeros(in_features, out_features // 8, dtype=torch.int32))
        self.register_buffer("qzeros", torch.zeros(groups, out_features // 8, dtype=torch.int32))
        self.register_buffer("scales", torch.zeros(groups, out_features, dtype=torch.float16))
        # The CPU tinygemm layout, derived from the above once loading completes.
        self._cpu_packed: torch.Tensor | None = None
        self._cpu_scale_zeros: torch.Tensor | None = None

    # ---- loading ----

    def _load_shard(self, name: str, tensor: torch.Tensor, rows: slice, shard: int | None) -> None:
        n = rows.stop - rows.start
        groups = self.in_features // self.group_size
        if name == "qweight":
            self._check_shape(name, tensor, (self.in_features, n // 8))
            self.qweight[:, rows.start // 8 : rows.stop // 8].copy_(tensor)
            return
        want = (groups, n // 8) if name == "qzeros" else (groups, n)
        if tensor.dim() == 2 and tensor.shape[1] == want[1] and tensor.shape[0] != groups and tensor.shape[0]:
            raise LocalLLMError(
                f"checkpoint tensor {name!r} has {tensor.shape[0]} groups over {self.in_features} inputs "
                f"(group size {self.in_features // tensor.shape[0]}), but quantization_config.group_size is "
                f"{self.group_size}; fix group_size in config.json"
            )
        self._check_shape(name, tensor, want)
        if name == "qzeros":
            self.qzeros[:, rows.start // 8 : rows.stop // 8].copy_(tensor)
        else:
            self.scales[:, rows].copy_(tensor)

    def set_weight_rows(self, weight: torch.Tensor, rows: slice) -> None:
        # shards are whole packed words: output sizes are multiples of 8 (checked above)
        codes, scales, zeros = quantize_int4(weight.to(self.qweight.device), self.group_size)
        words = slice(rows.start // 8, rows.stop // 8)
        self.qweight[:, words].copy_(awq_pack(codes.t()))
        self.qzeros[:, words].copy_(awq_pack(zeros.t()))
        self.scales[:, rows].copy_(scales.t())
        self._cpu_packed = None

    def _finish_loading(self) -> None:
        if not use_triton(self.qweight) and cpu_backend("int4") != "dequant":
            self._pack_for_cpu()

    def _pack_for_cpu(self) -> None:
        codes = awq_unpack(self.qweight).t().contiguous()  # [out, in]
        zeros = awq_unpack(self.qzeros).float()  # [in/G, out]
        scales = self.scales.float()
        self._cpu_packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        # tinygemm computes (q - 8) * scale + zero with the zero in the float domain, so AWQ's
        # (q - z) * s becomes scale s and zero (8 - z) * s.
        self._cpu_scale_zeros = torch.stack((scales, (8 - zeros) * scales), dim=-1).to(torch.bfloat16).contiguous()

    # ---- compute ----

    def dequantize(self) -> torch.Tensor:
        return awq_dequantize(self.qweight, self.qzeros, self.scales, self.group_size, torch.float32).t()

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if use_triton(x):  # CUDA, or the CPU in rehearsal mode
            return awq_gemm(x, self.qweight, self.qzeros, self.scales, self.group_size)
        if self._cpu_packed is not None:
            return torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.to(torch.bfloat16), self._cpu_packed, self.group_size, self._cpu_scale_zeros
            )
        return awq_gemm_ref(x, self.qweight, self.qzeros, self.scales, self.group_size)

    def shard_state(self, rows: slice) -> dict[str, torch.Tensor]:
        cols = slice(rows.start // 8, rows.stop // 8)
        return {
            "qweight": self.qweight[:, cols].cpu().contiguous(),
            "qzeros": self.qzeros[:, cols].cpu().contiguous(),
            "scales": self.scales[:, rows].cpu().contiguous(),
        }

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group_size={self.group_size}"


def awq_config(group_size: int) -> dict[str, object]:
    """The ``quantization_config`` AutoAWQ writes for a GEMM checkpoint."""
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}


def check_awq_config(cfg: dict[str, object]) -> int:
    """Validates an AWQ ``quantization_config``; returns the group size."""
    bits = cfg.get("bits", cfg.get("w_bit", 4))
    version = str(cfg.get("version", "gemm")).lower()
    zero_point = cfg.get("zero_point", True)
    group = cfg.get("group_size", cfg.get("q_group_size"))
    if bits != 4:
        raise LocalLLMError(f"config.json: AWQ with bits={bits} is not supported; localllm loads 4-bit AWQ")
    if version != "gemm":
        raise LocalLLMError(
            f"config.json: AWQ version {version!r} is not supported; localllm loads the 'gemm' layout"
        )
    if not zero_point:
        raise LocalLLMError("config.json: AWQ without zero points is not supported; use a zero_point=true checkpoint")
    if not isinstance(group, int) or group <= 0:
        raise LocalLLMError(f"config.json: AWQ group_size {group!r} must be a positive integer (e.g. 128)")
    return group
