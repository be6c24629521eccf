"""Llama and the families that are Llama with a flag: Llama 2/3/3.1/3.2, SmolLM2, Mistral and
Ministral (a sliding window), Qwen2 (qkv bias, windows on some layers) and Qwen3 (q/k RMSNorm).
Their checkpoints name every tensor as models/layers.py does, so the class adds nothing.

The shared names are imported here too, for the modules that took them from this file.
"""

from __future__ import annotations

from localllm.models.config import SUPPORTED_ARCHITECTURES, TEXT_MODEL_TYPES, ModelConfig
from localllm.models.layers import (
    _STACKED,
    FP8_KV_DTYPES,
    Attention,
    AttentionMetadata,
    CausalLM,
    DecoderLayer,
    DecoderModel,
    key_rotation,
    kv_scale_tensor,
    rope_cos_sin,
)

__all__ = [
    "FP8_KV_DTYPES", "SUPPORTED_ARCHITECTURES", "TEXT_MODEL_TYPES", "_STACKED", "Attention", "AttentionMetadata",
    "CausalLM", "DecoderLayer", "DecoderModel", "LlamaForCausalLM", "ModelConfig", "key_rotation",
    "kv_scale_tensor", "rope_cos_sin",
]


class LlamaForCausalLM(CausalLM):
    """Llama, Mistral, Qwen2, Qwen3: the shared decoder as the config sets it up."""
