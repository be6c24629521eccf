"""Writing a checkpoint as an HF folder that ``open_checkpoint`` and transformers both read:
a GGUF as a plain fp32 export, or a quantized model's packed tensors (``quant.checkpoint``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from localllm.models.checkpoint import Checkpoint, WeightIter
from localllm.models.llama import SUPPORTED_ARCHITECTURES


def save_hf_folder(
    ckpt: Checkpoint, out: Path, tensors: WeightIter | None = None, extra_config: dict[str, Any] | None = None
) -> None:
    """Writes an HF folder (config.json, model.safetensors, tokenizer files) that
    ``open_checkpoint`` and transformers both read. ``tensors`` defaults to the checkpoint's
    own weights (a GGUF becomes a plain fp32 HF export); quantizers pass their packed tensors
    and ``extra_config`` (e.g. ``quantization_config``)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    cfg = ckpt.config
    hf = {
        "architectures": [cfg.architecture],
        "model_type": SUPPORTED_ARCHITECTURES[cfg.architecture],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling, "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings, "attention_bias": cfg.qkv_bias,
        "hidden_act": "silu", "torch_dtype": "float32",
        # a window is written so that both readers cap the context there (see ModelConfig)
        "sliding_window": cfg.sliding_window, "use_sliding_window": cfg.sliding_window is not None,
        "max_window_layers": 0,
        "bos_token_id": ckpt.tokenizer.bos_token_id,
        "eos_token_id": list(ckpt.tokenizer.eos_token_ids),
    }
    if cfg.partial_rotary_factor != 1:  # Phi-4-mini's RoPE on part of each head
        hf["partial_rotary_factor"] = cfg.partial_rotary_factor
    hf.update(extra_config or {})
    hf["dtype"] = hf["torch_dtype"]  # transformers 5 reads dtype; older ones torch_dtype
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    tok = ckpt.tokenizer
    tok.backend.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": tok.chat_template, "bos_token": tok.bos_token, "eos_token": tok.eos_token,
        "add_bos_token": tok.add_bos, "add_eos_token": tok.add_eos,
    }, indent=2))
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": tok.bos_token_id, "eos_token_id": list(tok.eos_token_ids),
    }, indent=2))
    state = {name: t.contiguous() for name, t in (tensors if tensors is not None else ckpt.weights())}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    # safetensors creates the file 0600; give it the mode any file written here gets
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(out / "model.safetensors", 0o666 & ~umask)
