"""Which class runs an architecture, and how a GGUF file names its tensors and settings.

Keyed by the HF ``architectures`` name (config.json) and by GGUF's ``general.architecture``;
the GGUF reader turns a file into HF names and HF config keys through the tables here, so one
loader serves every family. ``SUPPORTED_ARCHITECTURES`` (models/config.py, torch-free for
the catalog) lists the same architectures; the import-time check below keeps them equal.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from localllm.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from localllm.models.gemma3 import Gemma3ForCausalLM
from localllm.models.gpt_oss import GptOssForCausalLM
from localllm.models.layers import CausalLM
from localllm.models.llama import LlamaForCausalLM
from localllm.models.phi3 import Phi3ForCausalLM
from localllm.models.qwen3_moe import Qwen3MoeForCausalLM

# llama.cpp's per-block tensor names -> the HF module under model.layers.N (Llama's layout)
_LLAMA_GGUF_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GEMMA3_GGUF_NAMES = {
    **_LLAMA_GGUF_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_PHI3_GGUF_NAMES = {
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_up": "mlp.gate_up_proj",  # llama.cpp's phi3 keeps gate and up fused, gate first, as HF does
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}

# Mixture of experts (models/moe.py): the router and each layer's experts stacked [E, out, in]
_MOE_GGUF_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_exps",
    "ffn_up_exps": "mlp.experts.up_exps",
    "ffn_down_exps": "mlp.experts.down_exps",
}
_QWEN3MOE_GGUF_NAMES = {**_LLAMA_GGUF_NAMES, **_MOE_GGUF_NAMES}
_GPT_OSS_GGUF_NAMES = {
    **_LLAMA_GGUF_NAMES, **_MOE_GGUF_NAMES,
    "post_attention_norm": "post_attention_layernorm",  # llama.cpp's name for gpt-oss's pre-MLP norm
    "attn_sinks": "self_attn.sinks",
}


def _moe_gguf_config(meta: Callable[[str, Any], Any], hf: dict[str, Any]) -> None:
    """llama.cpp's expert keys; qwen3moe always renormalises the top-k weights there."""
    hf["num_experts"] = int(meta("expert_count", None))
    hf["num_experts_per_tok"] = int(meta("expert_used_count", None))
    hf["moe_intermediate_size"] = int(meta("expert_feed_forward_length", hf["intermediate_size"]))
    hf["norm_topk_prob"] = bool(meta("expert_weights_norm", True))


def _gpt_oss_gguf_config(meta: Callable[[str, Any], Any], hf: dict[str, Any]) -> None:
    """gpt-oss in llama.cpp: every even layer slides, experts as llama.cpp's other MoE
    families, the expert size as feed_forward_length."""
    hf["num_local_experts"] = int(meta("expert_count", None))
    hf["num_experts_per_tok"] = int(meta("expert_used_count", None))
    hf["intermediate_size"] = int(meta("expert_feed_forward_length", hf["intermediate_size"]))
    hf["sliding_window"] = int(meta("attention.sliding_window", 128))
    hf["layer_types"] = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(hf["num_hidden_layers"])]


def _gemma3_gguf_config(meta: Callable[[str, Any], Any], hf: dict[str, Any]) -> None:
    """What llama.cpp fixes for gemma3 rather than storing: a window on 5 of every 6 layers,
    the sliding layers' RoPE base 10,000 (and no scaling there), and the attention scale
    (1/sqrt(head_dim), but 1/sqrt(hidden/heads) for the 62-layer 27B)."""
    layers = hf["num_hidden_layers"]
    hf["sliding_window"] = int(meta("attention.sliding_window", 4096))
    hf["layer_types"] = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(layers)]
    hf["rope_local_base_freq"] = 10000.0
    hf["query_pre_attn_scalar"] = hf["hidden_size"] // hf["num_attention_heads"] if layers == 62 else hf["head_dim"]
    hf["hidden_activation"] = "gelu_pytorch_tanh"


def _windowed_gguf_config(meta: Callable[[str, Any], Any], hf: dict[str, Any]) -> None:
    window = meta("attention.sliding_window", 0)
    hf["sliding_window"] = int(window) if window else None


@dataclass(frozen=True, slots=True)
class Family:
    """One architecture as the engine runs it. ``gguf_names``: llama.cpp's per-block tensor
    names mapped to HF's; ``gguf_permute_qk``: the file's Q/K rows are in llama.cpp's rotary
    order; ``gguf_norm_offset``: the file's norms hold ``offset + w`` (Gemma), HF's hold w;
    ``gguf_config``: HF config keys the family's GGUF metadata implies."""

    model_class: type[CausalLM]
    gguf_architecture: str | None = None
    gguf_names: dict[str, str] = field(default_factory=dict)
    gguf_permute_qk: bool = False
    gguf_norm_offset: float = 0.0
    gguf_config: Callable[[Callable[[str, Any], Any], dict[str, Any]], None] | None = None


FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family(LlamaForCausalLM, "llama", _LLAMA_GGUF_NAMES, gguf_permute_qk=True),
    "MistralForCausalLM": Family(LlamaForCausalLM),  # llama.cpp writes Mistral 7B as "llama"
    "Qwen2ForCausalLM": Family(LlamaForCausalLM, "qwen2", _LLAMA_GGUF_NAMES),
    "Qwen3ForCausalLM": Family(LlamaForCausalLM, "qwen3", _LLAMA_GGUF_NAMES),
    "Gemma3ForCausalLM": Family(Gemma3ForCausalLM, "gemma3", _GEMMA3_GGUF_NAMES, gguf_norm_offset=1.0,
                                gguf_config=_gemma3_gguf_config),
    "Phi3ForCausalLM": Family(Phi3ForCausalLM, "phi3", _PHI3_GGUF_NAMES, gguf_config=_windowed_gguf_config),
    "Qwen3MoeForCausalLM": Family(Qwen3MoeForCausalLM, "qwen3moe", _QWEN3MOE_GGUF_NAMES,
                                  gguf_config=_moe_gguf_config),
    "GptOssForCausalLM": Family(GptOssForCausalLM, "gpt-oss", _GPT_OSS_GGUF_NAMES, gguf_config=_gpt_oss_gguf_config),
}
assert set(FAMILIES) == set(SUPPORTED_ARCHITECTURES), "every supported architecture has a family, and only those"

# GGUF general.architecture -> HF architecture
GGUF_ARCHITECTURES = {f.gguf_architecture: arch for arch, f in FAMILIES.items() if f.gguf_architecture}


def family(architecture: str) -> Family:
    return FAMILIES[architecture]


def model_class(cfg: ModelConfig) -> type[CausalLM]:
    return FAMILIES[cfg.architecture].model_class


def gguf_tensor_name(architecture: str, name: str) -> str | None:
    """A GGUF tensor's HF name in the family ``architecture`` (HF's name), or None for a
    tensor the engine does not load."""
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    names = FAMILIES[architecture].gguf_names
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
    return None


def supported_text() -> str:
    return ", ".join(FAMILIES)
