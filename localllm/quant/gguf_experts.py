"""A mixture of experts' stacked expert matrices kept in the GGUF file's block types, on CPU.

llama.cpp stores each layer's experts stacked, ``blk.N.ffn_{gate,up,down}_exps.weight`` of
[E, rows, K] in one block type per tensor (MXFP4 in every gpt-oss file; Q4_K and Q6_K in a
Qwen3-MoE Q4_K_M). ``GGUFExperts`` holds those blocks for all E experts, one packed set per
projection (``StackedBlocks``: the [E * rows, K] matrix repacked once by ``gguf_repack``, the
same layout and kernels as ``GGUFLinear``), so a MoE model takes about its file's bytes rather
than two to four times them dequantized. Expert e's rows are packed tiles
``[e * rows / 8, (e + 1) * rows / 8)``: a contiguous slice of each packed tensor, which the
C++ kernels take as it is (no copy).

Gate and up of one type are packed as one [E, 2I, K] set (expert e's gate rows, then its up
rows, as ``models/moe.py``'s ``w13``), so each expert's activations are quantized once for both;
of different types they stay two sets. A projection stored in a type no CPU kernel takes
arrives dequantized and is rounded again to ``gguf_formats.FALLBACK``, as a linear would be.

``moe_experts_gguf`` runs them in one C++ call, ``gguf_moe_experts`` (kernels/cpu/gguf/experts.cpp):
the (token, slot) pairs sorted by expert, then per projection ``gguf_linear_grouped``'s loop,
which quantizes all rows once and runs every routed expert's rows on its slice of the stack
with the same integer kernels as ``gguf_linear`` (bit for bit); between them ``models/moe.py``'s
activation (gpt-oss's biases and clamped SwiGLU included), and the routing weights' sum after.
Like ``moe_experts`` it is one opaque custom op, so the compiled CPU decode step keeps one graph
around it.

Invariant: after loading, the module's buffers are the only copy of the experts' weights
(no float ``w13``/``w2`` remain on the ``MoE``); their bytes are the file's expert bytes up
to the packed layout's own size (``PackedLayout``).
"""

from __future__ import annotations

import torch
from torch import nn

from localllm.errors import LocalLLMError
from localllm.kernels import cpu_ops
from localllm.kernels.opaque_op import opaque_op
from localllm.quant import gguf_formats as gf
from localllm.quant.gguf import ACT_LEVELS, TILE, GGUFBlocks, packed_layout, quantize_blocks


def shard_of_experts(tensor: torch.Tensor | GGUFBlocks, block_type: int, experts: int, n: int,
                     in_features: int) -> torch.Tensor:
    """One shard (``n`` rows) of all ``experts`` experts as ``block_type`` blocks, uint8
    [E, n, row_bytes]: the file's blocks as they are (data [E, n, row_bytes] or [E * n,
    row_bytes]) or a float [E, n, K] weight rounded here on the CPU. One-line errors for a
    tensor that does not fit."""
    E, K = experts, in_features
    row_bytes = gf.fmt(block_type).row_bytes(K)
    if isinstance(tensor, GGUFBlocks):
        if tensor.type != block_type or tensor.data.numel() != E * n * row_bytes:
            raise LocalLLMError(
                f"GGUF experts {gf.type_name(tensor.type)} {tuple(tensor.data.shape)} do not fit "
                f"{E} {gf.type_name(block_type)} experts of {n}x{K}")
        return tensor.data.reshape(E, n, row_bytes)
    if tuple(tensor.shape) != (E, n, K):
        raise LocalLLMError(f"expert weights of shape {tuple(tensor.shape)}, expected {(E, n, K)}")
    return quantize_blocks(tensor.reshape(E * n, K), block_type).reshape(E, n, row_bytes)


class StackedBlocks(nn.Module):
    """One projection of all ``experts`` experts in one block type: ``shard_rows`` output rows
    per expert (``[I, I]`` for gate and up fused, ``[I]`` or ``[H]`` alone) of ``in_features``.

    Buffers after loading: ``codes``, ``hi``, ``scales`` uint8 and ``d`` fp16, as
    ``GGUFLinear``'s for an [experts * rows, in_features] weight."""

    def __init__(self, experts: int, shard_rows: list[int], in_features: int, block_type: int) -> None:
        super().__init__()
        layout = packed_layout(block_type)
        fmt = gf.fmt(block_type)
        self.experts, self.shard_rows, self.in_features = experts, list(shard_rows), in_features
        self.rows = sum(shard_rows)  # per expert
        if in_features % fmt.block_weights or in_features % layout.super or self.rows % TILE:
            raise LocalLLMError(
                f"{fmt.name} experts need in_features % {max(fmt.block_weights, layout.super)} == 0 and rows % 8 "
                f"== 0, got {self.rows}x{in_features}")
        self.block_type = block_type
        self._raw: torch.Tensor | None = None  # the file's blocks [E, rows, row_bytes] while shards arrive
        self._pending = set(range(len(shard_rows)))
        shapes = layout.shapes(experts * self.rows, in_features)
        for name, shape in zip(("codes", "hi", "scales"), shapes):
            self.register_buffer(name, torch.empty(shape, dtype=torch.uint8))
        self.register_buffer("d", torch.empty(shapes[3], dtype=torch.float16))

    def load(self, shard: int, tensor: torch.Tensor | GGUFBlocks) -> None:
        """Shard ``shard`` of every expert: the file's blocks (``GGUFBlocks`` of this type, data
        [E, n, row_bytes] or [E * n, row_bytes]) or a float [E, n, K] weight, rounded here."""
        blocks = shard_of_experts(tensor, self.block_type, self.experts, self.shard_rows[shard], self.in_features)
        if self._raw is None:
            self._raw = torch.empty(self.experts, self.rows, blocks.shape[2], dtype=torch.uint8)
        start = sum(self.shard_rows[:shard])
        self._raw[:, start:start + blocks.shape[1]].copy_(blocks)
        self._pending.discard(shard)
        if not self._pending:
            self._repack()

    def _repack(self) -> None:
        if not cpu_ops.has_gguf_kernels():
            raise LocalLLMError("GGUF experts need localllm's CPU kernels (an x86-64-v3 CPU and a C++ compiler)")
        assert self._raw is not None
        raw = self._raw.view(self.experts * self.rows, -1)
        self.codes, self.hi, self.scales, self.d = torch.ops.localllm_cpu.gguf_repack(
            raw, self.block_type, self.in_features)
        self._raw = None  # the packed copy holds the same values; keep one

    @property
    def missing(self) -> list[int]:
        """The shards that have not arrived yet."""
        return sorted(self._pending)

    @property
    def packed(self) -> list[torch.Tensor]:
        return [self.codes, self.hi, self.scales, self.d]

    def dequantize(self) -> torch.Tensor:
        """float32 [E, rows, K]: the gguf package's dequantization of the file's blocks."""
        dense = torch.ops.localllm_cpu.gguf_dequantize(self.packed, self.block_type, torch.float32)
        return dense.view(self.experts, self.rows, self.in_features)

    def extra_repr(self) -> str:
        return f"{self.experts} x {self.shard_rows}x{self.in_features}, type={gf.type_name(self.block_type)}"


def expert_slice(packed: list[torch.Tensor], experts: int, e: int) -> list[torch.Tensor]:
    """Expert ``e``'s packed tiles: a contiguous dim-0 slice of each stacked tensor."""
    tiles = packed[0].shape[0] // experts
    return [p[e * tiles:(e + 1) * tiles] for p in packed]


@opaque_op("localllm::moe_experts_gguf")
def moe_experts_gguf(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w13: list[torch.Tensor],
    w13_type: int,
    w3: list[torch.Tensor],
    w3_type: int,
    w2: list[torch.Tensor],
    w2_type: int,
    b13: torch.Tensor | None,
    b2: torch.Tensor | None,
    limit: float,
    alpha: float,
) -> torch.Tensor:
    """``models/moe.py``'s ``moe_experts`` over packed GGUF experts, [T, H] fp32. ``w13``:
    gate and up fused (``w3`` empty), or gate alone with up in ``w3``; ``w2``: down."""
    # one C++ call for the block (kernels/cpu/gguf/experts.h's moe_experts): the sort by expert,
    # both grouped projections (activations quantized once each) and the activation and weighted
    # sum between and after them
    return torch.ops.localllm_cpu.gguf_moe_experts(
        x.float(), weights.float(), ids.long(), w13, w13_type, w3, w3_type, w2, w2_type,
        None if b13 is None else b13.float(), None if b2 is None else b2.float(), limit, alpha, ACT_LEVELS)


@moe_experts_gguf.register_fake
def _(x, weights, ids, w13, w13_type, w3, w3_type, w2, w2_type, b13, b2, limit, alpha):  # type: ignore[no-untyped-def]
    return x.new_empty(x.shape[0], x.shape[1], dtype=torch.float32)


class GGUFExperts(nn.Module):
    """All experts of one MoE layer in the file's block types: ``w13`` (gate and up, fused
    when of one type; else ``w13`` gate and ``w3`` up) and ``w2`` (down). ``MoE.forward``
    calls it with the routing and the MoE's own biases and activation settings."""

    # the holder of one projection's stacked blocks: the GPU subclass keeps them on the device
    stacked_blocks: type[nn.Module] = StackedBlocks

    def __init__(self, experts: int, hidden: int, intermediate: int, gate_type: int, up_type: int,
                 down_type: int) -> None:
        super().__init__()
        self.experts, self.hidden = experts, hidden
        fused = gate_type == up_type
        blocks = self.stacked_blocks
        self.w13 = blocks(experts, [intermediate, intermediate] if fused else [intermediate], hidden, gate_type)
        self.w3 = None if fused else blocks(experts, [intermediate], hidden, up_type)
        self.w2 = blocks(experts, [hidden], intermediate, down_type)

    def load_weight(self, param: str, tensor: torch.Tensor | GGUFBlocks, shard: int | None) -> None:
        """``models/moe.py``'s names: ``w13`` shard 0 (gate) or 1 (up), ``w2``; all experts at once."""
        if param == "w2" and shard is None:
            self.w2.load(0, tensor)
        elif param == "w13" and shard in (0, 1):
            if self.w3 is None:
                self.w13.load(shard, tensor)
            else:
                (self.w13 if shard == 0 else self.w3).load(0, tensor)
        else:
            raise LocalLLMError(f"expert tensor {param!r} (shard {shard}) has no place in GGUF experts")

    def expected_weight_names(self) -> list[str]:
        """The stacked tensors still missing (the loader's ``expected - loaded``)."""
        if self.w3 is None:
            names = [f"w13#{s}" for s in self.w13.missing]
        else:
            names = ["w13#0"] * bool(self.w13.missing) + ["w13#1"] * bool(self.w3.missing)
        return names + ["w2"] * bool(self.w2.missing)

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 (w13 [E, 2I, H], w2 [E, H, I]): what the kernels multiply by."""
        w13 = self.w13.dequantize() if self.w3 is None else torch.cat([self.w13.dequantize(), self.w3.dequantize()], 1)
        return w13, self.w2.dequantize()

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, b13: torch.Tensor | None,
                b2: torch.Tensor | None, limit: float, alpha: float) -> torch.Tensor:
        w3 = self.w3.packed if self.w3 is not None else []
        w3_type = self.w3.block_type if self.w3 is not None else -1
        return moe_experts_gguf(x, weights, ids, self.w13.packed, self.w13.block_type, w3, w3_type,
                                self.w2.packed, self.w2.block_type, b13, b2, limit, alpha)
