"""Gemma 3's text model (270M to 27B; the text half of Gemma3ForConditionalGeneration).

What differs from Llama is all configuration (models/config.py reads it): 5 of 6 layers
attend through a sliding window (``layer_types``), head_dim 256, GELU's tanh form in the
MLP, four norms per block in the ``1 + w`` form, q/k RMSNorm, embeddings scaled by
sqrt(hidden), attention scaled by query_pre_attn_scalar, and the sliding layers' own RoPE base.
Its checkpoints use the shared names, with two more norms per block.
"""

from __future__ import annotations

from localllm.models.layers import CausalLM


class Gemma3ForCausalLM(CausalLM):
    """Gemma 3 text: the shared decoder with Gemma's settings."""
