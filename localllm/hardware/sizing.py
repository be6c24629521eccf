"""Bytes, from architecture dims alone: weights per precision, KV per token, workspace.

Everything takes a "dims" object: anything with ``num_layers``, ``hidden_size``,
``num_heads``, ``num_kv_heads``, ``head_dim``, ``intermediate_size``, ``vocab_size`` and
``tie_word_embeddings`` (a catalog entry, or the engine's model config). The parameter
count is rebuilt from those dims rather than trusted from anywhere else, so the planner
and the catalog cannot drift apart silently (a test holds them within 2%).
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Iterable
from typing import Protocol

from localllm.errors import LocalLLMError
from localllm.models.config import ModelConfig
from localllm.quant import gguf_formats
from localllm.quant.groups import GROUP_SIZES, pick_group_size

DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
QUANTS: tuple[str, ...] = ("fp8", "int8", "awq", "gguf")
# "gguf": a GGUF file's blocks as they are, the embedding lookup reading blocks too (the tied
# head's or its own). Sized from the file's tensors when the planner is given them
# (GGUFWeights: each tensor's stored bytes, a type without a CPU kernel at its fallback's),
# else as Q4_1 block linears (the default model's) and a Q8_0 embedding/head.
GGUF_LINEAR_BYTES_PER_WEIGHT = gguf_formats.fmt("Q4_1").bits_per_weight / 8
GGUF_HEAD_BYTES_PER_WEIGHT = gguf_formats.fmt("Q8_0").bits_per_weight / 8
# KV cache storage: the float dtypes, or FP8 e4m3 with per-tensor scales ("fp8").
KV_DTYPE_BYTES: dict[str, int] = {**DTYPE_BYTES, "fp8": 1}
# What --kv-cache-dtype accepts (vLLM's names): auto = the planner's choice.
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "fp8", "fp8_e4m3")


def kv_cache_dtype_name(value: str | None) -> str:
    """A --kv-cache-dtype value as the planner names it: "auto" or "fp8" (e4m3, vLLM's
    meaning of plain "fp8"). Raises ValueError naming the choices."""
    name = (value or "auto").lower()
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown KV cache dtype {value!r}; use one of {', '.join(KV_CACHE_DTYPES)}")
    return "fp8" if name.startswith("fp8") else name

# Per-output-channel scale of int8/fp8 weights (fp32), and the AWQ group layout:
# int4 weights, one fp16 scale and one packed int4 zero per group of input columns.
CHANNEL_SCALE_BYTES = 4
AWQ_SCALE_BYTES = 2.0
AWQ_ZERO_BYTES = 0.5


class ModelDims(Protocol):
    # Read-only properties, so frozen dataclasses (the catalog) satisfy it as well as plain classes.
    @property
    def num_layers(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def tie_word_embeddings(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class ParamCounts:
    block_linear: int  # every matmul weight inside the decoder blocks (what quantization shrinks)
    block_rows: int  # their output rows: one int8/fp8 scale each
    awq_groups: int  # (row, input-column group) pairs: one AWQ scale + zero each
    awq_group_size: int
    embedding: int
    lm_head: int  # 0 when tied to the embedding
    norms: int
    # Mixture of experts: the routers and every expert (with biases), which no quantization
    # method here shrinks, and of them what one token skips (the E - k experts it is not routed to)
    experts: int = 0
    inactive_experts: int = 0

    @property
    def total(self) -> int:
        return self.block_linear + self.embedding + self.lm_head + self.norms + self.experts


def expert_dims(m: ModelDims) -> tuple[int, int, int]:
    """(experts, experts per token, expert width) of a mixture-of-experts model; (0, 0, 0)
    for a dense one (dims objects without the fields are dense)."""
    return (getattr(m, "num_experts", 0) or 0, getattr(m, "num_experts_per_tok", 0) or 0,
            getattr(m, "moe_intermediate_size", 0) or 0)


def _matrices(m: ModelDims) -> list[tuple[int, int]]:
    """(in_features, out_features) of each matmul in one decoder block."""
    h, i = m.hidden_size, m.intermediate_size
    q = m.num_heads * m.head_dim
    kv = m.num_kv_heads * m.head_dim
    if expert_dims(m)[0]:  # the MLP is the experts, counted apart (ParamCounts.experts)
        return [(h, q), (h, kv), (h, kv), (q, h)]
    return [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]


def linear_input_dims(m: ModelDims) -> dict[str, int]:
    """The input width of each kind of decoder matmul, named as the quantizer's errors name them."""
    return {"qkv_proj/gate_up_proj": m.hidden_size, "o_proj": m.num_heads * m.head_dim,
            "down_proj": m.intermediate_size}


def awq_group_size(m: ModelDims) -> int:
    """The quantizer's choice: 128 where every input width allows it; SmolLM2's 576 needs 64
    (576 = 4.5 x 128). Where none fits, the smallest, for sizing only: quantizing such a model
    to int4 fails with the quantizer's message."""
    try:
        return pick_group_size(linear_input_dims(m), None)
    except LocalLLMError:
        return GROUP_SIZES[-1]


def param_counts(m: ModelDims) -> ParamCounts:
    g = awq_group_size(m)
    mats = _matrices(m)
    per_layer = sum(i * o for i, o in mats)
    rows = sum(o for _, o in mats)
    groups = sum(-(-i // g) * o for i, o in mats)
    embedding = m.vocab_size * m.hidden_size
    # Two RMSNorms per block and a final one; biases and Qwen3's q/k norms are a rounding
    # error (under 0.01%) and are left out.
    norms = m.num_layers * 2 * m.hidden_size + m.hidden_size
    experts, k, width = expert_dims(m)
    expert = 3 * m.hidden_size * width  # gate, up, down (gpt-oss's biases are under 0.1%)
    return ParamCounts(
        block_linear=m.num_layers * per_layer,
        block_rows=m.num_layers * rows,
        awq_groups=m.num_layers * groups,
        awq_group_size=g,
        embedding=embedding,
        lm_head=0 if m.tie_word_embeddings else embedding,
        norms=norms,
        experts=m.num_layers * experts * (expert + m.hidden_size),  # + the router's row per expert
        inactive_experts=m.num_layers * (experts - k) * expert,
    )


def count_params(m: ModelDims) -> int:
    return param_counts(m).total


def _check_dtype(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPE_BYTES)}") from None


def weight_bytes(m: ModelDims, weight_dtype: str = "bfloat16", quant: str | None = None,
                 gguf: GGUFWeights | None = None) -> int:
    """Bytes of all weights. Quantization shrinks the block matmuls only: embeddings, the
    untied lm_head and the norms stay in ``weight_dtype`` (as AWQ and FP8 checkpoints do).
    ``gguf``: the file's own tensors, for quant "gguf" (without it, the Q4_1 estimate)."""
    b = _check_dtype(weight_dtype)
    if quant == "gguf" and gguf is not None:
        return gguf.memory_bytes(m, b)
    c = param_counts(m)
    rest = (c.embedding + c.lm_head + c.norms + c.experts) * b
    if quant is None:
        return c.block_linear * b + rest
    if quant in ("fp8", "int8"):
        return c.block_linear + c.block_rows * CHANNEL_SCALE_BYTES + rest
    if quant == "awq":
        return int(c.block_linear / 2 + c.awq_groups * (AWQ_SCALE_BYTES + AWQ_ZERO_BYTES)) + rest
    if quant == "gguf":  # blocks for the linears, the experts, the head and the embedding (one table when tied)
        return int((c.block_linear + c.experts) * GGUF_LINEAR_BYTES_PER_WEIGHT
                   + (c.embedding + c.lm_head) * GGUF_HEAD_BYTES_PER_WEIGHT) + c.norms * b
    raise ValueError(f"unknown quantization {quant!r}; use one of {', '.join(QUANTS)}")


def decode_read_bytes(m: ModelDims, weight_dtype: str = "bfloat16", quant: str | None = None,
                      gguf: GGUFWeights | None = None) -> int:
    """Weight bytes one decode step reads. An untied embedding table is only indexed (one row);
    a tied one is read in full as the lm_head."""
    total = weight_bytes(m, weight_dtype, quant, gguf) - _inactive_expert_bytes(m, weight_dtype, quant, gguf)
    if m.tie_word_embeddings:
        return total
    if quant == "gguf":  # an untied embedding's blocks are only indexed
        table = gguf.embedding_memory if gguf is not None else int(
            m.vocab_size * m.hidden_size * GGUF_HEAD_BYTES_PER_WEIGHT)
        return total - table
    b = DTYPE_BYTES[weight_dtype]
    return total - (m.vocab_size - 1) * m.hidden_size * b


def _inactive_expert_bytes(m: ModelDims, weight_dtype: str, quant: str | None, gguf: GGUFWeights | None) -> int:
    """The bytes of the experts one token is not routed to, which a decode step of one
    sequence does not read (a batch reads the union of its tokens' experts: more)."""
    experts, k, _ = expert_dims(m)
    if not experts:
        return 0
    if quant == "gguf" and gguf is not None:
        return gguf.expert_memory(DTYPE_BYTES[weight_dtype]) * (experts - k) // experts
    if quant == "gguf":  # the dims estimate: blocks as weight_bytes charges them
        return int(param_counts(m).inactive_experts * GGUF_LINEAR_BYTES_PER_WEIGHT)
    return param_counts(m).inactive_experts * DTYPE_BYTES[weight_dtype]


def kv_bytes_per_token(m: ModelDims, kv_dtype: str = "bfloat16") -> int:
    """2 (K and V) x KV heads x head dim x bytes of the KV dtype (a float dtype or "fp8"; the
    FP8 scales are two floats per layer, not per token), summed over the layers: each layer's
    own shape where the dims state them (a ModelConfig's ``kv_spec()``), else every layer alike.
    A windowed layer counts every token: the pool keeps the blocks outside its window."""
    try:
        b = KV_DTYPE_BYTES[kv_dtype]
    except KeyError:
        raise ValueError(f"unknown KV dtype {kv_dtype!r}; use one of {', '.join(KV_DTYPE_BYTES)}") from None
    if isinstance(m, ModelConfig):
        return int(sum(spec.bytes_per_token(b) for spec in m.kv_spec()))
    return 2 * m.num_layers * m.num_kv_heads * m.head_dim * b


def kv_bytes(m: ModelDims, tokens: int, kv_dtype: str = "bfloat16") -> int:
    return tokens * kv_bytes_per_token(m, kv_dtype)


def workspace_bytes(m: ModelDims, act_dtype: str, max_num_batched_tokens: int, max_num_seqs: int,
                    logit_copies: int = 2) -> int:
    """Peak activation memory of one forward step, which runs a block at a time.

    Per token alive at once: the residual stream, the normed input and the block output
    (3 x hidden), q, k and v, the attention output, and gate, up and their product
    (3 x intermediate). Logits are kept in fp32 for the sampled rows, ``logit_copies`` times:
    two where the sampler derives a probability tensor from them (torch, on the GPU), one on
    the CPU, whose C++ sampler reads the logits in place (a Gemma-size vocabulary made the
    second copy 12% of the plan there).
    """
    b = _check_dtype(act_dtype)
    q = m.num_heads * m.head_dim
    kv = m.num_kv_heads * m.head_dim
    per_token = 3 * m.hidden_size + 2 * q + 2 * kv + 3 * m.intermediate_size
    logits = logit_copies * max_num_seqs * m.vocab_size * 4
    return max_num_batched_tokens * per_token * b + logits


def engine_matrices(m: ModelDims) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each decoder matmul as the engine builds it: q/k/v fused
    in ``qkv_proj`` and gate/up in ``gate_up_proj`` (models/llama.py)."""
    h, i = m.hidden_size, m.intermediate_size
    q = m.num_heads * m.head_dim
    kv = m.num_kv_heads * m.head_dim
    return {"qkv_proj": (h, q + 2 * kv), "o_proj": (q, h), "gate_up_proj": (h, 2 * i), "down_proj": (i, h)}


def largest_matrix(m: ModelDims) -> tuple[str, int, int]:
    """The decoder matmul with the most weights: (name, in_features, out_features)."""
    name, (k, n) = max(engine_matrices(m).items(), key=lambda kv: kv[1][0] * kv[1][1])
    return name, k, n


# --- GGUF files: sized from their tensors -------------------------------------------------------

def gguf_type_bytes(type_name: str, weights: int) -> int:
    """Stored bytes of ``weights`` values of a ggml type ("Q4_K", "F32", ...), from the traits
    table (localllm.quant.gguf_formats). Raises ValueError for a type it lacks."""
    return gguf_formats.fmt(type_name).nbytes(weights)


@dataclass(frozen=True, slots=True)
class GGUFWeights:
    """A GGUF checkpoint's weights as stored: what a "gguf" plan keeps in memory.

    Invariant: ``tensor_bytes`` is the sum of every tensor's stored bytes (for a file, the sum
    over its tensor headers; the file is that plus its metadata). In memory every tensor keeps
    its blocks, ``token_embd`` serving the embedding lookup (and the head, when tied), except
    that a type the plan's kernels (``kernels``: the CPU's, or the GPU's Triton ones) do not take
    is held at ``gguf_formats.FALLBACK``'s size (``memory_bytes``).
    """

    tensor_bytes: int
    embedding_bytes: int  # token_embd as stored
    types: tuple[tuple[str, int], ...]  # (ggml type name, stored bytes), most bytes first
    source: str  # what it was sized from, for the plan's reason: the file, the catalog or the dims
    embedding_type: str = "Q8_0"
    # the stacked expert tensors (``*_exps``, by type: stored bytes): held as stored by the
    # CPU's kernels (quant/gguf_experts.py) and the GPU's (quant/gguf_experts_cuda.py), a type
    # they lack at FALLBACK's size, as a linear
    expert_types: tuple[tuple[str, int], ...] = ()
    # whose kernels hold the blocks (gguf_formats.KERNELS): "cpu", or "triton" on a GPU; a type
    # those kernels do not take is held at FALLBACK's size
    kernels: str = "cpu"

    def expert_weights(self) -> int:
        return sum(n // gguf_formats.fmt(t).block_bytes * gguf_formats.fmt(t).block_weights
                   for t, n in self.expert_types)

    @property
    def experts_as_stored(self) -> bool:
        """Whether the plan's kernels hold the experts' blocks (the CPU's GGUFExperts, the
        GPU's GGUFExpertsCUDA: both do)."""
        return self.kernels in ("cpu", "triton")

    def expert_memory(self, float_bytes: int) -> int:
        if self.experts_as_stored:
            return sum(self._in_memory(name, n) for name, n in self.expert_types)
        return self.expert_weights() * float_bytes

    @property
    def expert_label(self) -> str:
        """The experts' stored types and how they are held, for the plan's reason, e.g.
        "experts Q4_K 12.1 GB + Q6_K 3.2 GB as stored"; "" for a dense model."""
        if not self.expert_types:
            return ""
        kinds = " + ".join(f"{name} {n / 1e9:.2f} GB" for name, n in sorted(self.expert_types, key=lambda kv: -kv[1]))
        return f"experts {kinds} {'as stored' if self.experts_as_stored else 'dequantized to the float dtype'}"

    @property
    def label(self) -> str:
        """The types by share of the bytes, e.g. "Q4_K 78% + Q6_K 21% + F32 1%"."""
        total = max(1, self.tensor_bytes)
        return " + ".join(f"{name} {100 * n / total:.0f}%" for name, n in self.types if 100 * n / total >= 0.5)

    def _in_memory(self, type_name: str, stored: int) -> int:
        f = gguf_formats.fmt(type_name)
        if f.is_float or f.has_kernel(self.kernels):
            return stored
        weights = stored // f.block_bytes * f.block_weights
        return gguf_formats.fmt(gguf_formats.FALLBACK).nbytes(weights)

    @property
    def embedding_memory(self) -> int:
        return self._in_memory(self.embedding_type, self.embedding_bytes)

    def memory_bytes(self, m: ModelDims, float_bytes: int) -> int:
        """Every tensor's blocks, a type without a kernel (``kernels``') at its fallback's size, and the
        stacked experts as ``expert_memory`` holds them (``float_bytes`` each where dequantized).
        (Float tensors, the norms, stay as stored; ``m`` is unused since the embedding lookup
        reads blocks, and kept for the callers' one signature.)"""
        del m
        experts = sum(self._in_memory(name, n) for name, n in self.expert_types)
        return sum(self._in_memory(name, n) for name, n in self.types) - experts + self.expert_memory(float_bytes)


def gguf_weights_from_tensors(tensors: Iterable[tuple[str, str, int]], source: str) -> GGUFWeights:
    """``GGUFWeights`` from (GGUF tensor name, ggml type name, stored bytes) triples."""
    by_type: dict[str, int] = {}
    experts: dict[str, int] = {}
    embedding, embedding_type = 0, "Q8_0"
    for name, type_name, n in tensors:
        by_type[type_name] = by_type.get(type_name, 0) + n
        if "_exps.weight" in name:  # the stacked matrices (their biases are float, held as stored)
            experts[type_name] = experts.get(type_name, 0) + n
        if name == "token_embd.weight":
            embedding, embedding_type = n, type_name
    types = tuple(sorted(by_type.items(), key=lambda kv: -kv[1]))
    return GGUFWeights(sum(by_type.values()), embedding, types, source, embedding_type, tuple(experts.items()))


# Families whose experts every llama.cpp mix keeps in MXFP4, as published (gpt-oss)
MXFP4_EXPERTS = frozenset({"GptOssForCausalLM"})
# Families whose GGUF holds q, k and v as one ``attn_qkv`` matrix, which llama.cpp's Q4_K_M
# stores as Q5_K in every layer (there is no attn_v for the more-bits rule to pick): without it
# the Phi-3.5-mini estimate was 3% under the published 2.39 GB file
FUSED_QKV = frozenset({"Phi3ForCausalLM"})


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers and every third one
    between get the larger type in a _M mix."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def gguf_q4_k_m_weights(m: ModelDims) -> GGUFWeights:
    """What llama.cpp's Q4_K_M of this model holds, from its dims: Q4_K linears; attn_v and
    ffn_down Q6_K in the layers ``_more_bits`` picks; a fused attn_qkv (``FUSED_QKV``) Q5_K;
    the head Q6_K (the embedding, when tied); token_embd Q4_K; norms F32; 256-block types on rows of another length falling back as
    llama.cpp does; a family in ``MXFP4_EXPERTS`` with its experts in MXFP4 whatever the mix.
    A catalog entry's published file size (``gguf_sizes["Q4_K_M"]``) wins
    over this estimate (within 1% of it for Llama-3.1-8B, tests/test_catalog.py)."""
    by_type: dict[str, int] = {}

    def add(kind: str, rows: int, cols: int) -> tuple[int, str]:
        f = gguf_formats.fmt(kind)
        if cols % f.block_weights and f.row_fallback:  # llama.cpp's type for rows not whole blocks
            kind = f.row_fallback
        n = gguf_type_bytes(kind, rows * cols)
        by_type[kind] = by_type.get(kind, 0) + n
        return n, kind

    h, i = m.hidden_size, m.intermediate_size
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    experts, _, width = expert_dims(m)
    expert_types: dict[str, int] = {}
    fused_qkv = getattr(m, "architecture", "") in FUSED_QKV
    for layer in range(m.num_layers):
        more = _more_bits(layer, m.num_layers)
        if fused_qkv:
            add("Q5_K", q + 2 * kv, h)  # attn_qkv
        else:
            add("Q4_K", q, h)  # attn_q: q rows of h weights
            add("Q4_K", kv, h)  # attn_k
            add("Q6_K" if more else "Q4_K", kv, h)  # attn_v
        add("Q4_K", h, q)  # attn_output
        if experts:  # ffn_{gate,up,down}_exps: the same recipe over E stacked matrices; the router F32
            recipe = (("Q4_K", width, h), ("Q4_K", width, h), ("Q6_K" if more else "Q4_K", h, width))
            if getattr(m, "architecture", "") in MXFP4_EXPERTS:
                recipe = (("MXFP4", width, h), ("MXFP4", width, h), ("MXFP4", h, width))
            for kind, rows, cols in recipe:
                n, kind = add(kind, experts * rows, cols)
                expert_types[kind] = expert_types.get(kind, 0) + n
            by_type["F32"] = by_type.get("F32", 0) + experts * h * 4
            continue
        add("Q4_K", i, h)  # ffn_gate
        add("Q4_K", i, h)  # ffn_up
        add("Q6_K" if more else "Q4_K", h, i)  # ffn_down
    embedding, embedding_type = add("Q6_K" if m.tie_word_embeddings else "Q4_K", m.vocab_size, h)
    if not m.tie_word_embeddings:
        add("Q6_K", m.vocab_size, h)
    norms = (2 * m.num_layers + 1) * h * 4
    by_type["F32"] = by_type.get("F32", 0) + norms
    types = tuple(sorted(by_type.items(), key=lambda kv: -kv[1]))
    return GGUFWeights(sum(by_type.values()), embedding, types, "llama.cpp's Q4_K_M recipe applied to the dims",
                       embedding_type, tuple(expert_types.items()))


def gguf_catalog_weights(m: ModelDims, mix: str = "Q4_K_M") -> GGUFWeights:
    """A model's ``mix`` GGUF as the catalog knows it: its published file size where the entry
    has one (``gguf_sizes``), else the dims estimate (Q4_K_M only)."""
    estimate = gguf_q4_k_m_weights(m)
    sizes: dict[str, int] = getattr(m, "gguf_sizes", None) or {}
    published = sizes.get(mix)
    if published is None:
        if mix != "Q4_K_M":
            raise LocalLLMError(f"no {mix} size for this model in the catalog; only Q4_K_M can be estimated")
        return estimate
    # The published size includes the metadata (the tokenizer: a few MB), so it slightly
    # overstates the tensors: the safe side for a memory plan.
    scale = published / estimate.tensor_bytes
    scaled = [(name, int(n * scale)) for name, n in estimate.types]
    # what rounding each type down left over goes to the largest, so the types sum to the file
    scaled[0] = (scaled[0][0], scaled[0][1] + published - sum(n for _, n in scaled))
    types = tuple(scaled)
    experts = tuple((name, int(n * scale)) for name, n in estimate.expert_types)
    return GGUFWeights(published, int(estimate.embedding_bytes * scale), types, f"the published {mix} file size",
                       estimate.embedding_type, experts)
