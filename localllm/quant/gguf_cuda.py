"""GGUF blocks kept as stored on the GPU: the block linear of a "gguf" plan on CUDA (and of a
Triton rehearsal on the CPU), multiplied by the Triton kernels of localllm.kernels.gguf_linear,
which dequantize the file's blocks in registers.

Loading: each tensor's blocks go from the file's memory map straight into one device buffer
per module (a fused module's shards side by side, Q/K rows already in HF order: the
checkpoint's ``GGUFBlocks``), which is repacked on the device once the last shard is in
(``pack_gguf_blocks``: the same bytes, split by kind) and dropped. No float copy of a weight is
made and nothing is dequantized at load, so the weights take the file's bytes in VRAM (plus
one module's raw buffer while it packs). A tensor whose type the kernels do not take arrives
as a float weight (the checkpoint dequantizes that tensor alone) and is rounded again to
``gguf_formats.FALLBACK`` (Q8_0) on the CPU by the gguf package's quantizer before it is copied
over; the plan's reason line names it.

``TRITON`` is what ``gguf_modules.plan_gguf_modules`` takes to build a model for these kernels:
the per-tensor decision, fused shards of different types (``GGUFShardedLinear``) and the
embedding lookup from blocks (``GGUFEmbedding``, which dequantizes only the rows it looks up:
``dequantize_rows``) are the CPU plan's, with this module as the linear.

Invariant: once loaded, ``packed`` is the ``GGUFPacked`` whose tensors are this module's
buffers (``codes``, ``high``, ``scales``, ``d``, ``lut``), on the module's device; moving the
module rebuilds it from them.
"""

from __future__ import annotations

import torch

from localllm.errors import LocalLLMError
from localllm.kernels._triton import HAS_TRITON
from localllm.kernels.gguf_linear import (
    GGUFPacked,
    dequantize_packed,
    dequantize_rows,
    gguf_linear,
    gpu_layout,
)
from localllm.quant import gguf_formats as gf
from localllm.quant.gguf import GGUFBlocks, quantize_blocks, shard_blocks
from localllm.quant.gguf_experts_cuda import GGUFExpertsCUDA
from localllm.quant.gguf_packed import PackedBlocks
from localllm.quant.gguf_modules import BlockKernels
from localllm.quant.linear import QuantLinear

__all__ = ["TRITON", "GGUFLinearCUDA"]


class GGUFLinearCUDA(PackedBlocks, QuantLinear):
    """One linear in a GGUF block type on the GPU's Triton kernels, fused shards concatenated
    by rows (a row's blocks are independent of every other row's).

    Before loading it holds one empty uint8 buffer, ``blocks``: ``to_empty`` puts it on the
    model's device, which is where the file's blocks are copied to."""

    method = "gguf"
    shard_tensors = ("weight",)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        block_type: int,
        output_sizes: list[int] | None = None,
        bias: bool = False,
    ) -> None:
        super().__init__(in_features, out_features, output_sizes, bias, online=False)
        f = gf.fmt(block_type)
        try:
            gpu_layout(f.name)
        except ValueError as e:
            raise LocalLLMError(str(e)) from None
        if in_features % f.block_weights:
            raise LocalLLMError(f"a {f.name} linear needs in_features % {f.block_weights} == 0, got {in_features}")
        self.block_type = int(block_type)
        self.fmt = f.name
        self.init_blocks()
        self._raw: torch.Tensor | None = None  # the file's blocks while shards arrive, on the device

    # ---- loading ----

    def _raw_blocks(self) -> torch.Tensor:
        if self._raw is None:
            row_bytes = gf.fmt(self.block_type).row_bytes(self.in_features)
            self._raw = torch.empty(self.out_features, row_bytes, dtype=torch.uint8, device=self.blocks.device)
        return self._raw

    def _load_shard(self, name: str, tensor: torch.Tensor | GGUFBlocks, rows: slice, shard: int | None) -> None:
        # a host-to-device copy from the file's pages; only a row-permuted Q/K shard was copied on the host
        self._raw_blocks()[rows].copy_(shard_blocks(self, name, tensor, rows))

    def set_weight(self, weight: torch.Tensor) -> None:
        self._raw_blocks().copy_(quantize_blocks(weight, self.block_type))

    def _finish_loading(self) -> None:
        self.install_packed(self._raw_blocks())
        self._raw = None  # the packed tensors hold the same bytes; keep one copy

    def _loaded(self) -> GGUFPacked:
        if self.packed is None:
            raise LocalLLMError(f"a {self.fmt} GPU linear was used before its blocks were loaded")
        return self.packed

    # ---- compute ----

    def dequantize(self) -> torch.Tensor:
        """float32 ``[out, in]``: the gguf package's dequantization of the file's blocks."""
        return dequantize_packed(self._loaded())

    def dequantize_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """float32 ``[len(rows), in]``: only these rows are dequantized (no host sync)."""
        return dequantize_rows(self._loaded(), rows)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        # the Triton kernel on CUDA and in a rehearsal (or its torch reference where it measured
        # faster for the shape); the torch reference elsewhere
        return gguf_linear(x, self._loaded())

    def shard_state(self, rows: slice) -> dict[str, torch.Tensor]:
        return {"weight": self.dequantize()[rows].cpu().contiguous()}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, type={self.fmt}"


assert gf.fmt(gf.FALLBACK).gpu, "a type without a GPU kernel is rounded again to FALLBACK, which must have one"
TRITON = BlockKernels("triton", "Triton", "Triton kernels on the GPU, dequantized in registers", GGUFLinearCUDA,
                      lambda: HAS_TRITON, 1, GGUFExpertsCUDA)
