"""The one model: a Llama-family decoder whose config flags cover Llama 2/3/3.1/3.2, Mistral,
Qwen2 (qkv bias), Qwen3 (q/k RMSNorm) and SmolLM2.

Parameters keep HF names except two fusions: q/k/v live in ``qkv_proj`` and gate/up in
``gate_up_proj`` (output dims concatenated in that order), which halves the matmul launches
per layer. ``load_weights`` maps HF tensors onto those shards.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from localllm.errors import LocalLLMError
from localllm.kernels import cpu_ops, paged_attention, rms_norm, rotary, rotary_and_store_kv, silu_and_mul
from localllm.kernels._triton import use_triton

# HF architecture -> the model_type its config.json carries
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
# A multimodal wrapper's text_config names its text model by model_type.
TEXT_MODEL_TYPES = {model_type: arch for arch, model_type in SUPPORTED_ARCHITECTURES.items()}
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# transformers' per-architecture defaults for keys a config.json may leave out
_MAX_POSITIONS = {"LlamaForCausalLM": 2048, "MistralForCausalLM": 4096 * 32}
_DEFAULT_MAX_POSITIONS = 32768  # Qwen2, Qwen3


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # always with "rope_type"; None is plain RoPE
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    quantization: dict[str, Any] | None = field(default=None)
    # Attention sees only the last sliding_window tokens (Mistral v0.1, Qwen2 with
    # use_sliding_window). A sequence no longer than the window sees all of it, so the context
    # is capped there and full attention is exact.
    sliding_window: int | None = None
    # The multimodal architecture this text model was read out of (its text_config), if any:
    # its weights carry a prefix, and its vision tower is left out.
    wrapper: str | None = None

    def __post_init__(self) -> None:
        assert self.num_heads % self.num_kv_heads == 0, "GQA needs heads to be a multiple of kv heads"

    @property
    def max_context(self) -> int:
        """The longest sequence this model runs exactly."""
        return min(self.max_position_embeddings, self.sliding_window or self.max_position_embeddings)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Reads config.json as transformers 5 does, which also reads the older layout:
        ``rope_parameters`` or ``rope_theta``/``rope_scaling``, a multimodal wrapper's
        ``text_config``, and transformers' own defaults for keys left out. A key that would
        change the math in a way this model does not implement is refused, never ignored."""
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else ""
        wrapper = None
        text = cfg.get("text_config")
        if arch not in SUPPORTED_ARCHITECTURES and isinstance(text, dict):
            kind = text.get("model_type")
            if kind not in TEXT_MODEL_TYPES:
                raise LocalLLMError(
                    f"{source}: {arch or 'this multimodal model'} holds a {kind!r} text model, which is not supported; "
                    f"localllm runs the text models {', '.join(TEXT_MODEL_TYPES)}")
            wrapper, arch = arch or "a multimodal model", TEXT_MODEL_TYPES[kind]
            # transformers reads tying from either level; quantization stays with the wrapper
            tied = bool(cfg.get("tie_word_embeddings")) or bool(text.get("tie_word_embeddings"))
            cfg = {**text, "tie_word_embeddings": tied, "quantization_config": cfg.get("quantization_config")}
        if arch not in SUPPORTED_ARCHITECTURES:
            raise LocalLLMError(
                f"{source}: architecture {arch or '(none)'!r} is not supported; "
                f"localllm runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        _refuse_unsupported_math(cfg, arch, source)
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            # Qwen3's head_dim is 128 unless given, not hidden // heads
            head_dim = cfg.get("head_dim") or (128 if arch == "Qwen3ForCausalLM" else hidden // heads)
            max_positions = int(cfg.get("max_position_embeddings") or _MAX_POSITIONS.get(arch, _DEFAULT_MAX_POSITIONS))
            rope_theta, rope_scaling = _rope(cfg, max_positions, source)
            return cls(
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(head_dim),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                max_position_embeddings=max_positions,
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
                qk_norm=arch == "Qwen3ForCausalLM",
                quantization=cfg.get("quantization_config"),
                sliding_window=_sliding_window(cfg, arch, source),
                wrapper=wrapper,
            )
        except KeyError as e:
            raise LocalLLMError(f"{source}: missing field {e.args[0]!r}; is this a causal LM config?") from e
        except (TypeError, ValueError) as e:
            raise LocalLLMError(f"{source}: a field has the wrong type ({e})") from e


def _refuse_unsupported_math(cfg: dict[str, Any], arch: str, source: str) -> None:
    act = cfg.get("hidden_act") or "silu"
    if act != "silu":
        raise LocalLLMError(f"{source}: hidden_act {act!r} is not supported (silu only)")
    if cfg.get("mlp_bias"):
        raise LocalLLMError(f"{source}: mlp_bias is not supported (MLP layers without bias only)")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            raise LocalLLMError(f"{source}: {key} is not supported")


def _sliding_window(cfg: dict[str, Any], arch: str, source: str) -> int | None:
    """The window when some layer attends through one, as transformers decides it: Mistral's
    sliding_window (4096 when left out; null is off), Qwen's only with use_sliding_window and
    then on the layers from max_window_layers on, or where layer_types says so."""
    if arch == "MistralForCausalLM":
        window = cfg.get("sliding_window", 4096)
    elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and cfg.get("use_sliding_window"):
        window = cfg.get("sliding_window", 4096)
        types = cfg.get("layer_types")
        if types is None:
            first = cfg.get("max_window_layers", 28)
            types = ["sliding_attention" if window is not None and i >= first else "full_attention"
                     for i in range(int(cfg["num_hidden_layers"]))]
        if "sliding_attention" not in types:
            window = None
    else:
        return None
    if window is None:
        return None
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise LocalLLMError(f"{source}: sliding_window {window!r} is not a number of tokens")
    return window


def _rope(cfg: dict[str, Any], max_positions: int, source: str) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) as transformers 5 reads them: ``rope_parameters`` (what it
    writes) or the older ``rope_scaling``, which replaces it when both are there; the theta
    inside wins over a top-level ``rope_theta``; llama3 and yarn take the pretraining length
    from ``original_max_position_embeddings`` (top level first, as transformers does), else
    from max_position_embeddings."""
    raw = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if not isinstance(raw, dict):
        raise LocalLLMError(f"{source}: rope_parameters must be an object, got {raw!r}")
    if any(isinstance(v, dict) for v in raw.values()):
        raise LocalLLMError(f"{source}: rope_parameters set per layer type ({', '.join(raw)}) is not supported")
    params = dict(raw)
    theta = params.pop("rope_theta", None)
    theta = cfg.get("rope_theta", 10000.0) if theta is None else theta
    kind = params.pop("rope_type", None) or params.get("type") or "default"
    params.pop("type", None)
    partial = params.pop("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise LocalLLMError(f"{source}: partial_rotary_factor {partial!r} is not supported (rotary over the whole head)")
    if not _positive(theta):
        raise LocalLLMError(f"{source}: rope_theta {theta!r} must be a positive number")
    if kind == "default":
        return float(theta), None
    if kind == "freq_factors":  # what the GGUF reader makes of llama.cpp's rope_freqs tensor
        return float(theta), {"rope_type": kind, "factors": params["factors"]}
    if kind not in ROPE_TYPES:
        raise LocalLLMError(f"{source}: rope type {kind!r} is not supported ({', '.join(ROPE_TYPES)})")
    if kind in ("llama3", "yarn"):
        top = cfg.get("original_max_position_embeddings")
        params["original_max_position_embeddings"] = top if top is not None else (
            params.get("original_max_position_embeddings") or max_positions)
    needed = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
              "yarn": ("factor",)}[kind]
    for key in needed:
        if key not in params:
            raise LocalLLMError(f"{source}: rope type {kind!r} needs {key!r} in rope_parameters")
    if kind == "yarn" and params["factor"] is None:  # transformers: the ratio of the two lengths
        params["factor"] = max_positions / params["original_max_position_embeddings"]
    for key, value in params.items():
        if key in ("truncate",):
            continue
        if value is not None and not _positive(value):
            raise LocalLLMError(f"{source}: rope_parameters {key} {value!r} must be a positive number")
    return float(theta), {"rope_type": kind, **params}


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def rope_cos_sin(cfg: ModelConfig, max_positions: int) -> torch.Tensor:
    """[max_positions, head_dim] fp32: cos over the first half, sin over the second."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = cfg.rope_scaling or {}
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
        inv_freq, attention_factor = _yarn(inv_freq, scaling, cfg.rope_theta, dim)
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


FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


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
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.qkv_proj.output_sizes = [self.q_size, self.kv_size, self.kv_size]  # type: ignore[assignment]
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        # Set by the model runner once the KV pool exists: [num_blocks, block_size, KVH, D] each,
        # and for an FP8 cache the per-tensor scales it stores K / k_scale and V / v_scale with
        # (1-element fp32 tensors, so CUDA graphs replay them; 1.0 until set, as in vLLM).
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.k_scale: torch.Tensor | float = 1.0
        self.v_scale: torch.Tensor | float = 1.0
        # Set by LlamaForCausalLM.init_rope, shared by all layers: the FP8 cache's key rotation
        # (see key_rotation) and a rotary table that rotates nothing (position 0: cos 1, sin 0),
        # which turns the fused rotary + cache write into the plain write, exactly.
        self.k_rotation = torch.empty(0)
        self.no_rope = torch.empty(0)
        # [KVH, D] fp32, subtracted from the rotated keys an FP8 cache stores: zeros, or their
        # mean over the calibration prompt (quant/kv_cache.py, its only other writer). Exact:
        # it moves every score of a query by the same q.k_offset, which softmax ignores, and
        # leaves smaller numbers to round.
        self.k_offset = torch.empty(0)
        # CPU attention whose rows do not depend on the batch, at some speed: set by the
        # deterministic mode (engine/batch_invariant.py)
        self.batch_invariant = False

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        T = x.shape[0]
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
            q, k = self.q_norm(q), self.k_norm(k)
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
        )
        return self.o_proj(o.reshape(T, self.q_size).to(x.dtype))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.gate_up_proj.output_sizes = [cfg.intermediate_size, cfg.intermediate_size]  # type: ignore[assignment]
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, cos_sin, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        # The residual stream stays fp32 whatever the weight dtype: SmolLM2's last layers carry
        # large activations, and a bf16 residual flips its greedy answers (measured: 4% error).
        x = self.embed_tokens(input_ids).float()
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


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
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

    def init_rope(self, max_positions: int) -> None:
        """Fills the rotary table, and the FP8 cache's key rotation every attention layer
        shares; called after the weights are materialised on their device."""
        self.cos_sin = rope_cos_sin(self.config, max_positions).to(self.device)
        half = self.config.head_dim // 2
        rotation = key_rotation(self.config.head_dim, self.device)
        no_rope = torch.cat((torch.ones(1, half), torch.zeros(1, half)), dim=-1).to(self.device)
        offset = torch.zeros(self.config.num_kv_heads, self.config.head_dim, device=self.device)
        for layer in self.model.layers:
            layer.self_attn.k_rotation, layer.self_attn.no_rope = rotation, no_rope
            layer.self_attn.k_offset = offset

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Returns the final hidden states [T, hidden]; ``compute_logits`` projects the rows
        that need sampling, so prefill never pays for [T, vocab] logits."""
        return self.model(input_ids, positions, self.cos_sin, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if not isinstance(self.lm_head, nn.Linear):
            # a quantized head (GGUF blocks on CPU): its int8 activations move logits by ~0.5%,
            # more than the top two of a small model can be apart, so the top 8 are recomputed
            # exactly from the fp32 final norm and the head's own (dequantized) rows
            logits = self.lm_head(hidden.float()).float()
            top = cpu_ops.topk_indices(logits, 8)
            rows = self.lm_head.dequantize_rows(top.flatten()).view(*top.shape, -1)  # type: ignore[operator]
            exact = torch.einsum("td,tkd->tk", hidden.float(), rows)
            return logits.scatter_(1, top, exact)
        w = self.lm_head.weight
        logits = torch.nn.functional.linear(hidden.to(w.dtype), w).float()
        if w.dtype != torch.float32:
            # A 16-bit matmul rounds its output to 8 mantissa bits: 0.125 at a logit of 25.
            # That tied SmolLM2's top two answers to "What is the capital of France?" (margin
            # 0.08) and flipped greedy decoding. Recomputing the top 8 in fp32 from the fp32
            # final norm costs 8 rows instead of an fp32 copy of the whole head.
            top = logits.topk(8, dim=-1).indices
            exact = torch.einsum("td,tkd->tk", hidden.float(), w[top].float())
            logits.scatter_(1, top, exact)
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copies HF-named tensors into the parameters; returns the names of parameters that
        were written, so the loader can name what a checkpoint lacks."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        for name, tensor in weights:
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
            if sizes is not None and name.endswith(".weight"):
                names.update(f"{name}#{i}" for i in range(len(sizes)))
            elif sizes is not None and name.endswith(".bias"):
                names.update(f"{name}#{i}" for i in range(len(sizes)))
            else:
                names.add(name)
        return names
