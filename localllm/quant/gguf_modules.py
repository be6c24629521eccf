"""A GGUF file's tensors as a plan's modules: each tensor kept in the block type the file
stores it in, whatever mix of types the file holds, on the CPU's kernels (``CPU``) or the
GPU's Triton ones (localllm.quant.gguf_cuda's ``TRITON``): ``BlockKernels`` names them.

The decision is per tensor (``decide``): a type the plan's kernels multiply (the traits
table's ``has_kernel``, localllm.quant.gguf_formats) streams in as the file's blocks; any other
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
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from localllm.errors import LocalLLMError
from localllm.kernels import cpu_ops
from localllm.quant import gguf_formats as gf
from localllm.models.moe import MoE
from localllm.quant.gguf import HEAD_ACT_LEVELS, TILE, GGUFBlocks, GGUFLinear
from localllm.quant.gguf_experts import GGUFExperts
from localllm.quant.linear import QuantLinear, fused_sizes, iter_linears, replace_module

# our fused module -> the HF tensors it is made of, in shard order
_SHARDS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
EMBEDDING = "model.embed_tokens.weight"
HEAD = "lm_head.weight"
_LINEAR = re.compile(r"(_proj\.weight|^lm_head\.weight)$")
# ids looked up per dequantize_rows call: each unpacks its 8-row tile, so a 512-token prompt
# chunk of an 8B model (hidden 4096) would otherwise make a 64 MB temporary at once
_LOOKUP_CHUNK = 64


@dataclass(frozen=True, slots=True)
class BlockKernels:
    """The kernels that multiply GGUF blocks on one kind of device, and the module that holds
    one tensor's blocks for them: ``CPU`` here (localllm's C++ kernels, ``GGUFLinear``), the
    GPU's Triton kernels in localllm.quant.gguf_cuda. Which types they take is the traits
    table's (``GGUFFormat.has_kernel(name)``); ``FALLBACK`` must be one of them.

    ``linear(in_features, out_features, block_type, output_sizes, bias)`` is a QuantLinear
    with ``block_type``, ``dequantize()`` and ``dequantize_rows(rows)``."""

    name: str  # gguf_formats.KERNELS: "cpu" or "triton"
    short: str  # in the reason line: "no CPU kernel"
    what: str  # in the reason line: "gguf blocks as stored (int8-dot CPU kernels, ...)"
    linear: Callable[..., QuantLinear]
    available: Callable[[], bool]
    row_multiple: int  # a block linear's out_features is a multiple of this (the CPU's row tiles)
    # a MoE layer's stacked experts in blocks: (experts, hidden, intermediate, gate, up, down types)
    experts: Callable[..., nn.Module]


CPU = BlockKernels("cpu", "CPU", "int8-dot CPU kernels", GGUFLinear, cpu_ops.has_gguf_kernels, TILE, GGUFExperts)


def kept(type_id: int | None, kernels: BlockKernels = CPU) -> bool:
    """Whether a tensor of this type stays as the file stores it on a plan run by ``kernels``."""
    return type_id is not None and type_id in gf.BY_ID and gf.BY_ID[type_id].has_kernel(kernels.name)


def decide(type_id: int | None, kernels: BlockKernels = CPU) -> int:
    """The block type a linear's tensor of ``type_id`` has in memory."""
    return int(type_id) if type_id is not None and kept(type_id, kernels) else gf.fmt(gf.FALLBACK).type_id


def linear_tensor_types(block_types: Mapping[str, int], tied: bool) -> dict[str, int]:
    """The matrices a CPU plan multiplies, HF name -> stored type: every ``*_proj`` and the
    head (token_embd's blocks when the head is tied to it)."""
    out = {n: t for n, t in block_types.items() if _LINEAR.search(n)}
    head = block_types.get(EMBEDDING if tied else HEAD)
    if head is not None:
        out[HEAD] = head
    return out


def expert_tensor_types(block_types: Mapping[str, int], kernels: BlockKernels = CPU) -> dict[str, int]:
    """A mixture of experts' stacked expert matrices (``*_exps.weight``, HF name -> stored
    type), which ``kernels`` hold as blocks (the CPU's ``GGUFExperts``, the GPU's
    ``GGUFExpertsCUDA``)."""
    return {n: t for n, t in block_types.items() if n.endswith("_exps.weight")}


def has_kept_linears(block_types: Mapping[str, int], tied: bool, kernels: BlockKernels = CPU) -> bool:
    """Whether any linear (or stacked experts) of this file runs as stored on ``kernels`` (and
    they run here)."""
    types = [*linear_tensor_types(block_types, tied).values(), *expert_tensor_types(block_types, kernels).values()]
    return kernels.available() and any(kept(t, kernels) for t in types)


def reason_line(block_types: Mapping[str, int], tied: bool, kernels: BlockKernels = CPU, isa: str | None = None) -> str:
    """The plan's one line for a GGUF file run by ``kernels``: each stored type with its tensor
    count and what runs it, a type without a kernel named with what happens to it. ``isa``:
    which of the CPU's kernels run (cpu_ops.gguf_kernels: "x86 AVX2", "generic", ...), where known."""
    counts = Counter(linear_tensor_types(block_types, tied).values())
    order = sorted(counts, key=lambda t: (-counts[t], t))
    on_kernel = [f"{gf.type_name(t)} x{counts[t]}" for t in order if kept(t, kernels)]
    others = [f"{gf.type_name(t)} x{counts[t]}" for t in order if not kept(t, kernels)]
    head = gf.type_name(block_types.get(EMBEDDING if tied else HEAD, -1))
    parts = []
    if on_kernel:
        what = f"{kernels.what}: {isa}" if isa else kernels.what
        parts.append(f"gguf blocks as stored ({what}, no second rounding): {', '.join(on_kernel)}")
    if others:
        parts.append(f"no {kernels.short} kernel, rounded again to {gf.FALLBACK}: {', '.join(others)}")
    experts = Counter(expert_tensor_types(block_types, kernels).values())
    if experts:
        kinds = ", ".join(f"{gf.type_name(t)} x{experts[t]}" if kept(t, kernels) else
                          f"{gf.type_name(t)} x{experts[t]} rounded again to {gf.FALLBACK}"
                          for t in sorted(experts, key=lambda t: (-experts[t], t)))
        parts.append(f"stacked experts as stored, each routed expert's rows on the same kernels: {kinds}")
    embed = block_types.get(EMBEDDING)
    lookup = "the head's" if tied else f"its own {gf.type_name(decide(embed, kernels))}" if embed is not None else "no"
    parts.append(f"head {head}, embedding lookups from {lookup} blocks")
    return "; ".join(parts)


def precision_label(block_types: Mapping[str, int], tied: bool, kernels: BlockKernels = CPU) -> str:
    """What the status bar shows: ``gguf-`` and the in-memory types, e.g. ``gguf-q4_k/q5_0/q8_0``."""
    types = [*linear_tensor_types(block_types, tied).values(), *expert_tensor_types(block_types, kernels).values()]
    kinds = sorted({gf.type_name(decide(t, kernels)) for t in types})
    return "gguf-" + "/".join(kinds).lower()


class GGUFShardedLinear(nn.Module):
    """A fused linear whose shards live in different block types: one ``GGUFLinear`` per shard
    (``parts[i]`` holds shard i's rows), outputs concatenated in shard order, so the model's
    fused ``qkv_proj``/``gate_up_proj`` call is unchanged."""

    def __init__(self, in_features: int, output_sizes: list[int], types: list[int], bias: bool,
                 linear: Callable[..., QuantLinear] = GGUFLinear) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = sum(output_sizes)
        self.output_sizes = list(output_sizes)
        self.parts = nn.ModuleList(linear(in_features, n, t, None, bias) for n, t in zip(output_sizes, types))

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
    or, for a model with its own head, this module's ``own`` table of token_embd's blocks (a
    ``linear``: the block linear of the plan's kernels).
    ``weight`` is an empty float Parameter: what the model reads for its float dtype and device.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, head: QuantLinear | None, block_type: int,
                 linear: Callable[..., QuantLinear] = GGUFLinear) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = nn.Parameter(torch.empty(0), requires_grad=False)
        self.own = linear(embedding_dim, num_embeddings, block_type) if head is None else None
        # in a tuple, so nn.Module does not register it: a second owner would rename lm_head
        self._head: tuple[QuantLinear, ...] = (head,) if head is not None else ()

    @property
    def table(self) -> QuantLinear:
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


def plan_gguf_modules(model: nn.Module, block_types: Mapping[str, int], tied: bool,
                      kernels: BlockKernels = CPU) -> set[str]:
    """Swaps every linear of a meta-device model, lm_head included, and the embedding for
    ``kernels``' block modules as ``decide`` types them. Returns the HF tensor names to load as
    raw blocks."""
    raw: set[str] = set()
    head: QuantLinear | None = None
    for name, lin in list(iter_linears(model, skip=())):
        prefix, _, leaf = name.rpartition(".")
        if name == "lm_head":
            shards = [HEAD]
            stored = [block_types.get(EMBEDDING if tied else HEAD)]
        else:
            shards = [f"{prefix}.{s}.weight" for s in _SHARDS.get(leaf, (leaf,))]
            stored = [block_types.get(s) for s in shards]
        types = [decide(t, kernels) for t in stored]
        raw.update(s for s, t in zip(shards, stored) if kept(t, kernels))
        sizes = fused_sizes(lin)
        bias = lin.bias is not None
        with torch.device("meta"):
            if len(set(types)) == 1:
                new: nn.Module = kernels.linear(lin.in_features, lin.out_features, types[0], sizes, bias)
            else:
                new = GGUFShardedLinear(lin.in_features, sizes or [lin.out_features], types, bias, kernels.linear)
        replace_module(model, name, new)
        if name == "lm_head":
            assert isinstance(new, QuantLinear)
            head = new
            if isinstance(new, GGUFLinear):
                new.act_levels = HEAD_ACT_LEVELS
    raw.update(plan_gguf_experts(model, block_types, kernels))
    embed = model.get_submodule("model.embed_tokens")
    stored_embed = block_types.get(EMBEDDING)
    if not tied and embed.num_embeddings % kernels.row_multiple:
        return raw  # the CPU's block linears tile rows by 8: this vocabulary keeps a float lookup table
    with torch.device("meta"):
        lookup = GGUFEmbedding(embed.num_embeddings, embed.embedding_dim, head if tied else None,
                               decide(stored_embed, kernels), kernels.linear)
    replace_module(model, "model.embed_tokens", lookup)
    if tied or kept(stored_embed, kernels):
        raw.add(EMBEDDING)  # tied: dropped on arrival, so a byte copy rather than a float dequantization
    return raw


def plan_gguf_experts(model: nn.Module, block_types: Mapping[str, int], kernels: BlockKernels = CPU) -> set[str]:
    """Gives every ``MoE`` of a meta-device model ``kernels``' experts module in the types
    ``decide`` gives its stacked tensors and drops its float ``w13``/``w2``. Returns the HF
    tensor names to load as raw blocks (those of a kernel type; the rest arrive dequantized and
    are rounded to ``FALLBACK``)."""
    raw: set[str] = set()
    for name, moe in list(model.named_modules()):
        if not isinstance(moe, MoE):
            continue
        tensors = [f"{name}.experts.{p}_exps.weight" for p in ("gate", "up", "down")]
        stored = [block_types.get(t) for t in tensors]
        E, I2, H = moe.w13.shape
        with torch.device("meta"):
            moe.experts = kernels.experts(E, H, I2 // 2, *(decide(t, kernels) for t in stored))
        moe.w13 = None
        moe.w2 = None
        raw.update(t for t, s in zip(tensors, stored) if kept(s, kernels))
    return raw
