"""The pieces the model families share: rotary tables, RMSNorm (Gemma's ``offset + w`` form
too), attention over the paged KV pool with a per-layer window, scale, QK-norm and RoPE
table, the gated MLP with its activation, the decoder block (two norms, or Gemma's four) and
``CausalLM``, the decoder every family file builds on.

Parameters keep HF names except two fusions: q/k/v live in ``qkv_proj`` and gate/up in
``gate_up_proj`` (output dims concatenated in that order), which halves the matmul launches
per layer. ``CausalLM.load_weights`` maps HF tensors onto those shards.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence as Seq
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from localllm.errors import LocalLLMError
from localllm.kernels import cpu_ops, paged_attention, rms_norm, rotary, rotary_and_store_kv, silu_and_mul
from localllm.kernels._triton import FP8_DTYPES as FP8_KV_DTYPES, use_triton
from localllm.models.config import ROPE_TYPES, ModelConfig
from localllm.models.kv_spec import LayerKVSpec
from localllm.models.moe import MoE


def rope_cos_sin(cfg: ModelConfig, max_positions: int, local: bool = False) -> torch.Tensor:
    """[max_positions, rotary_dim] fp32: cos over the first half, sin over the second; ``local``:
    the table of the sliding layers where they rotate by their own base (Gemma 3). A table
    narrower than the head (partial rotary, Phi-4-mini) rotates the head's first rotary_dim
    dims and passes the rest: every rotary path reads the width from the table."""
    dim = cfg.rotary_dim
    theta = cfg.local_rope_theta if local and cfg.local_rope_theta is not None else cfg.rope_theta
    scaling = (cfg.local_rope_scaling if local else cfg.rope_scaling) or {}
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    kind = scaling.get("rope_type", scaling.get("type"))
    attention_factor = 1.0
    if kind == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling.get("original_max_position_embeddings", cfg.max_position_embeddings)
        wavelen = 2 * math.pi / inv_freq
        smooth = ((old_ctx / wavelen) - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(
            wavelen > old_ctx / low, inv_freq / factor, torch.where(wavelen < old_ctx / high, inv_freq, blended)
        )
    elif kind == "freq_factors":  # GGUF's precomputed form of the same scaling
        inv_freq = inv_freq / torch.tensor(scaling["factors"], dtype=torch.float64)
    elif kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "yarn":
        inv_freq, attention_factor = _yarn(inv_freq, scaling, theta, dim)
    elif kind == "longrope":
        return _longrope(inv_freq, scaling, max_positions)
    elif kind not in (None, "default"):
        raise LocalLLMError(f"rope_scaling type {kind!r} is not supported ({', '.join(ROPE_TYPES)})")
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
    return (torch.cat((angles.cos(), angles.sin()), dim=-1) * attention_factor).float()


def _yarn(inv_freq: torch.Tensor, scaling: dict[str, Any], theta: float, dim: int) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071) as transformers 5 computes it: frequencies that rotate fewer
    than beta_slow times over the pretraining length are interpolated (divided by factor),
    those above beta_fast kept, a linear ramp between; cos and sin are scaled by the
    attention factor, 0.1 ln(factor) + 1 unless given."""
    factor = scaling["factor"]
    orig = scaling["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp
    return inv_freq / factor * (1 - extrapolated) + inv_freq * extrapolated, float(attention_factor)


def _longrope(inv_freq: torch.Tensor, scaling: dict[str, Any], max_positions: int) -> torch.Tensor:
    """LongRoPE (Phi-3): frequencies divided by ``short_factor`` at positions inside the
    pretraining length and by ``long_factor`` beyond it (per position, as vLLM does, so a
    cached key never changes; transformers switches a whole forward to the long factors once
    the sequence passes that length), cos and sin scaled by sqrt(1 + ln(s) / ln(orig)), s the
    ratio of the two lengths."""
    orig = scaling["original_max_position_embeddings"]
    short, long = (torch.tensor(scaling[k], dtype=torch.float64) for k in ("short_factor", "long_factor"))
    if short.shape != inv_freq.shape or long.shape != inv_freq.shape:
        raise LocalLLMError(f"longrope factors must have rotary dims / 2 = {inv_freq.numel()} entries")
    factor = scaling.get("factor") or scaling["max_position_embeddings"] / orig
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(orig))
    pos = torch.arange(max_positions, dtype=torch.float64)
    angles = torch.where((pos < orig)[:, None], torch.outer(pos, inv_freq / short), torch.outer(pos, inv_freq / long))
    return (torch.cat((angles.cos(), angles.sin()), dim=-1) * attention_factor).float()


@dataclass(slots=True)
class AttentionMetadata:
    """The flat varlen batch, as every attention layer sees it. Decode sequences come first."""

    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32, context length after this step
    block_tables: torch.Tensor  # [B, max_blocks] int32
    num_decodes: int


def kv_scale_tensor(
    scales: Seq[tuple[float, float]] | None, num_layers: int, device: torch.device
) -> torch.Tensor:
    """The FP8 KV scales as ``Attention.k_scale``/``v_scale`` read them (see quant/kv_cache.py):
    [2, layers, 1] fp32, row 0 the k_scales, row 1 the v_scales; 1.0 where ``scales`` is None.
    Whoever owns a KV pool gives each layer 1-element views, which the kernels read on the
    device (graph-safe)."""
    t = torch.ones(2, num_layers, 1, dtype=torch.float32, device=device)
    if scales is not None:
        assert len(scales) == num_layers, "one (k_scale, v_scale) per layer"
        t.copy_(torch.tensor(scales, dtype=torch.float32).t().unsqueeze(-1))
    return t


def key_rotation(head_dim: int, device: torch.device) -> torch.Tensor:
    """The orthogonal [head_dim, head_dim] fp32 matrix R that an FP8 cache's keys are stored
    rotated by (``k @ R``, after RoPE), with queries rotated alike: q.k = (q R).(k R).

    A normalised Sylvester Hadamard matrix, block-diagonal over the largest power of two that
    divides head_dim (all of it for 64 or 128). RoPE's low-frequency channels carry the large
    keys, and the queries that read them are large there too, so a dot product over e4m3 keys
    is dominated by the rounding of a few terms; rotated, every channel holds 1/sqrt(n) of
    each, and the rounding errors of the n terms average out (QuaRot, SpinQuant). fp32 so that
    it is orthogonal to fp32 precision for every head_dim (1/sqrt(128) is not exact in bf16).
    """
    n = head_dim & -head_dim  # largest power-of-two divisor
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    r = torch.block_diag(*[h / math.sqrt(n)] * (head_dim // n))
    return r.to(device=device, dtype=torch.float32)




class RMSNorm(nn.Module):
    """``x / rms(x) * w``; Gemma's form, ``x / rms(x) * (1 + w)``, is the same with
    ``offset`` 1: the loader stores ``offset + w`` (as llama.cpp's GGUF files hold Gemma's
    norms), so every path runs the one kernel."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.scale = cfg.attn_scale if cfg.attn_scale is not None else self.head_dim**-0.5
        # None: every earlier token; else the last sliding_window positions, this one included
        self.sliding_window = cfg.layer_window(layer)
        self.local_rope = cfg.uses_local_rope(layer)
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.qkv_proj.output_sizes = [self.q_size, self.kv_size, self.kv_size]  # type: ignore[assignment]
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        # gpt-oss: one learned logit per head in every softmax (kernels/paged_attention.py)
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if cfg.attention_sinks else None
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, cfg.norm_offset) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, cfg.norm_offset) if cfg.qk_norm else None
        # Set by the model runner once the KV pool exists: [num_blocks, block_size, KVH, D] each,
        # and for an FP8 cache the per-tensor scales it stores K / k_scale and V / v_scale with
        # (1-element fp32 tensors, so CUDA graphs replay them; 1.0 until set, as in vLLM).
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.k_scale: torch.Tensor | float = 1.0
        self.v_scale: torch.Tensor | float = 1.0
        # Set by CausalLM.init_rope, shared by all layers: the FP8 cache's key rotation
        # (see key_rotation) and a rotary table that rotates nothing (position 0: cos 1, sin 0),
        # which turns the fused rotary + cache write into the plain write, exactly; and for a
        # layer with its own RoPE base (Gemma 3's sliding layers) the table it rotates by.
        self.k_rotation = torch.empty(0)
        self.no_rope = torch.empty(0)
        self.own_cos_sin = torch.empty(0)
        # [KVH, D] fp32, subtracted from the rotated keys an FP8 cache stores: zeros, or their
        # mean over the calibration prompt (quant/kv_cache.py, its only other writer). Exact:
        # it moves every score of a query by the same q.k_offset, which softmax ignores, and
        # leaves smaller numbers to round.
        self.k_offset = torch.empty(0)
        # CPU attention whose rows do not depend on the batch, at some speed: set by the
        # deterministic mode (engine/batch_invariant.py)
        self.batch_invariant = False

    def kv_spec(self) -> LayerKVSpec:
        return LayerKVSpec(self.num_kv_heads, self.head_dim, self.sliding_window)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        T = x.shape[0]
        if self.local_rope:
            cos_sin = self.own_cos_sin
        qkv = self.qkv_proj(x)
        if not use_triton(qkv) and self.k_cache.dtype in (torch.float32, torch.float8_e4m3fn):
            # The CPU attention runs in fp32 (bf16 SDPA is 6-8x slower there), over an fp32
            # cache or an FP8 one dequantized to q's dtype; one cast here replaces the casts
            # that rotary, the cache write and SDPA would each make.
            qkv = qkv.float()
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(T, self.num_heads, self.head_dim)
        k = k.reshape(T, self.num_kv_heads, self.head_dim)
        v = v.reshape(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            # The norms return their weights' dtype; q and k keep qkv's, which the fp32 cast
            # above chose for the CPU attention (bf16 weights gave it bf16 q: a crash there)
            q, k = self.q_norm(q).to(qkv.dtype), self.k_norm(k).to(qkv.dtype)
        if self.k_cache.dtype in FP8_KV_DTYPES:
            # Keys are rotated after RoPE and before they are rounded to FP8 (docs/quantization.md,
            # "The FP8 KV cache"); the kernels see rotated q and k and nothing else changes. A
            # 16-bit or fp32 cache never comes here.
            q, k = rotary(q, k, positions, cos_sin)
            q, k = (q.float() @ self.k_rotation).to(q.dtype), k.float() @ self.k_rotation - self.k_offset
            positions, cos_sin = torch.zeros_like(positions), self.no_rope
        q = rotary_and_store_kv(q, k, v, positions, cos_sin, self.k_cache, self.v_cache, meta.slot_mapping,
                                self.k_scale, self.v_scale)
        o = paged_attention(
            q, self.k_cache, self.v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
            self.scale, meta.num_decodes, self.k_scale, self.v_scale, self.batch_invariant,
            sliding_window=self.sliding_window, sinks=self.sinks,
        )
        return self.o_proj(o.reshape(T, self.q_size).to(x.dtype))


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)), act silu or GELU's tanh form (Gemma)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gelu = cfg.hidden_act == "gelu_pytorch_tanh"
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.gate_up_proj.output_sizes = [cfg.intermediate_size, cfg.intermediate_size]  # type: ignore[assignment]
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up_proj(x)
        if self.gelu:
            gate, up = h.chunk(2, dim=-1)
            return self.down_proj(torch.nn.functional.gelu(gate, approximate="tanh") * up)
        return self.down_proj(silu_and_mul(h))


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks; with ``sandwich_norm`` (Gemma) each block's output
    is normed too before it joins the residual stream, four norms in all."""

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp: MLP | MoE = MoE(cfg) if cfg.num_experts else MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.pre_feedforward_layernorm: RMSNorm | None = None
        self.post_feedforward_layernorm: RMSNorm | None = None
        if cfg.sandwich_norm:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual): the hidden state is their sum, added by the next norm (fused)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, cos_sin, meta)
        if self.pre_feedforward_layernorm is None or self.post_feedforward_layernorm is None:
            x, residual = self.post_attention_layernorm(x, residual)
            return self.mlp(x), residual
        x, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(x), residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_scale = cfg.embed_scale
        # On meta (the loader builds there) no init: nn.Embedding's normal_ runs a Python
        # decomposition there that imports torch._dynamo (~1-4 s of every start), for values
        # the checkpoint replaces. Elsewhere the usual init (tests draw the same RNG values).
        meta = torch.get_default_device().type == "meta"
        weight = torch.empty(cfg.vocab_size, cfg.hidden_size) if meta else None
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        # The residual stream stays fp32 whatever the weight dtype: SmolLM2's last layers carry
        # large activations, and a bf16 residual flips its greedy answers (measured: 4% error).
        x = self.embed_tokens(input_ids).float()
        if self.embed_scale != 1.0:
            # Gemma scales in the embedding's dtype, as transformers does
            x = x * torch.tensor(self.embed_scale, dtype=self.embed_tokens.weight.dtype).float()
        residual: torch.Tensor | None = None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, cos_sin, meta)
        x, _ = self.norm(x, residual)
        return x


# HF checkpoint name fragment -> (our fused module, shard index)
_STACKED = {
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


class CausalLM(nn.Module):
    """A decoder-only LM over the paged KV pool: the families are configurations of it (see
    models/registry.py), a family file adds only what its checkpoints name differently."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("cos_sin", torch.empty(0), persistent=False)

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The float weights' dtype (the embedding's; a quantized head has none of its own)."""
        return self.model.embed_tokens.weight.dtype

    def attention_layers(self) -> list[Attention]:
        """Every attention layer, in order: what owns a KV pool gives layer i its K and V."""
        return [layer.self_attn for layer in self.model.layers]

    def kv_spec(self) -> list[LayerKVSpec]:
        """What each layer keeps in the KV cache (shape and window), in layer order."""
        return [attn.kv_spec() for attn in self.attention_layers()]

    def param_counts(self) -> tuple[int, int]:
        """(total, active per token) parameters, from the config (quantized linears change
        the tensors' shapes, not the model's size); a dense model uses all of them."""
        return dense_param_counts(self.config)

    def init_rope(self, max_positions: int) -> None:
        """Fills the rotary tables, and the FP8 cache's key rotation every attention layer
        shares; called after the weights are materialised on their device."""
        self.cos_sin = rope_cos_sin(self.config, max_positions).to(self.device)
        local = rope_cos_sin(self.config, max_positions, local=True).to(self.device) if (
            self.config.local_rope_theta is not None) else torch.empty(0)
        half = self.config.head_dim // 2
        rotation = key_rotation(self.config.head_dim, self.device)
        no_rope = torch.cat((torch.ones(1, half), torch.zeros(1, half)), dim=-1).to(self.device)
        offset = torch.zeros(self.config.num_kv_heads, self.config.head_dim, device=self.device)
        for attn in self.attention_layers():
            attn.k_rotation, attn.no_rope = rotation, no_rope
            attn.k_offset = offset
            if attn.local_rope:
                attn.own_cos_sin = local

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Returns the final hidden states [T, hidden]; ``compute_logits`` projects the rows
        that need sampling, so prefill never pays for [T, vocab] logits."""
        return self.model(input_ids, positions, self.cos_sin, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [T, vocab] of the rows of ``hidden``, refined (``logits_parts``)."""
        logits, top, exact = self.logits_parts(hidden)
        return logits if top is None or exact is None else logits.scatter_(1, top, exact)

    def logits_parts(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The head's fp32 logits [T, vocab] and, where the head rounds them (quantized or
        16-bit), each row's top 8 (indices [T, 8]) with their exact values, which the caller
        writes in (``compute_logits``). Apart so that the compiled decode step returns them
        and writes them outside its graph: a scatter_ into the head's output inside the graph
        left Inductor copying the whole [T, vocab] logits onto themselves every step (3 MB at
        16 rows of SmolLM2, 17 MB of Gemma 3)."""
        if not isinstance(self.lm_head, nn.Linear):
            # a quantized head (GGUF blocks on CPU): its int8 activations move logits by ~0.5%,
            # more than the top two of a small model can be apart, so the top 8 are recomputed
            # exactly from the fp32 final norm and the head's own (dequantized) rows
            logits = self.lm_head(hidden.float()).float()
            top = cpu_ops.topk_indices(logits, 8)
            rows = self.lm_head.dequantize_rows(top.flatten()).view(*top.shape, -1)  # type: ignore[operator]
            return logits, top, torch.einsum("td,tkd->tk", hidden.float(), rows)
        w = self.lm_head.weight
        logits = self.lm_head(hidden.to(w.dtype)).float()  # its forward: --deterministic swaps it
        if w.dtype == torch.float32:
            return logits, None, None
        # A 16-bit matmul rounds its output to 8 mantissa bits: 0.125 at a logit of 25.
        # That tied SmolLM2's top two answers to "What is the capital of France?" (margin
        # 0.08) and flipped greedy decoding. Recomputing the top 8 in fp32 from the fp32
        # final norm costs 8 rows instead of an fp32 copy of the whole head.
        top = logits.topk(8, dim=-1).indices
        return logits, top, torch.einsum("td,tkd->tk", hidden.float(), w[top].float())

    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors as ``load_weights`` places them; a family whose
        checkpoints fuse or name tensors otherwise overrides this."""
        return iter(weights)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copies HF-named tensors into the parameters; returns the names of parameters that
        were written, so the loader can name what a checkpoint lacks. A norm with an offset
        (Gemma) stores offset + w."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        for name, tensor in self.checkpoint_tensors(weights):
            if "rotary_emb.inv_freq" in name:
                continue
            if self.config.tie_word_embeddings and name == "lm_head.weight" and isinstance(self.lm_head, nn.Linear):
                continue
            shard: int | None = None
            for frag, (fused, idx) in _STACKED.items():
                if frag in name:
                    name, shard = name.replace(frag, fused), idx
                    break
            module_name, _, param_name = name.rpartition(".")
            module = modules.get(module_name)
            if module is not None and hasattr(module, "load_weight"):
                # quantized linears own their packed layouts
                module.load_weight(param_name, tensor, shard)
                loaded.add(name)
                continue
            param = params.get(name)
            if param is None:
                raise LocalLLMError(f"checkpoint tensor {name!r} has no place in {self.config.architecture}")
            if shard is not None:
                sizes = module.output_sizes  # type: ignore[union-attr]
                target = param.data.narrow(0, sum(sizes[:shard]), sizes[shard])
            else:
                target = param.data
            if tuple(target.shape) != tuple(tensor.shape):
                raise LocalLLMError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
                )
            if isinstance(module, RMSNorm) and module.offset:
                tensor = tensor.float() + module.offset
            target.copy_(tensor)
            loaded.add(name if shard is None else f"{name}#{shard}")
        return loaded

    def expected_weights(self) -> set[str]:
        """The ``load_weights`` names a complete checkpoint writes."""
        names: set[str] = set()
        modules = dict(self.named_modules())
        for mod_name, module in modules.items():
            if hasattr(module, "expected_weight_names"):  # quantized linears name their own tensors
                names.update(f"{mod_name}.{n}" for n in module.expected_weight_names())
        for name, _ in self.named_parameters():
            if self.config.tie_word_embeddings and name == "lm_head.weight" and isinstance(self.lm_head, nn.Linear):
                continue
            module = modules[name.rpartition(".")[0]]
            if hasattr(module, "load_weight"):
                continue
            sizes = getattr(module, "output_sizes", None)
            if sizes is not None and name.endswith((".weight", ".bias")):
                names.update(f"{name}#{i}" for i in range(len(sizes)))
            else:
                names.add(name)
        return names


def dense_param_counts(cfg: ModelConfig) -> tuple[int, int]:
    """(total, active per token) of a dense decoder: every block's matrices, norms and biases,
    the embedding, and the head unless tied. Active counts the head but not the embedding,
    whose lookup reads one row."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    block = h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size
    block += (4 if cfg.sandwich_norm else 2) * h + (2 * cfg.head_dim if cfg.qk_norm else 0)
    block += (q + 2 * kv) if cfg.qkv_bias else 0
    embedding, head = cfg.vocab_size * h, cfg.vocab_size * h
    total = cfg.num_layers * block + h + embedding + (0 if cfg.tie_word_embeddings else head)
    return total, total - embedding + (head if cfg.tie_word_embeddings else 0)
