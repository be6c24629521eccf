"""Small random models in HF layout, written by the tests: Qwen2 (qkv bias), Qwen3 (q/k norm),
Llama 3.1 (llama3 rope scaling, untied head), each against the plain reference pass."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from localllm import LLM, SamplingParams
from localllm.models.formats import open_checkpoint
from tests.reference import hf_state_dict, reference_greedy, reference_logits

VOCAB = 49152  # reuses the default model's tokenizer


def write_random_model(out: Path, arch: str, tokenizer_src: Path, *, heads: int = 4, kv_heads: int = 2,
                       head_dim: int = 16, hidden: int = 64, layers: int = 2, tied: bool = True,
                       rope_scaling: dict | None = None, seed: int = 0, vocab: int = VOCAB,
                       config: dict | None = None) -> Path:
    """``vocab`` above the tokenizer's pads the embedding, as many checkpoints do. ``config``
    replaces keys of the written config.json (None values delete them)."""
    g = torch.Generator().manual_seed(seed)
    inter = 96
    qkv_bias = arch == "Qwen2ForCausalLM"
    cfg = {
        "architectures": [arch], "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": inter,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 512,
        "tie_word_embeddings": tied, "rope_scaling": rope_scaling,
    }
    for key, value in (config or {}).items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    def rand(*shape: int, scale: float = 0.08) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rand(vocab, hidden, scale=0.5),
                                   "model.norm.weight": 1 + rand(hidden)}
    if not tied:
        sd["lm_head.weight"] = rand(vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        sd[p + "self_attn.q_proj.weight"] = rand(heads * head_dim, hidden)
        sd[p + "self_attn.k_proj.weight"] = rand(kv_heads * head_dim, hidden)
        sd[p + "self_attn.v_proj.weight"] = rand(kv_heads * head_dim, hidden)
        sd[p + "self_attn.o_proj.weight"] = rand(hidden, heads * head_dim)
        if qkv_bias:
            for n, rows in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                sd[p + f"self_attn.{n}_proj.bias"] = rand(rows * head_dim, scale=0.5)
        if arch == "Qwen3ForCausalLM":
            sd[p + "self_attn.q_norm.weight"] = 1 + rand(head_dim)
            sd[p + "self_attn.k_norm.weight"] = 1 + rand(head_dim)
        sd[p + "mlp.gate_proj.weight"] = rand(inter, hidden)
        sd[p + "mlp.up_proj.weight"] = rand(inter, hidden)
        sd[p + "mlp.down_proj.weight"] = rand(hidden, inter)
        sd[p + "input_layernorm.weight"] = 1 + rand(hidden)
        sd[p + "post_attention_layernorm.weight"] = 1 + rand(hidden)
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(cfg))
    save_file(sd, str(out / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tokenizer_src / name, out / name)
    return out


@pytest.fixture(scope="module")
def tokenizer_folder(default_checkpoint, tmp_path_factory) -> Path:
    from localllm.models.export import save_hf_folder

    folder = tmp_path_factory.mktemp("tok")
    default_checkpoint.tokenizer.backend.save(str(folder / "tokenizer.json"))
    save_hf_folder(default_checkpoint, folder, tensors=iter([]))
    return folder


CASES = {
    "qwen2": dict(arch="Qwen2ForCausalLM"),
    "qwen3": dict(arch="Qwen3ForCausalLM", heads=8, kv_heads=1),
    "llama31": dict(arch="LlamaForCausalLM", tied=False, heads=6, kv_heads=2,
                    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "mistral": dict(arch="MistralForCausalLM", heads=4, kv_heads=4, tied=False),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_random_model_matches_reference(case: str, tokenizer_folder: Path, tmp_path: Path) -> None:
    path = write_random_model(tmp_path / case, tokenizer_src=tokenizer_folder, **CASES[case])
    ckpt = open_checkpoint(path)
    weights = hf_state_dict(ckpt)
    llm = LLM(str(path), dtype="float32", device="cpu", max_model_len=256)
    prompts = [[5, 17, 300, 42, 9000, 12], list(range(100, 140))]  # the second crosses a block
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == reference_greedy(ckpt.config, weights, prompt, 24)
    # logits too, within fp32 tolerance, over a prompt long enough for rope scaling to matter
    ids = list(range(200, 300))
    got = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, logprobs=5))[0]
    want = torch.log_softmax(reference_logits(ckpt.config, weights, ids)[-1], -1)
    for token, logprob in got.outputs[0].logprobs[0].items():
        assert abs(logprob - float(want[token])) < 1e-3
