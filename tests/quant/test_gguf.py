"""GGUF blocks carried into the CPU plan as they are: on the default model (Q4_1 linears,
a Q8_0 embedding tied to the head), every weight the kernels compute with equals the file's
own dequantized weight, and the plan says why it chose them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from localllm.kernels import cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.has_gguf_kernels(), reason="GGUF kernels need an x86-64-v3 CPU")


def test_default_model_keeps_the_files_blocks(default_model_path: Path) -> None:
    from localllm.models.gguf_file import dequantize, read_gguf, unpermute
    from localllm.models.loader import load_model
    from localllm.quant.gguf import GGUFLinear

    loaded = load_model(str(default_model_path), device="cpu")
    assert loaded.plan.quant == "gguf" and loaded.precision == "gguf-q4_1/q8_0"
    assert any("no second rounding" in r for r in loaded.plan.reasons)
    assert loaded.notes == ()  # every linear keeps the file's Q4_1/Q8_0 blocks: nothing requantized
    model = loaded.model
    _, tensors = read_gguf(default_model_path)

    def file_weight(name: str) -> torch.Tensor:
        return torch.from_numpy(dequantize(tensors[name], default_model_path))

    cfg = model.config
    for i in (0, cfg.num_layers - 1):
        attn, mlp = model.model.layers[i].self_attn, model.model.layers[i].mlp
        assert isinstance(attn.qkv_proj, GGUFLinear) and attn.qkv_proj.block_type == 3  # Q4_1
        qkv = torch.cat([unpermute(file_weight(f"blk.{i}.attn_q.weight"), cfg.num_heads),
                         unpermute(file_weight(f"blk.{i}.attn_k.weight"), cfg.num_kv_heads),
                         file_weight(f"blk.{i}.attn_v.weight")])
        assert torch.equal(attn.qkv_proj.dequantize(), qkv)
        gate_up = torch.cat([file_weight(f"blk.{i}.ffn_gate.weight"), file_weight(f"blk.{i}.ffn_up.weight")])
        assert torch.equal(mlp.gate_up_proj.dequantize(), gate_up)
        assert torch.equal(mlp.down_proj.dequantize(), file_weight(f"blk.{i}.ffn_down.weight"))
    # the tied head runs on token_embd's Q8_0 blocks; the lookup table holds the same values
    embd = file_weight("token_embd.weight")
    rows = torch.tensor([0, 1, 2, 504, 49151])
    assert isinstance(model.lm_head, GGUFLinear) and model.lm_head.block_type == 8
    assert torch.equal(model.lm_head.dequantize_rows(rows), embd[rows])
    assert torch.equal(model.model.embed_tokens(rows), embd[rows])  # the lookup reads the same blocks


def test_gguf_plan_answers_like_fp32_activations(default_model_path: Path) -> None:
    """Two-level int8 activations keep greedy decoding on the fp32-activation answer."""
    from localllm import LLM, SamplingParams

    llm = LLM(str(default_model_path), device="cpu", compile=False)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=12))
    assert out[0].outputs[0].text.startswith("The capital of France is Paris.")
