"""Bytes, from architecture dims alone: weights per precision, KV per token, workspace.

Everything takes a "dims" object: anything with ``num_layers``, ``hidden_size``,
``num_heads``, ``num_kv_heads``, ``head_dim``, ``intermediate_size``, ``vocab_size`` and
``tie_word_embeddings`` (a catalog entry, or the engine's model config). The parameter
count is rebuilt from those dims rather than trusted from anywhere else, so the planner
and the catalog cannot drift apart silently (a test holds them within 2%).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
QUANTS: tuple[str, ...] = ("fp8", "int8", "awq", "gguf")
# "gguf" (CPU): a GGUF file's blocks as they are. Sized as Q4_1 block linears (20 bytes per
# 32 weights, the default model's) and a Q8_0 head (34 per 32) beside the float embedding
# the lookup reads; a file of other types is sized by that estimate.
GGUF_LINEAR_BYTES_PER_WEIGHT = 20 / 32
GGUF_HEAD_BYTES_PER_WEIGHT = 34 / 32
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

    @property
    def total(self) -> int:
        return self.block_linear + self.embedding + self.lm_head + self.norms


def _matrices(m: ModelDims) -> list[tuple[int, int]]:
    """(in_features, out_features) of each matmul in one decoder block."""
    h, i = m.hidden_size, m.intermediate_size
    q = m.num_heads * m.head_dim
    kv = m.num_kv_heads * m.head_dim
    return [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]


def awq_group_size(m: ModelDims) -> int:
    """128 where every input width allows it; SmolLM2's 576 needs 64 (576 = 4.5 x 128)."""
    widths = {inp for inp, _ in _matrices(m)}
    for g in (128, 64, 32):
        if all(w % g == 0 for w in widths):
            return g
    return 32


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
    return ParamCounts(
        block_linear=m.num_layers * per_layer,
        block_rows=m.num_layers * rows,
        awq_groups=m.num_layers * groups,
        awq_group_size=g,
        embedding=embedding,
        lm_head=0 if m.tie_word_embeddings else embedding,
        norms=norms,
    )


def count_params(m: ModelDims) -> int:
    return param_counts(m).total


def _check_dtype(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPE_BYTES)}") from None


def weight_bytes(m: ModelDims, weight_dtype: str = "bfloat16", quant: str | None = None) -> int:
    """Bytes of all weights. Quantization shrinks the block matmuls only: embeddings, the
    untied lm_head and the norms stay in ``weight_dtype`` (as AWQ and FP8 checkpoints do)."""
    b = _check_dtype(weight_dtype)
    c = param_counts(m)
    rest = (c.embedding + c.lm_head + c.norms) * b
    if quant is None:
        return c.block_linear * b + rest
    if quant in ("fp8", "int8"):
        return c.block_linear + c.block_rows * CHANNEL_SCALE_BYTES + rest
    if quant == "awq":
        return int(c.block_linear / 2 + c.awq_groups * (AWQ_SCALE_BYTES + AWQ_ZERO_BYTES)) + rest
    if quant == "gguf":
        head = c.lm_head or c.embedding  # the head runs on its own blocks, tied or not
        return int(c.block_linear * GGUF_LINEAR_BYTES_PER_WEIGHT + head * GGUF_HEAD_BYTES_PER_WEIGHT) + (
            c.embedding + c.norms) * b
    raise ValueError(f"unknown quantization {quant!r}; use one of {', '.join(QUANTS)}")


def decode_read_bytes(m: ModelDims, weight_dtype: str = "bfloat16", quant: str | None = None) -> int:
    """Weight bytes one decode step reads. An untied embedding table is only indexed (one row);
    a tied one is read in full as the lm_head."""
    total = weight_bytes(m, weight_dtype, quant)
    if quant == "gguf":  # the float embedding is only indexed; the head has its own blocks
        return total - (m.vocab_size - 1) * m.hidden_size * DTYPE_BYTES[weight_dtype]
    if m.tie_word_embeddings:
        return total
    b = DTYPE_BYTES[weight_dtype]
    return total - (m.vocab_size - 1) * m.hidden_size * b


def kv_bytes_per_token(m: ModelDims, kv_dtype: str = "bfloat16") -> int:
    """2 (K and V) x layers x KV heads x head dim x bytes of the KV dtype (a float dtype or
    "fp8"; the FP8 scales are two floats per layer, not per token)."""
    try:
        b = KV_DTYPE_BYTES[kv_dtype]
    except KeyError:
        raise ValueError(f"unknown KV dtype {kv_dtype!r}; use one of {', '.join(KV_DTYPE_BYTES)}") from None
    return 2 * m.num_layers * m.num_kv_heads * m.head_dim * b


def kv_bytes(m: ModelDims, tokens: int, kv_dtype: str = "bfloat16") -> int:
    return tokens * kv_bytes_per_token(m, kv_dtype)


def workspace_bytes(m: ModelDims, act_dtype: str, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """Peak activation memory of one forward step, which runs a block at a time.

    Per token alive at once: the residual stream, the normed input and the block output
    (3 x hidden), q, k and v, the attention output, and gate, up and their product
    (3 x intermediate). Logits are kept in fp32 for the sampled rows, twice (logits and
    the probabilities the sampler derives from them).
    """
    b = _check_dtype(act_dtype)
    q = m.num_heads * m.head_dim
    kv = m.num_kv_heads * m.head_dim
    per_token = 3 * m.hidden_size + 2 * q + 2 * kv + 3 * m.intermediate_size
    logits = 2 * max_num_seqs * m.vocab_size * 4
    return max_num_batched_tokens * per_token * b + logits
