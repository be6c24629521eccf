"""Tiny random Llama models written in HF layout, so the quantization tests run in seconds."""

from __future__ import annotations

import json
import os
from pathlib import Path

# Before torch loads OpenMP: on a shared 2-core machine its spin-waiting threads made this
# directory 15x slower (104 s against 7 s). Only effective when torch is not imported yet.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

VOCAB = 256 + 2  # every byte, plus <|im_start|> and <|im_end|>


def tiny_config(**over: object) -> dict[str, object]:
    cfg: dict[str, object] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
    }
    cfg.update(over)
    return cfg


def tiny_weights(cfg: dict[str, object], seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-named random weights. Values are fp16-representable, so a checkpoint written in fp16
    holds exactly the float model; outliers in a few input channels give AWQ something to do."""
    g = torch.Generator().manual_seed(seed)
    h, i, v = int(cfg["hidden_size"]), int(cfg["intermediate_size"]), int(cfg["vocab_size"])  # type: ignore[arg-type]
    nh, kvh, hd = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"]), int(cfg["head_dim"])  # type: ignore[arg-type]

    def rnd(*shape: int, std: float = 0.08) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).half().float()

    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rnd(v, h, std=1.0), "model.norm.weight": 1 + rnd(h)}
    for layer in range(int(cfg["num_hidden_layers"])):  # type: ignore[arg-type]
        p = f"model.layers.{layer}"
        norm = 1 + rnd(h, std=0.1)
        norm[:: max(1, h // 4)] *= 8  # salient input channels
        w[f"{p}.input_layernorm.weight"] = norm.half().float()
        w[f"{p}.post_attention_layernorm.weight"] = (1 + rnd(h, std=0.1)).half().float()
        w[f"{p}.self_attn.q_proj.weight"] = rnd(nh * hd, h)
        w[f"{p}.self_attn.k_proj.weight"] = rnd(kvh * hd, h)
        w[f"{p}.self_attn.v_proj.weight"] = rnd(kvh * hd, h)
        w[f"{p}.self_attn.o_proj.weight"] = rnd(h, nh * hd)
        w[f"{p}.mlp.gate_proj.weight"] = rnd(i, h)
        w[f"{p}.mlp.up_proj.weight"] = rnd(i, h)
        w[f"{p}.mlp.down_proj.weight"] = rnd(h, i)
        if cfg.get("attention_bias"):
            for n, size in (("q", nh * hd), ("k", kvh * hd), ("v", kvh * hd)):
                w[f"{p}.self_attn.{n}_proj.bias"] = rnd(size)
    if not cfg.get("tie_word_embeddings"):
        w["lm_head.weight"] = rnd(v, h, std=0.3)
    return w


def write_tokenizer(path: Path) -> None:
    """A byte-level BPE without merges: one token per byte, plus ChatML markers."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(path / "tokenizer.json"))
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": template, "eos_token": "<|im_end|>", "add_bos_token": False})
    )


def write_hf_model(path: Path, cfg: dict[str, object], tensors: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    write_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = tiny_config()
    return write_hf_model(tmp_path_factory.mktemp("tiny") / "float", cfg, tiny_weights(cfg))


@pytest.fixture(scope="session")
def calib_text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    g = torch.Generator().manual_seed(1)
    words = ["the", "model", "weights", "are", "quantized", "to", "four", "bits", "and", "scales", "grow", "small"]
    text = " ".join(words[int(i)] for i in torch.randint(0, len(words), (600,), generator=g))
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text(text)
    return path
