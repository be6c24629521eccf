"""A mixture of experts' stacked expert matrices kept in the GGUF file's block types on the
GPU (and in a Triton rehearsal on the CPU): quant/gguf_experts.py's GPU part, kept in its own
file so that the CPU's path never imports Triton.

Each projection's blocks for all E experts are one ``GGUFPacked`` of [E * rows, K] (the file's
stacked ``blk.N.ffn_{gate,up,down}_exps`` bytes, split by kind once loaded on the device by
kernels/gguf_linear.py's ``pack_gguf_blocks``: the same layout as a ``GGUFLinearCUDA``), so
the experts take the file's bytes in VRAM rather than two to four times them as float. Gate
and up of one type are one [E, 2I, K] set (expert e's gate rows then its up rows, as
``models/moe.py``'s ``w13``); of different types two sets.

``forward`` routes as ``models/moe.py``'s ``moe_experts`` does (rows sorted by expert), then
runs each projection in one launch over every routed expert's rows (``gguf_grouped``: the
Triton grouped kernel, its torch reference off the GPU), the activation (gpt-oss's biases and
clamped SwiGLU too) on all rows at once between them; a call with a few rows (a one-token
decode) skips the sort and runs each (token, k) row as its own tile (``per_row_routing``).
The expert boundaries come from a ``searchsorted`` on the device and the launch grid from the
row count alone, so nothing is read back to the host: a decode bucket's CUDA graph can capture it.

Invariant: after loading, the packed buffers are the only copy of the experts' weights (the
``MoE``'s float ``w13``/``w2`` are None) and hold exactly the file's expert bytes, a type
without a GPU kernel at ``gguf_formats.FALLBACK``'s size (rounded again on the CPU first).
"""

from __future__ import annotations

import torch

from localllm.errors import LocalLLMError
from localllm.kernels._triton import gpu_tiles
from localllm.kernels.gguf_linear import (
    GGUFPacked,
    dequantize_packed,
    gguf_grouped,
    gpu_layout,
    per_row_routing,
    route_rows,
)
from localllm.models.moe import activate
from localllm.quant import gguf_formats as gf
from localllm.quant.gguf import GGUFBlocks
from localllm.quant.gguf_experts import GGUFExperts, shard_of_experts
from localllm.quant.gguf_packed import PackedBlocks


class StackedBlocksCUDA(PackedBlocks):
    """One projection of all ``experts`` experts in one block type: ``shard_rows`` output rows
    per expert of ``in_features``, its blocks on the device (``PackedBlocks``)."""

    def __init__(self, experts: int, shard_rows: list[int], in_features: int, block_type: int) -> None:
        super().__init__()
        f = gf.fmt(block_type)
        try:
            gpu_layout(f.name)
        except ValueError as e:
            raise LocalLLMError(str(e)) from None
        if in_features % f.block_weights:
            raise LocalLLMError(f"{f.name} experts need in_features % {f.block_weights} == 0, got {in_features}")
        self.experts, self.shard_rows, self.in_features = experts, list(shard_rows), in_features
        self.rows = sum(shard_rows)  # per expert
        self.block_type, self.fmt = int(block_type), f.name
        self.init_blocks()
        self._raw: torch.Tensor | None = None  # the file's blocks [E, rows, row_bytes] while shards arrive
        self._pending = set(range(len(shard_rows)))

    def load(self, shard: int, tensor: torch.Tensor | GGUFBlocks) -> None:
        """Shard ``shard`` of every expert: the file's blocks (data [E, n, row_bytes] or
        [E * n, row_bytes] of this type) or a float [E, n, K] weight, rounded here on the CPU."""
        blocks = shard_of_experts(tensor, self.block_type, self.experts, self.shard_rows[shard], self.in_features)
        if self._raw is None:
            self._raw = torch.empty(self.experts, self.rows, blocks.shape[2], dtype=torch.uint8,
                                    device=self.blocks.device)
        start = sum(self.shard_rows[:shard])
        self._raw[:, start:start + blocks.shape[1]].copy_(blocks)  # host to device, from the file's pages
        self._pending.discard(shard)
        if not self._pending:
            self.install_packed(self._raw.view(self.experts * self.rows, -1))
            self._raw = None

    @property
    def missing(self) -> list[int]:
        return sorted(self._pending)

    def loaded(self) -> GGUFPacked:
        if self.packed is None:
            raise LocalLLMError(f"{self.fmt} GPU experts were used before their blocks were loaded")
        return self.packed

    def dequantize(self) -> torch.Tensor:
        """float32 [E, rows, K]: the gguf package's dequantization of the file's blocks."""
        return dequantize_packed(self.loaded()).view(self.experts, self.rows, self.in_features)

    def extra_repr(self) -> str:
        return f"{self.experts} x {self.shard_rows}x{self.in_features}, type={self.fmt}"


class GGUFExpertsCUDA(GGUFExperts):
    """All experts of one MoE layer in the file's block types for the GPU's kernels: ``w13``
    (gate and up, fused when of one type; else ``w13`` gate and ``w3`` up) and ``w2`` (down).
    The same loading interface and call as the CPU's ``GGUFExperts``."""

    stacked_blocks = StackedBlocksCUDA

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, b13: torch.Tensor | None,
                b2: torch.Tensor | None, limit: float, alpha: float) -> torch.Tensor:
        """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]), [T, H] fp32 (``moe_experts``'s result)."""
        T, k = ids.shape
        E = self.experts
        on_gpu = gpu_tiles(x)
        flat = ids.flatten()
        if per_row_routing(T, k, E):  # (token, k) order, no sort: the rows come back in place
            routing = route_rows(T * k, E, on_gpu, row_expert=flat)
            rows = x.expand(k, -1) if T == 1 else x.repeat_interleave(k, 0)  # one token: a view
            expert = flat
        else:
            order = torch.argsort(flat, stable=True)
            expert = flat.index_select(0, order)  # each sorted row's expert
            offsets = torch.searchsorted(expert, torch.arange(E + 1, device=x.device, dtype=expert.dtype))
            routing = route_rows(T * k, E, on_gpu, offsets=offsets)
            tokens = order // k
            rows = x.index_select(0, tokens)
        h = gguf_grouped(rows, self.w13.loaded(), routing)
        if self.w3 is not None:
            h = torch.cat([h, gguf_grouped(rows, self.w3.loaded(), routing)], 1)
        h = h.float()
        if b13 is not None:
            h = h + b13.index_select(0, expert).float()
        out = gguf_grouped(activate(h, limit, alpha).to(rows.dtype), self.w2.loaded(), routing).float()
        if b2 is not None:
            out = out + b2.index_select(0, expert).float()
        if routing.offsets is None:
            return (out.view(T, k, -1) * weights.float().unsqueeze(2)).sum(1)
        out.mul_(weights.flatten().index_select(0, order).float().unsqueeze(1))
        return torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device).index_add_(0, tokens, out)
