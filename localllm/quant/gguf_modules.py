"""A GGUF file's tensors as a CPU plan's modules: each tensor kept in the block type the file
stores it in, whatever mix of types the file holds.

The decision is per tensor (``decide``): a type localllm's CPU kernels multiply (the traits
table's ``cpu_kernel``, localllm.quant.gguf_formats) streams in as the file's blocks; any other
type is dequantized and rounded again to ``FALLBACK`` (Q8_0), the one lossy step, named in the
plan's reason line. A fused module (``qkv_proj``, ``gate_up_proj``) whose shards end up in one
type is one ``GGUFLinear``; shards in different types (a Q4_K_M file's Q8_0 ``attn_v`` beside
Q5_0 ``attn_q``) become a ``GGUFShardedLinear``, one block linear per shard, rather than a
second rounding. The embedding lookup reads blocks too (``GGUFEmbedding``): the tied head's,
or its own ``token_embd`` blocks, so no float copy of the vocabulary table is made and a plan's
weights take about the file's size.

Invariant: after ``plan_gguf_modules`` every linear of the model, the head included, and the
embedding are block modules; the names in the returned ``raw`` set are exactly the HF tensors
that stream as ``GGUFBlocks`` (the rest arrive as float and are quantized to the module's type).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping

import torch
from torch import nn

from localllm.errors import LocalLLMError
from localllm.kernels import cpu_ops
from localllm.quant import gguf_formats as gf
from localllm.quant.gguf import TILE, GGUFBlocks, GGUFLinear
from localllm.quant.linear import fused_sizes, iter_linears, replace_module

# our fused module -> the HF tensors it is made of, in shard order
_SHARDS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
EMBEDDING = "model.embed_tokens.weight"
HEAD = "lm_head.weight"
_LINEAR = re.compile(r"(_proj\.weight|^lm_head\.weight)$")
# ids looked up per dequantize_rows call: each unpacks its 8-row tile, so a 512-token prompt
# chunk of an 8B model (hidden 4096) would otherwise make a 64 MB temporary at once
_LOOKUP_CHUNK = 64


def kept(type_id: int | None) -> bool:
    """Whether a tensor of this type stays as the file stores it on a CPU plan."""
    return type_id is not None and type_id in gf.BY_ID and gf.BY_ID[type_id].cpu_kernel


def decide(type_id: int | None) -> int:
    """The block type a linear's tensor of ``type_id`` has in memory."""
    return int(type_id) if type_id is not None and kept(type_id) else gf.fmt(gf.FALLBACK).type_id


def linear_tensor_types(block_types: Mapping[str, int], tied: bool) -> dict[str, int]:
    """The matrices a CPU plan multiplies, HF name -> stored type: every ``*_proj`` and the
    head (token_embd's blocks when the head is tied to it)."""
    out = {n: t for n, t in block_types.items() if _LINEAR.search(n)}
    head = block_types.get(EMBEDDING if tied else HEAD)
    if head is not None:
        out[HEAD] = head
    return out


def has_kept_linears(block_types: Mapping[str, int], tied: bool) -> bool:
    """Whether any linear of this file runs as stored on the CPU kernels (they are built here)."""
    return cpu_ops.has_gguf_kernels() and any(kept(t) for t in linear_tensor_types(block_types, tied).values())


def reason_line(block_types: Mapping[str, int], tied: bool) -> str:
    """The plan's one line for a GGUF file on the CPU: each stored type with its tensor count
    and what runs it, a type without a kernel named with what happens to it."""
    counts = Counter(linear_tensor_types(block_types, tied).values())
    order = sorted(counts, key=lambda t: (-counts[t], t))
    on_kernel = [f"{gf.type_name(t)} x{counts[t]}" for t in order if kept(t)]
    others = [f"{gf.type_name(t)} x{counts[t]}" for t in order if not kept(t)]
    head = gf.type_name(block_types.get(EMBEDDING if tied else HEAD, -1))
    parts = []
    if on_kernel:
        parts.append(f"gguf blocks as stored (int8-dot CPU kernels, no second rounding): {', '.join(on_kernel)}")
    if others:
        parts.append(f"no CPU kernel, rounded again to {gf.FALLBACK}: {', '.join(others)}")
    embed = block_types.get(EMBEDDING)
    lookup = "the head's" if tied else f"its own {gf.type_name(decide(embed))}" if embed is not None else "no"
    parts.append(f"head {head}, embedding lookups from {lookup} blocks")
    return "; ".join(parts)


def precision_label(block_types: Mapping[str, int], tied: bool) -> str:
    """What the status bar shows: ``gguf-`` and the in-memory types, e.g. ``gguf-q4_k/q5_0/q8_0``."""
    kinds = sorted({gf.type_name(decide(t)) for t in linear_tensor_types(block_types, tied).values()})
    return "gguf-" + "/".join(kinds).lower()


class GGUFShardedLinear(nn.Module):
    """A fused linear whose shards live in different block types: one ``GGUFLinear`` per shard
    (``parts[i]`` holds shard i's rows), outputs concatenated in shard order, so the model's
    fused ``qkv_proj``/``gate_up_proj`` call is unchanged."""

    def __init__(self, in_features: int, output_sizes: list[int], types: list[int], bias: bool) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = sum(output_sizes)
        self.output_sizes = list(output_sizes)
        self.parts = nn.ModuleList(GGUFLinear(in_features, n, t, None, bias) for n, t in zip(output_sizes, types))

    def load_weight(self, name: str, tensor: torch.Tensor | GGUFBlocks, shard: int | None) -> None:
        if shard is None or not 0 <= shard < len(self.parts):
            raise LocalLLMError(f"tensor {name!r} arrived for a fused GGUF linear without a valid shard index")
        self.parts[shard].load_weight(name, tensor, None)

    def expected_weight_names(self) -> list[str]:
        return [f"{n}#{i}" for i, p in enumerate(self.parts) for n in p.expected_weight_names()]

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.output_sizes}"


class GGUFEmbedding(nn.Module):
    """Token embeddings looked up in GGUF blocks: the rows of ``table`` (a ``GGUFLinear`` of
    ``[vocab, hidden]``) dequantized per lookup, exactly as the head's reference rows are.

    ``table`` is the tied head (not registered here: it stays ``lm_head`` in the module tree)
    or, for a model with its own head, this module's ``own`` table of token_embd's blocks.
    ``weight`` is an empty float Parameter: what the model reads for its float dtype and device.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, head: GGUFLinear | None, block_type: int) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = nn.Parameter(torch.empty(0), requires_grad=False)
        self.own = GGUFLinear(embedding_dim, num_embeddings, block_type) if head is None else None
        # in a tuple, so nn.Module does not register it: a second owner would rename lm_head
        self._head: tuple[GGUFLinear, ...] = (head,) if head is not None else ()

    @property
    def table(self) -> GGUFLinear:
        return self.own if self.own is not None else self._head[0]

    def load_weight(self, name: str, tensor: torch.Tensor | GGUFBlocks, shard: int | None) -> None:
        if self.own is not None:
            self.own.load_weight(name, tensor, shard)
        # tied: the head gets token_embd's blocks as lm_head.weight; this copy is not needed

    def expected_weight_names(self) -> list[str]:
        return self.own.expected_weight_names() if self.own is not None else []

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1)
        # a compiled decode step sees a few ids and must not branch on their count (its size is
        # dynamic); eager prompt chunks are split so a long one makes no large temporary
        if torch.compiler.is_compiling() or ids.numel() <= _LOOKUP_CHUNK:
            out = self.table.dequantize_rows(ids)
        else:
            out = torch.cat([self.table.dequantize_rows(ids[i : i + _LOOKUP_CHUNK])
                             for i in range(0, ids.numel(), _LOOKUP_CHUNK)])
        return out.view(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        kind = "own" if self.own is not None else "the head's"
        return f"{self.num_embeddings}, {self.embedding_dim}, {kind} {gf.type_name(self.table.block_type)} blocks"


def plan_gguf_modules(model: nn.Module, block_types: Mapping[str, int], tied: bool) -> set[str]:
    """Swaps every linear of a meta-device model, lm_head included, and the embedding for block
    modules as ``decide`` types them. Returns the HF tensor names to load as raw blocks."""
    raw: set[str] = set()
    head: GGUFLinear | None = None
    for name, lin in list(iter_linears(model, skip=())):
        prefix, _, leaf = name.rpartition(".")
        if name == "lm_head":
            shards = [HEAD]
            stored = [block_types.get(EMBEDDING if tied else HEAD)]
        else:
            shards = [f"{prefix}.{s}.weight" for s in _SHARDS.get(leaf, (leaf,))]
            stored = [block_types.get(s) for s in shards]
        types = [decide(t) for t in stored]
        raw.update(s for s, t in zip(shards, stored) if kept(t))
        sizes = fused_sizes(lin)
        bias = lin.bias is not None
        with torch.device("meta"):
            if len(set(types)) == 1:
                new: nn.Module = GGUFLinear(lin.in_features, lin.out_features, types[0], sizes, bias)
            else:
                new = GGUFShardedLinear(lin.in_features, sizes or [lin.out_features], types, bias)
        replace_module(model, name, new)
        if name == "lm_head":
            assert isinstance(new, GGUFLinear)
            head = new
    embed = model.get_submodule("model.embed_tokens")
    stored_embed = block_types.get(EMBEDDING)
    if not tied and embed.num_embeddings % TILE:
        return raw  # block linears tile rows by 8: this vocabulary keeps a float lookup table
    with torch.device("meta"):
        lookup = GGUFEmbedding(embed.num_embeddings, embed.embedding_dim, head if tied else None, decide(stored_embed))
    replace_module(model, "model.embed_tokens", lookup)
    if tied or kept(stored_embed):
        raw.add(EMBEDDING)  # tied: dropped on arrival, so a byte copy rather than a float dequantization
    return raw
