"""GGUF's block formats as a linear, on CPU: every type the CPU kernels take (the traits
table's ``cpu_kernel`` types, localllm.quant.gguf_formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4) runs as the file stores it, without a second rounding.

At load the file's blocks are repacked once (``gguf_repack``) into the layout the C++ kernels
read (kernels/cpu/gguf/formats.h: 8-row tiles of 4-bit codes plus high-bit planes, or int8
codes; the blocks' own sub-scales and fp16 fields beside them; ``PACKED`` below gives the
sizes), all still the file's values in about the file's bytes, and the raw bytes are dropped.
The kernels quantize activations per 32-block to int8 (two levels by default) and multiply
on integer dot products, as llama.cpp does; ``gguf_dequantize`` gives back the gguf package's
own dequantization bit for bit.

A checkpoint tensor arrives either as raw blocks (``GGUFBlocks``, the file's bytes with the
rows permuted as HF orders them) or, where the file's type has no kernel or a fused module's
shards disagree, as a float weight, which is quantized to this module's type here
(``gguf.quants``, the reference implementation) and so rounded a second time; the loader
says so in the plan's reason line.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from localllm.errors import LocalLLMError
from localllm.kernels import cpu_ops
from localllm.models import forward_context
from localllm.quant import gguf_formats as gf
from localllm.quant.linear import QuantLinear

Q4_0, Q4_1, Q8_0 = 2, 3, 8  # GGMLQuantizationType values
TILE = 8  # output rows per kernel tile


@dataclass(frozen=True, slots=True)
class PackedLayout:
    """Bytes per 8-row tile of one packed type (kernels/cpu/gguf/formats.h's Format<T>, which
    ``gguf_repack`` checks shapes against): per 32-weight block, ``code_bytes`` of codes,
    ``hi_bytes`` of high-bit planes and ``scale_bytes`` of 8-bit sub-scales; per ``super``
    weights, ``d_halves`` fp16 fields."""

    code_bytes: int
    hi_bytes: int
    scale_bytes: int
    super: int
    d_halves: int

    def shapes(self, out_features: int, in_features: int) -> list[tuple[int, ...]]:
        tiles, nb = out_features // TILE, in_features // 32
        return [(tiles, nb, self.code_bytes), (tiles, nb, self.hi_bytes), (tiles, nb, self.scale_bytes),
                (tiles, in_features // self.super, self.d_halves)]

    def bits_per_weight(self) -> float:
        return (self.code_bytes + self.hi_bytes + self.scale_bytes + 2 * self.d_halves * 32 / self.super) * 8 / 256


PACKED: dict[str, PackedLayout] = {  # by the traits table's ``packed`` name
    "q4 tile": PackedLayout(128, 0, 0, 32, 8),  # Q4_0, IQ4_NL: nibbles, d
    "q4 m tile": PackedLayout(128, 0, 0, 32, 16),  # Q4_1: nibbles, d and m
    "q5 tile": PackedLayout(128, 32, 0, 32, 8),  # Q5_0: nibbles + a 5th-bit plane, d
    "q5 m tile": PackedLayout(128, 32, 0, 32, 16),  # Q5_1
    "q8 tile": PackedLayout(256, 0, 0, 32, 8),  # Q8_0: int8 codes, d
    "q4_k tile": PackedLayout(128, 0, 16, 256, 16),  # Q4_K: nibbles, 6-bit scale and min per 32, d and dmin per 256
    "q5_k tile": PackedLayout(128, 32, 16, 256, 16),  # Q5_K
    "q6_k tile": PackedLayout(128, 64, 16, 256, 8),  # Q6_K: nibbles + 2 bit planes, int8 scale per 16, d per 256
    "iq4_xs tile": PackedLayout(128, 0, 8, 256, 8),  # IQ4_XS: table indices, scale - 32 per 32, d per 256
    "mxfp4 tile": PackedLayout(128, 0, 8, 32, 0),  # MXFP4: table indices, E8M0 exponent per 32
}


def packed_layout(type_: int) -> PackedLayout:
    """The packed layout of a kernel type; LocalLLMError for a type no kernel takes."""
    f = gf.BY_ID.get(int(type_))
    if f is None or f.packed is None:
        kernel = ", ".join(gf.type_name(t) for t in sorted(gf.cpu_kernel_types()))
        raise LocalLLMError(f"GGUF block type {gf.type_name(type_)} has no CPU kernel (these do: {kernel})")
    return PACKED[f.packed]
# Activations as two int8 levels (the second quantizes the first's remainder): ~14 bits, so
# greedy tokens follow fp32 activations (max logit error 0.007 on the default model, against
# 2.2 with llama.cpp's single int8 level). LOCALLLM_GGUF_ACT_LEVELS=1 trades that for speed.
ACT_LEVELS = int(os.environ.get("LOCALLLM_GGUF_ACT_LEVELS", "2"))
# The head's activations in one level, as llama.cpp quantizes them: at 16 decode rows the
# second level doubles the tile multiplies and the per-block float work, and a 262k x 640
# Q8_0 head (Gemma 3) is ~60% of such a step's linear time (one level: 1.3x faster there,
# 1-thread Xeon with AMX, docs/benchmarks.md 2026-12-04). Its error reaches the logits only
# (no later layer compounds it): greedy tokens were identical to two levels on 6 prompts x 96
# tokens each on SmolLM2 Q4_K_M, Q8_0 and Gemma 3 270M Q4_K_M, while one level everywhere
# changed 3 of 4 replies. LOCALLLM_GGUF_HEAD_LEVELS=2 restores the two-level head.
HEAD_ACT_LEVELS = min(ACT_LEVELS, int(os.environ.get("LOCALLLM_GGUF_HEAD_LEVELS", "1")))
# From this many rows (prefill chunks) the weight is expanded to a dense matrix for a blocked
# GEMM (oneDNN; AMX on CPUs that have it): at 512 rows 6 ms against 61 ms for the integer
# kernel on one 576x3072 linear (Xeon with AMX, measured). Below it (decode batches, short
# prompts) each row's result is bit-identical whatever else is in the batch; above it a row
# may differ in the last bits by batch size, as any vendor GEMM's do.
DENSE_ROWS = 64


@dataclass(slots=True)
class GGUFBlocks:
    """A GGUF tensor's blocks: ``data`` uint8 ``[rows, K / 32 * block_bytes]``."""

    type: int
    data: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        f = gf.fmt(self.type)
        return self.data.shape[0], self.data.shape[1] // f.block_bytes * f.block_weights


def quantize_blocks(w: torch.Tensor, type_: int) -> torch.Tensor:
    """A float ``[rows, K]`` weight as GGUF blocks of ``type_`` (uint8 ``[rows, row_bytes]``)."""
    from gguf import GGMLQuantizationType, quants

    arr = quants.quantize(w.detach().float().cpu().numpy(), GGMLQuantizationType(type_))
    return torch.from_numpy(np.ascontiguousarray(arr).reshape(w.shape[0], -1))


def dequantize_blocks(blocks: torch.Tensor, type_: int) -> torch.Tensor:
    """The float32 weight GGUF's reference dequantizer gives for ``blocks``."""
    from gguf import GGMLQuantizationType, quants

    arr = quants.dequantize(blocks.numpy(), GGMLQuantizationType(type_))
    return torch.from_numpy(np.ascontiguousarray(arr)).reshape(blocks.shape[0], -1)


def shard_blocks(module: QuantLinear, name: str, tensor: torch.Tensor | GGUFBlocks, rows: slice) -> torch.Tensor:
    """The blocks a block linear (``module.block_type``) keeps for output rows ``rows``: the
    file's own (``GGUFBlocks``, checked against the module's type and shape), or a float weight
    quantized to the module's type here (a second rounding). Uint8 ``[rows, row_bytes]``."""
    n, block_type = rows.stop - rows.start, int(getattr(module, "block_type"))
    if isinstance(tensor, GGUFBlocks):
        if tensor.type != block_type or tensor.shape != (n, module.in_features):
            raise LocalLLMError(
                f"GGUF tensor {gf.type_name(tensor.type)} {tensor.shape} does not fit a "
                f"{gf.type_name(block_type)} linear shard of {n}x{module.in_features}"
            )
        return tensor.data
    module._check_shape(name, tensor, (n, module.in_features))
    return quantize_blocks(tensor, block_type)


class GGUFLinear(QuantLinear):
    """One linear in a GGUF block type, fused shards concatenated by rows (a row's blocks are
    independent of every other row's, so fusion and the Q/K row permutation are byte moves).

    Buffers after loading (``packed``, shapes from ``packed_layout``): ``codes``, ``hi`` and
    ``scales`` uint8 ``[out/8, K/32, ...]``, ``d`` fp16 ``[out/8, K/super, ...]``.
    """

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
        layout = packed_layout(block_type)
        fmt = gf.fmt(block_type)
        if in_features % fmt.block_weights or in_features % layout.super or out_features % TILE:
            raise LocalLLMError(
                f"a {fmt.name} linear needs in_features % {max(fmt.block_weights, layout.super)} == 0 and "
                f"out_features % 8 == 0, got {in_features}->{out_features}"
            )
        self.block_type = block_type
        # rows of one prompt chunk from which the weight is expanded for a dense GEMM; the
        # deterministic mode raises it past any chunk, so every row takes the integer kernel
        self.dense_rows = DENSE_ROWS
        # int8 levels of this linear's activations: ACT_LEVELS, HEAD_ACT_LEVELS for the head
        # (set by the planner); per row either way, so the batch does not change a row
        self.act_levels = ACT_LEVELS
        self._raw: torch.Tensor | None = None  # the file's blocks while shards arrive (CPU)
        shapes = layout.shapes(out_features, in_features)
        for name, shape in zip(("codes", "hi", "scales"), shapes):
            self.register_buffer(name, torch.empty(shape, dtype=torch.uint8))
        self.register_buffer("d", torch.empty(shapes[3], dtype=torch.float16))

    # ---- loading ----

    def _raw_blocks(self) -> torch.Tensor:
        if self._raw is None:
            row_bytes = gf.fmt(self.block_type).row_bytes(self.in_features)
            self._raw = torch.empty(self.out_features, row_bytes, dtype=torch.uint8)
        return self._raw

    def _load_shard(self, name: str, tensor: torch.Tensor | GGUFBlocks, rows: slice, shard: int | None) -> None:
        self._raw_blocks()[rows].copy_(shard_blocks(self, name, tensor, rows))

    def set_weight(self, weight: torch.Tensor) -> None:
        self._raw_blocks().copy_(quantize_blocks(weight, self.block_type))

    def _finish_loading(self) -> None:
        if not cpu_ops.has_gguf_kernels():
            raise LocalLLMError("GGUF block linears need localllm's CPU kernels (an x86-64-v3 CPU and a C++ compiler)")
        packed = torch.ops.localllm_cpu.gguf_repack(self._raw_blocks(), self.block_type, self.in_features)
        self.codes, self.hi, self.scales, self.d = packed
        self._raw = None  # the packed copy holds the same values; keep one

    # ---- compute ----

    def dequantize(self) -> torch.Tensor:
        """float32 ``[out, in]``: the gguf package's dequantization of the file's blocks."""
        return torch.ops.localllm_cpu.gguf_dequantize(self.packed, self.block_type, torch.float32)

    def dequantize_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """float32 ``[len(rows), in]``: only the tiles that hold ``rows`` are unpacked."""
        tiles = rows // TILE
        dense = torch.ops.localllm_cpu.gguf_dequantize([p[tiles] for p in self.packed], self.block_type, torch.float32)
        return dense.view(rows.numel(), TILE, self.in_features)[torch.arange(rows.numel()), rows % TILE]

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        # A row takes the dense GEMM only when its own prompt chunk is long: the integer
        # kernel's rows do not depend on the batch, while the dense path rounds activations to
        # bf16, so choosing by the whole batch's size changed greedy replies with the load
        # (a decode beside a long prompt chunk, or short prompts packed into one step).
        split = forward_context.row_split()
        if split is None:
            return self._dense(x) if x.shape[0] >= self.dense_rows else self._integer(x)
        if max(split.chunk_lens, default=0) < self.dense_rows:
            return self._integer(x)
        w = self._dense_weight()
        out = torch.empty(x.shape[0], self.out_features)  # fp32: the integer kernel's rows stay unrounded
        start, short = 0, split.num_decodes  # rows [start, start + short) go to the integer kernel together
        for n in split.chunk_lens:
            if n < self.dense_rows:
                short += n
                continue
            if short:
                out[start : start + short] = self._integer(x[start : start + short])
            start += short
            out[start : start + n] = torch.nn.functional.linear(x[start : start + n].to(w.dtype), w)
            start, short = start + n, 0
        if short:
            out[start : start + short] = self._integer(x[start : start + short])
        return out

    @property
    def packed(self) -> list[torch.Tensor]:
        """The packed tensors the kernels take, in ``gguf_repack``'s order."""
        return [self.codes, self.hi, self.scales, self.d]

    def _dense_weight(self) -> torch.Tensor:
        dtype = torch.bfloat16 if cpu_ops.fast_bf16() else torch.float32
        return torch.ops.localllm_cpu.gguf_dequantize(self.packed, self.block_type, dtype)

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        w = self._dense_weight()
        return torch.nn.functional.linear(x.to(w.dtype), w)

    def _integer(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.localllm_cpu.gguf_linear(x.float(), self.packed, self.block_type, self.act_levels)

    def shard_state(self, rows: slice) -> dict[str, torch.Tensor]:
        return {"weight": self.dequantize()[rows].contiguous()}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, type={gf.type_name(self.block_type)}"
