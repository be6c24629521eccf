"""GGUF's block formats as a linear, on CPU: Q4_0, Q4_1 and Q8_0 weights run as the file
stores them, without a second rounding.

Each output row is K/32 blocks of 32 weights with an fp16 scale ``d`` (and, for Q4_1, an
fp16 minimum ``m``): ``w = d * q + m`` (Q4_1), ``d * (q - 8)`` (Q4_0), ``d * q`` (Q8_0). At
load the blocks are repacked once (``gguf_repack``) into the tile layout the C++ kernel reads
(``localllm.kernels.cpu_ops``: codes, ``d`` and the code-sum factor ``c``, all still the
file's values), and the raw bytes are dropped. The kernel quantizes activations per 32-block
to int8 and multiplies on integer dot products, as llama.cpp does.

A checkpoint tensor arrives either as raw blocks (``GGUFBlocks``, the file's bytes with the
rows permuted as HF orders them) or, where the file's type is not one of these three or a
fused module's shards disagree, as a float weight, which is quantized to this module's type
here (``gguf.quants``, the reference implementation) and so rounded a second time; the loader
says so in the plan's reason line.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from localllm.errors import LocalLLMError
from localllm.kernels import cpu_ops, measured
from localllm.models import forward_context
from localllm.quant.linear import QuantLinear, fused_sizes, iter_linears, replace_module

Q4_0, Q4_1, Q8_0 = 2, 3, 8  # GGMLQuantizationType values
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}
TYPE_NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0"}
TILE = 8  # output rows per kernel tile
# Activations as two int8 levels (the second quantizes the first's remainder): ~14 bits, so
# greedy tokens follow fp32 activations (max logit error 0.007 on the default model, against
# 2.2 with llama.cpp's single int8 level). LOCALLLM_GGUF_ACT_LEVELS=1 trades that for speed.
ACT_LEVELS = int(os.environ.get("LOCALLLM_GGUF_ACT_LEVELS", "2"))
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
        return self.data.shape[0], self.data.shape[1] // BLOCK_BYTES[self.type] * 32


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


class GGUFLinear(QuantLinear):
    """One linear in a GGUF block type, fused shards concatenated by rows (a row's blocks are
    independent of every other row's, so fusion and the Q/K row permutation are byte moves).

    Buffers after loading: ``codes`` uint8 ``[out/8, K/32, 128 or 256]``, ``d`` and ``c``
    fp16 ``[out/8, K/32, 8]``; ``w = d * q + c`` per block (``c`` = m, -8d or 0).
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
        if block_type not in BLOCK_BYTES:
            raise LocalLLMError(f"GGUF block type {block_type} is not one of Q4_0, Q4_1, Q8_0")
        if in_features % 32 or out_features % TILE:
            raise LocalLLMError(
                f"a GGUF linear needs in_features % 32 == 0 and out_features % 8 == 0, got {in_features}->{out_features}"
            )
        self.block_type = block_type
        # rows of one prompt chunk from which the weight is expanded for a dense GEMM; the
        # deterministic mode raises it past any chunk, so every row takes the integer kernel
        self.dense_rows = DENSE_ROWS
        self._raw: torch.Tensor | None = None  # the file's blocks while shards arrive (CPU)
        tiles, nb = out_features // TILE, in_features // 32
        self.register_buffer("codes", torch.empty(tiles, nb, 256 if block_type == Q8_0 else 128, dtype=torch.uint8))
        self.register_buffer("d", torch.empty(tiles, nb, TILE, dtype=torch.float16))
        self.register_buffer("c", torch.empty(tiles, nb, TILE, dtype=torch.float16))

    # ---- loading ----

    def _raw_blocks(self) -> torch.Tensor:
        if self._raw is None:
            row_bytes = self.in_features // 32 * BLOCK_BYTES[self.block_type]
            self._raw = torch.empty(self.out_features, row_bytes, dtype=torch.uint8)
        return self._raw

    def _load_shard(self, name: str, tensor: torch.Tensor | GGUFBlocks, rows: slice, shard: int | None) -> None:
        n = rows.stop - rows.start
        if isinstance(tensor, GGUFBlocks):
            if tensor.type != self.block_type or tensor.shape != (n, self.in_features):
                raise LocalLLMError(
                    f"GGUF tensor {TYPE_NAMES.get(tensor.type, tensor.type)} {tensor.shape} does not fit a "
                    f"{TYPE_NAMES[self.block_type]} linear shard of {n}x{self.in_features}"
                )
            blocks = tensor.data
        else:
            self._check_shape(name, tensor, (n, self.in_features))
            blocks = quantize_blocks(tensor, self.block_type)
        self._raw_blocks()[rows].copy_(blocks)

    def set_weight(self, weight: torch.Tensor) -> None:
        self._raw_blocks().copy_(quantize_blocks(weight, self.block_type))

    def _finish_loading(self) -> None:
        if not cpu_ops.has_gguf_kernels():
            raise LocalLLMError("GGUF block linears need localllm's CPU kernels (an x86-64-v3 CPU and a C++ compiler)")
        codes, d, c = torch.ops.localllm_cpu.gguf_repack(self._raw_blocks(), self.block_type, self.in_features)
        self.codes, self.d, self.c = codes, d, c
        self._raw = None  # the packed copy holds the same values; keep one

    # ---- compute ----

    def dequantize(self) -> torch.Tensor:
        """float32 ``[out, in]`` from the packed buffers: ``d * q + c`` per block."""
        return self._dequantize_tiles(torch.arange(self.out_features // TILE)).reshape(self.out_features, -1)

    def dequantize_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """float32 ``[len(rows), in]``: only the tiles that hold ``rows`` are unpacked."""
        tiles = self._dequantize_tiles(rows // TILE)  # [R, 8, in]
        return tiles[torch.arange(rows.numel()), rows % TILE]

    def _dequantize_tiles(self, tiles: torch.Tensor) -> torch.Tensor:
        codes, nb = self.codes[tiles], self.codes.shape[1]
        n = tiles.numel()
        if self.block_type == Q8_0:
            # chunk p, byte 4r + j = weight 4p + j of tile row r
            q = codes.view(torch.int8).view(n, nb, 8, TILE, 4).permute(0, 3, 1, 2, 4).float()
        else:
            # chunk p, byte 4r + j: weight 8p + j (low nibble) and 8p + 4 + j (high nibble)
            raw = codes.view(n, nb, 4, TILE, 4)
            q = torch.stack((raw & 15, raw >> 4), dim=3).permute(0, 4, 1, 2, 3, 5).float()
        q = q.reshape(n, TILE, nb, 32)
        d = self.d[tiles].permute(0, 2, 1).float().unsqueeze(-1)
        c = self.c[tiles].permute(0, 2, 1).float().unsqueeze(-1)
        return (q * d + c).reshape(n, TILE, self.in_features)

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

    def _dense_weight(self) -> torch.Tensor:
        dtype = torch.bfloat16 if cpu_ops.fast_bf16() else torch.float32
        return torch.ops.localllm_cpu.gguf_dequantize(self.codes, self.d, self.c, self.block_type, dtype)

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        w = self._dense_weight()
        return torch.nn.functional.linear(x.to(w.dtype), w)

    def _integer(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.localllm_cpu.gguf_linear(x.float(), self.codes, self.d, self.c, self.block_type, ACT_LEVELS)

    def shard_state(self, rows: slice) -> dict[str, torch.Tensor]:
        return {"weight": self.dequantize()[rows].contiguous()}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, type={TYPE_NAMES[self.block_type]}"


# our fused module -> the HF tensors it is made of, in shard order
_SHARDS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def plan_gguf_modules(model: nn.Module, block_types: dict[str, int], tied: bool) -> tuple[set[str], list[str]]:
    """Swaps every linear of a meta-device model, lm_head included, for a GGUFLinear of the
    block type its GGUF tensors have. Returns the HF tensor names to load as raw blocks, and
    the modules that cannot keep the file's blocks (another block type, or fused shards of
    different types) and are requantized to Q8_0 instead."""
    raw: set[str] = set()
    requantized: list[str] = []
    for name, lin in list(iter_linears(model, skip=())):
        prefix, _, leaf = name.rpartition(".")
        if name == "lm_head":
            shards = ["lm_head.weight"]
            types = [block_types.get("model.embed_tokens.weight" if tied else "lm_head.weight")]
        else:
            shards = [f"{prefix}.{s}.weight" for s in _SHARDS.get(leaf, (leaf,))]
            types = [block_types.get(s) for s in shards]
        keep = len(set(types)) == 1 and types[0] in BLOCK_BYTES
        block_type = types[0] if keep else Q8_0
        if keep:
            raw.update(shards)
        else:
            requantized.append(f"{name} ({'/'.join(sorted({str(t) for t in types}))})")
        with torch.device("meta"):
            new = GGUFLinear(lin.in_features, lin.out_features, block_type, fused_sizes(lin), lin.bias is not None)
        replace_module(model, name, new)
    return raw, requantized


def measure_cpu_choice(block_types: dict[str, int]) -> str | None:
    """Whether the GGUF kernel runs this file's linears: the planner's reason line when it
    does, else None (the planner then takes its bf16 or fp32 rung). Decided by timing the
    kernel against bf16 and fp32 ``F.linear`` (``_time_options``) once per machine, torch and
    kernel source, and kept (``localllm.kernels.measured``): every start gives one plan.
    The kernel is the incumbent of a first measure (the file's own blocks, no second
    rounding, a third of bf16's memory): another option takes over only when clearly faster."""
    types = tuple(sorted({t for t in block_types.values() if t in BLOCK_BYTES}))
    if not types or not cpu_ops.has_gguf_kernels():
        return None
    m = measured.choose("gguf_linear_cpu", (f"act_levels={ACT_LEVELS}", "one thread"), _time_options, prefer="gguf")
    if m.winner != "gguf":
        return None
    us = {k: f"{v * 1e6:.0f}" for k, v in m.times.items()}
    names = "/".join(TYPE_NAMES[t] for t in types)
    return (f"gguf {names} blocks as the file stores them (no second rounding), on the int8-dot CPU kernel: "
            f"{us['gguf']} us per 576x1536 matvec on one core, bf16 {us['bf16']}, fp32 {us['fp32']}"
            f" ({m.provenance()})")


def _time_options() -> dict[str, float]:
    """Seconds per 576x1536 matvec of this CPU for the GGUF kernel (Q4_1), bf16 and fp32
    ``F.linear``: 8 distinct weights each, so they stream from memory as a model's do, in
    interleaved rounds (a burst of load elsewhere hits all three alike), best round each
    (~50 ms in all). On one thread: with two, every call ends in a barrier that waits for a
    time slice whenever anything else runs, and all three took ~12 ms instead of 40-300 us
    on a loaded 2-core machine (a coin toss between them); one thread times the kernels.
    The choice compares how each kernel uses a core, which a second core scales alike."""
    import time

    k, n, copies = 576, 1536, 8
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen) * 0.02
    x = torch.randn(1, k, generator=gen)
    packed = [torch.ops.localllm_cpu.gguf_repack(quantize_blocks(w, Q4_1), Q4_1, k) for _ in range(copies)]
    bf16 = [w.bfloat16().clone() for _ in range(copies)]
    fp32 = [w.clone() for _ in range(copies)]
    xb = x.bfloat16()
    options: dict[str, Callable[[int], torch.Tensor]] = {
        "gguf": lambda i: torch.ops.localllm_cpu.gguf_linear(x, *packed[i], Q4_1, ACT_LEVELS),
        "bf16": lambda i: torch.nn.functional.linear(xb, bf16[i]),
        "fp32": lambda i: torch.nn.functional.linear(x, fp32[i]),
    }
    best = dict.fromkeys(options, float("inf"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(5):
            for name, fn in options.items():
                t0 = time.perf_counter()
                for i in range(copies):
                    fn(i)
                best[name] = min(best[name], (time.perf_counter() - t0) / copies)
    finally:
        torch.set_num_threads(threads)
    return best
