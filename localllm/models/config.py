"""What a model is, as the engine runs it: ``ModelConfig``, read from an HF config.json.

One reader for every family (the GGUF reader turns a file's metadata into the same HF keys):
the families differ in which keys they read and in the defaults transformers gives keys a
config leaves out, which the tables below hold. A key that would change the math in a way
the engine does not implement is refused in one line, never ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from localllm.errors import LocalLLMError
from localllm.models.kv_spec import LayerKVSpec

# HF architecture -> the model_type its config.json carries (the registry maps each to a class)
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3_text",
    "Phi3ForCausalLM": "phi3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "GptOssForCausalLM": "gpt_oss",
}
# A multimodal wrapper's text_config names its text model by model_type.
TEXT_MODEL_TYPES = {model_type: arch for arch, model_type in SUPPORTED_ARCHITECTURES.items()}
# Multimodal wrappers whose text model runs (its text_config; the vision tower is left out)
TEXT_WRAPPERS = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM", "LlavaForConditionalGeneration": None,
                 "Mistral3ForConditionalGeneration": None}


def architecture_supported(architecture: str) -> bool:
    """Whether the engine runs a checkpoint of this HF architecture (for a wrapper whose text
    model varies, such as LLaVA, that depends on its text_config: not claimed here)."""
    return architecture in SUPPORTED_ARCHITECTURES or TEXT_WRAPPERS.get(architecture) is not None


ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
# transformers' per-architecture defaults for keys a config.json may leave out
_MAX_POSITIONS = {"LlamaForCausalLM": 2048, "MistralForCausalLM": 4096 * 32, "Gemma3ForCausalLM": 131072,
                  "Phi3ForCausalLM": 4096, "GptOssForCausalLM": 131072}
_DEFAULT_MAX_POSITIONS = 32768  # Qwen2, Qwen3
_DEFAULT_HEAD_DIM = {"Qwen3ForCausalLM": 128, "Gemma3ForCausalLM": 256, "GptOssForCausalLM": 64}  # else hidden // heads
_DEFAULT_EPS = {"Phi3ForCausalLM": 1e-5, "GptOssForCausalLM": 1e-5}
_DEFAULT_TIED = {"Gemma3ForCausalLM": True}
_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
FULL, SLIDING = "full_attention", "sliding_attention"


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
    # RoPE rotates the first rotary_dim = int(head_dim * factor) dims of each head and passes
    # the rest (Phi-4-mini: 0.75); the rotary table is rotary_dim wide
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    quantization: dict[str, Any] | None = field(default=None)
    # The window of the layers that slide (query at p sees keys p - window + 1 .. p); which
    # layers slide is ``layer_types`` (empty: all of them, when there is a window).
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    # The multimodal architecture this text model was read out of (its text_config), if any:
    # its weights carry a prefix, and its vision tower is left out.
    wrapper: str | None = None
    # What the families beyond Llama change (the defaults are Llama's):
    hidden_act: str = "silu"  # the MLP's gate activation: silu or gelu_pytorch_tanh
    attn_scale: float | None = None  # None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    norm_offset: float = 0.0  # RMSNorm multiplies by offset + w (Gemma: 1)
    embed_scale: float = 1.0  # the embeddings are multiplied by it (Gemma: sqrt(hidden))
    sandwich_norm: bool = False  # Gemma: norms after attention and the MLP too, four per block
    # The RoPE of sliding layers when it differs (Gemma 3: base 10,000 and no scaling)
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] | None = None
    # Mixture of experts (models/moe.py; 0 experts: the dense MLP). Routing takes the top
    # ``num_experts_per_tok`` router logits; ``norm_topk_prob``: their weights are the softmax
    # over those k (gpt-oss, Qwen3-MoE's checkpoints), else the softmax over all experts.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    expert_bias: bool = False  # gpt-oss: biases on the router and on every expert matmul
    # gpt-oss's clamped SwiGLU: (clamp(up, -l, l) + 1) * g * sigmoid(alpha * g), g = min(gate, l)
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    o_bias: bool = False  # a bias on o_proj (gpt-oss)
    attention_sinks: bool = False  # a learned per-head logit in every softmax (gpt-oss)

    def __post_init__(self) -> None:
        assert self.num_heads % self.num_kv_heads == 0, "GQA needs heads to be a multiple of kv heads"
        assert not self.layer_types or len(self.layer_types) == self.num_layers

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_window(self, i: int) -> int | None:
        """The window layer ``i`` attends through, or None (every earlier token)."""
        if self.sliding_window is None:
            return None
        return self.sliding_window if not self.layer_types or self.layer_types[i] == SLIDING else None

    def kv_spec(self) -> list[LayerKVSpec]:
        """What each layer keeps in the KV cache, as the model built from this config states it."""
        return [LayerKVSpec(self.num_kv_heads, self.head_dim, self.layer_window(i)) for i in range(self.num_layers)]

    def uses_local_rope(self, i: int) -> bool:
        return self.local_rope_theta is not None and self.layer_window(i) is not None

    @property
    def max_context(self) -> int:
        """The longest sequence this model runs: every attention path applies the windows
        exactly, so a window does not cap it."""
        return self.max_position_embeddings

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
            tied = bool(cfg.get("tie_word_embeddings", _DEFAULT_TIED.get(arch, False))) or bool(
                text.get("tie_word_embeddings", _DEFAULT_TIED.get(arch, False)))
            cfg = {**text, "tie_word_embeddings": tied, "quantization_config": cfg.get("quantization_config")}
        if arch not in SUPPORTED_ARCHITECTURES:
            raise LocalLLMError(
                f"{source}: architecture {arch or '(none)'!r} is not supported; "
                f"localllm runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        gemma = arch == "Gemma3ForCausalLM"
        act = _refuse_unsupported_math(cfg, arch, source)
        moe = _experts(cfg, arch, source)
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            head_dim = cfg.get("head_dim") or _DEFAULT_HEAD_DIM.get(arch, hidden // heads)
            max_positions = int(cfg.get("max_position_embeddings") or _MAX_POSITIONS.get(arch, _DEFAULT_MAX_POSITIONS))
            layers = int(cfg["num_hidden_layers"])
            window, types = _sliding_window(cfg, arch, layers, source)
            rope_theta, rope_scaling, local = _rope_by_layer_type(cfg, arch, max_positions, source)
            partial = _partial_rotary(cfg, arch, int(head_dim), source)
            half = int(int(head_dim) * partial) // 2
            for key in ("short_factor", "long_factor"):
                if len((rope_scaling or {}).get(key, [0] * half)) != half:
                    what = "head_dim / 2" if partial == 1 else "rotary dims / 2"
                    raise LocalLLMError(f"{source}: longrope {key} needs {what} = {half} entries")
            return cls(
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=layers,
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(head_dim),
                rms_norm_eps=float(cfg.get("rms_norm_eps", _DEFAULT_EPS.get(arch, 1e-6))),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                partial_rotary_factor=partial,
                max_position_embeddings=max_positions,
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", _DEFAULT_TIED.get(arch, False))),
                qkv_bias=bool(cfg.get("attention_bias", arch in ("Qwen2ForCausalLM", "GptOssForCausalLM"))),
                qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM", "Qwen3MoeForCausalLM"),
                quantization=cfg.get("quantization_config"),
                sliding_window=window,
                layer_types=types,
                wrapper=wrapper,
                hidden_act=act,
                attn_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5 if gemma else None,
                norm_offset=1.0 if gemma else 0.0,
                embed_scale=hidden**0.5 if gemma else 1.0,
                sandwich_norm=gemma,
                local_rope_theta=local[0] if local else None,
                local_rope_scaling=local[1] if local else None,
                **moe,
            )
        except KeyError as e:
            raise LocalLLMError(f"{source}: missing field {e.args[0]!r}; is this a causal LM config?") from e
        except (TypeError, ValueError) as e:
            raise LocalLLMError(f"{source}: a field has the wrong type ({e})") from e


def _refuse_unsupported_math(cfg: dict[str, Any], arch: str, source: str) -> str:
    """Returns the MLP activation; refuses the settings no path implements."""
    key = "hidden_activation" if arch == "Gemma3ForCausalLM" else "hidden_act"
    act = cfg.get(key) or ("gelu_pytorch_tanh" if arch == "Gemma3ForCausalLM" else "silu")
    if act not in _ACTIVATIONS:
        raise LocalLLMError(f"{source}: {key} {act!r} is not supported ({', '.join(_ACTIVATIONS)})")
    if cfg.get("mlp_bias"):
        raise LocalLLMError(f"{source}: mlp_bias is not supported (MLP layers without bias only)")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            raise LocalLLMError(f"{source}: {key} is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise LocalLLMError(f"{source}: use_bidirectional_attention is not supported (causal attention only)")
    return act


def _experts(cfg: dict[str, Any], arch: str, source: str) -> dict[str, Any]:
    """The mixture-of-experts settings of Qwen3-MoE and gpt-oss as transformers reads them
    (``num_experts`` or its alias ``num_local_experts``); a layout the engine does not run
    (dense layers between sparse ones) is refused."""
    if arch not in ("Qwen3MoeForCausalLM", "GptOssForCausalLM"):
        return {}
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or (128 if arch == "Qwen3MoeForCausalLM" else 32))
    top_k = int(cfg.get("num_experts_per_tok") or (8 if arch == "Qwen3MoeForCausalLM" else 4))
    if not 1 <= top_k <= experts:
        raise LocalLLMError(f"{source}: num_experts_per_tok {top_k} must be between 1 and num_experts {experts}")
    if arch == "Qwen3MoeForCausalLM":
        if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step") or 1) != 1:
            raise LocalLLMError(f"{source}: mlp_only_layers / decoder_sparse_step (dense layers between the expert "
                                "layers) are not supported: every layer must be a mixture of experts")
        return {"num_experts": experts, "num_experts_per_tok": top_k,
                "moe_intermediate_size": int(cfg.get("moe_intermediate_size") or 768),
                "norm_topk_prob": bool(cfg.get("norm_topk_prob", False))}
    quant = (cfg.get("quantization_config") or {}).get("quant_method")
    if quant == "mxfp4":
        raise LocalLLMError(f"{source}: gpt-oss's MXFP4 safetensors experts are not supported yet; "
                            "use its bf16 checkpoint or a GGUF file of it")
    return {"num_experts": experts, "num_experts_per_tok": top_k, "moe_intermediate_size": int(cfg["intermediate_size"]),
            "norm_topk_prob": True, "expert_bias": True, "swiglu_limit": float(cfg.get("swiglu_limit", 7.0)),
            "swiglu_alpha": float(cfg.get("swiglu_alpha", 1.702)), "o_bias": bool(cfg.get("attention_bias", True)),
            "attention_sinks": True}


def _window_number(window: Any, source: str) -> int:
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise LocalLLMError(f"{source}: sliding_window {window!r} is not a number of tokens")
    return window


def _sliding_window(cfg: dict[str, Any], arch: str, layers: int, source: str) -> tuple[int | None, tuple[str, ...]]:
    """(window, layer_types) as transformers decides them: Mistral's sliding_window on every
    layer (4096 when left out; null is off), Phi-3's on every layer when set, Qwen's only with
    use_sliding_window and then on the layers from max_window_layers on, Gemma 3's on the
    layers its layer_types (or 5 of every 6) name."""
    types = cfg.get("layer_types")
    if arch == "MistralForCausalLM":
        window = cfg.get("sliding_window", 4096)
        types = None
    elif arch == "Phi3ForCausalLM":
        window = cfg.get("sliding_window")
        types = None
    elif arch == "Gemma3ForCausalLM":
        window = cfg.get("sliding_window", 4096)
        if types is None:
            pattern = int(cfg.get("sliding_window_pattern", 6))
            types = [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
    elif arch == "GptOssForCausalLM":  # alternating: even layers slide over 128 tokens, odd ones see all
        window = cfg.get("sliding_window", 128)
        if types is None:
            types = [SLIDING if (i + 1) % 2 else FULL for i in range(layers)]
    elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM") and cfg.get("use_sliding_window"):
        window = cfg.get("sliding_window", 4096)
        if types is None:
            first = cfg.get("max_window_layers", 28)
            types = [SLIDING if window is not None and i >= first else FULL for i in range(layers)]
    else:
        return None, ()
    if types is not None:
        if not isinstance(types, list) or len(types) != layers or any(t not in (FULL, SLIDING) for t in types):
            raise LocalLLMError(f"{source}: layer_types must list {layers} of {FULL!r}/{SLIDING!r}")
        if SLIDING not in types:
            return None, ()
    if window is None:
        return None, ()
    return _window_number(window, source), tuple(types or ())


def _rope_by_layer_type(
    cfg: dict[str, Any], arch: str, max_positions: int, source: str
) -> tuple[float, dict[str, Any] | None, tuple[float, dict[str, Any] | None] | None]:
    """(theta, scaling) of the full-attention layers and, where sliding layers rotate by
    another base (Gemma 3), theirs."""
    if arch != "Gemma3ForCausalLM":
        theta, scaling = _rope(cfg, max_positions, source)
        return theta, scaling, None
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and any(isinstance(v, dict) for v in params.values()):
        unknown = set(params) - {FULL, SLIDING}
        if unknown:
            raise LocalLLMError(f"{source}: rope_parameters for layer type {sorted(unknown)[0]!r} is not supported")
        full = {**(params.get(FULL) or {})}
        local = {**(params.get(SLIDING) or {})}
        full.setdefault("rope_theta", cfg.get("rope_theta") or 1_000_000.0)
        local.setdefault("rope_theta", cfg.get("rope_local_base_freq") or 10_000.0)
    else:  # the older layout: rope_theta and rope_scaling for global layers, rope_local_base_freq
        full = {**(cfg.get("rope_scaling") or {}), "rope_theta": cfg.get("rope_theta") or 1_000_000.0}
        local = {"rope_type": "default", "rope_theta": cfg.get("rope_local_base_freq") or 10_000.0}
    base = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
    theta, scaling = _rope({**base, "rope_parameters": full}, max_positions, source)
    local_theta, local_scaling = _rope({**base, "rope_parameters": local}, max_positions, source)
    return theta, scaling, (local_theta, local_scaling)


def _rope(cfg: dict[str, Any], max_positions: int, source: str) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) as transformers 5 reads them: ``rope_parameters`` (what it
    writes) or the older ``rope_scaling``, which replaces it when both are there; the theta
    inside wins over a top-level ``rope_theta``; llama3, yarn and longrope take the
    pretraining length from ``original_max_position_embeddings`` (top level first, as
    transformers does), else from max_position_embeddings."""
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
    params.pop("partial_rotary_factor", None)  # _partial_rotary reads it
    if not _positive(theta):
        raise LocalLLMError(f"{source}: rope_theta {theta!r} must be a positive number")
    if kind == "default":
        return float(theta), None
    if kind == "freq_factors":  # what the GGUF reader makes of llama.cpp's rope_freqs tensor
        return float(theta), {"rope_type": kind, "factors": params["factors"]}
    if kind not in ROPE_TYPES:
        raise LocalLLMError(f"{source}: rope type {kind!r} is not supported ({', '.join(ROPE_TYPES)})")
    if kind in ("llama3", "yarn", "longrope"):
        top = cfg.get("original_max_position_embeddings")
        params["original_max_position_embeddings"] = top if top is not None else (
            params.get("original_max_position_embeddings") or max_positions)
    needed = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
              "yarn": ("factor",), "longrope": ("short_factor", "long_factor")}[kind]
    for key in needed:
        if key not in params:
            raise LocalLLMError(f"{source}: rope type {kind!r} needs {key!r} in rope_parameters")
    if kind == "yarn" and params["factor"] is None:  # transformers: the ratio of the two lengths
        params["factor"] = max_positions / params["original_max_position_embeddings"]
    if kind == "longrope":
        params["max_position_embeddings"] = max_positions  # its default attention factor needs it
        for key in ("short_factor", "long_factor"):
            factors = params.pop(key)
            if not isinstance(factors, list) or not all(_positive(f) for f in factors):
                raise LocalLLMError(f"{source}: rope_parameters {key} must be a list of positive numbers")
            params[key] = [float(f) for f in factors]
    for key, value in params.items():
        if key in ("truncate", "short_factor", "long_factor"):
            continue
        if value is not None and not _positive(value):
            raise LocalLLMError(f"{source}: rope_parameters {key} {value!r} must be a positive number")
    return float(theta), {"rope_type": kind, **params}


def _partial_rotary(cfg: dict[str, Any], arch: str, head_dim: int, source: str) -> float:
    """``partial_rotary_factor`` as transformers 5 reads it (in rope_parameters, or the older
    rope_scaling, or at the top level): RoPE on the first int(head_dim * factor) dims. Phi-3's
    attention (Phi-4-mini) passes the rest through; other families here rotate whole heads."""
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    factor = rope.get("partial_rotary_factor") if isinstance(rope, dict) else None
    factor = cfg.get("partial_rotary_factor") if factor is None else factor
    if factor is None or factor == 1:
        return 1.0
    if arch != "Phi3ForCausalLM":
        raise LocalLLMError(f"{source}: partial_rotary_factor {factor!r} is not supported for {arch} "
                            "(rotary over the whole head; Phi-3/Phi-4 take a partial one)")
    dims = int(head_dim * factor) if _positive(factor) and factor < 1 else 0
    if dims < 2 or dims % 2:
        raise LocalLLMError(f"{source}: partial_rotary_factor {factor!r} must be in (0, 1] and rotate an even "
                            f"number of the {head_dim} head dimensions")
    return float(factor)


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
