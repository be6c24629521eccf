"""Writing quantized checkpoints and loading them (ours, and published formats built by hand)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from localllm.cli import main
from localllm.models.llama import LlamaForCausalLM
from localllm.models.formats import open_checkpoint
from localllm.models.loader import build_model
from localllm.quant import prepare_for_checkpoint, prepare_online, quantize_model
from localllm.quant.checkpoint import save_quantized
from localllm.quant.eval import calibration_samples
from localllm.quant.forward import greedy_generate, prefill_logits
from localllm.quant.fp8 import quantize_fp8_per_channel

from .conftest import tiny_config, tiny_weights, write_hf_model

CPU = torch.device("cpu")
PROMPT = [72, 101, 108, 108, 111, 44, 32, 119]


def load(path: Path) -> LlamaForCausalLM:
    ckpt = open_checkpoint(path)
    swap = (lambda m: prepare_for_checkpoint(m, ckpt.config.quantization)) if ckpt.config.quantization else None
    return build_model(ckpt, torch.float32, CPU, 256, quantize=swap)


def tokens(model: LlamaForCausalLM) -> list[int]:
    return greedy_generate(model, [PROMPT], 24).tokens[0]


@pytest.mark.parametrize("method", ["awq", "rtn4", "int8", "int8-w8a8", "fp8"])
def test_written_checkpoint_reproduces_in_memory_model(method: str, tiny_model: Path, calib_text: Path,
                                                       tmp_path: Path) -> None:
    ckpt = open_checkpoint(tiny_model)
    model = build_model(ckpt, torch.float32, CPU, 256)
    calib = calibration_samples(ckpt.tokenizer, calib_text, 2048) if method == "awq" else None
    quantize_model(model, method, calib=calib)
    group = 64 if method in ("awq", "rtn4") else None
    out = save_quantized(model, ckpt, tmp_path / method, method, group, torch.float32)
    reloaded = load(out)
    assert torch.equal(prefill_logits(reloaded, PROMPT), prefill_logits(model, PROMPT))
    assert tokens(reloaded) == tokens(model)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    if method in ("awq", "rtn4"):  # AutoAWQ's names, un-fused
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            assert {f"model.layers.0.self_attn.{proj}.{t}" for t in ("qweight", "qzeros", "scales")} <= names
        assert "model.layers.1.mlp.up_proj.qweight" in names
    else:
        assert {"model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.k_proj.weight_scale"} <= names
    assert "lm_head.weight" in names  # kept in float


def test_quantize_cli_writes_a_loadable_folder(tiny_model: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rtn4"
    assert main(["quantize", str(tiny_model), "--method", "rtn4", "--group-size", "32", "-o", str(out)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
                                          "version": "gemm"}
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
    # tiny_model's floats are fp16-representable and rtn4 leaves the norms alone, so the
    # fp16 checkpoint holds exactly the in-memory quantized model
    ckpt = open_checkpoint(tiny_model)
    model = build_model(ckpt, torch.float32, CPU, 256)
    quantize_model(model, "rtn4", group_size=32)
    assert tokens(load(out)) == tokens(model)


def test_online_quantization_at_load_matches_in_place(tiny_model: Path) -> None:
    ckpt = open_checkpoint(tiny_model)
    seen: list[tuple[int, int]] = []
    online = build_model(ckpt, torch.float32, CPU, 256, progress=lambda d, t: seen.append((d, t)),
                         quantize=lambda m: prepare_online(m, "int8"))
    assert seen[-1] == (ckpt.num_tensors, ckpt.num_tensors)
    in_place = build_model(ckpt, torch.float32, CPU, 256)
    quantize_model(in_place, "int8")
    assert torch.equal(prefill_logits(online, PROMPT), prefill_logits(in_place, PROMPT))


def _compressed_tensors_fp8(tmp_path: Path, strategy: str, static: bool) -> tuple[Path, dict[str, torch.Tensor]]:
    """A tiny checkpoint in the RedHatAI ``*-FP8-dynamic`` layout, and the float weights it
    dequantizes to."""
    cfg = tiny_config(torch_dtype="bfloat16")
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor" if static else "token",
                                  "symmetric": True, "dynamic": not static},
        }},
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }
    floats = tiny_weights(cfg, seed=3)
    tensors: dict[str, torch.Tensor] = {}
    dequant: dict[str, torch.Tensor] = {}
    for name, w in floats.items():
        if not name.endswith("_proj.weight"):
            tensors[name] = w.bfloat16()
            dequant[name] = w.bfloat16().float()
            continue
        q, s = quantize_fp8_per_channel(w)
        if strategy == "tensor":  # one scale per shard: each shard of a fused module differs
            s_t = w.abs().max() / 448
            q, s = (w / s_t).to(torch.float8_e4m3fn), s_t.reshape(1)
        tensors[name] = q
        tensors[name + "_scale"] = s.reshape(-1, 1) if strategy == "channel" else s
        if static:
            tensors[name.replace(".weight", ".input_scale")] = torch.tensor([0.05])
        dequant[name] = q.float() * s.reshape(-1, 1)
    return write_hf_model(tmp_path / f"fp8-{strategy}", cfg, tensors), dequant


@pytest.mark.parametrize("strategy,static", [("channel", False), ("tensor", True)])
def test_loads_compressed_tensors_fp8(strategy: str, static: bool, tmp_path: Path) -> None:
    path, dequant = _compressed_tensors_fp8(tmp_path, strategy, static)
    model = load(path)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert type(qkv).__name__ == "FP8Linear" and qkv.weight.dtype == torch.float8_e4m3fn
    assert qkv.has_input_scale == static
    assert type(model.lm_head).__name__ == "Linear"  # ignored by the config
    ref = write_hf_model(tmp_path / "ref", tiny_config(), dequant)
    ref_logits = prefill_logits(load(ref), PROMPT)
    got = prefill_logits(model, PROMPT)
    assert torch.allclose(got, ref_logits, atol=1e-4 * ref_logits.abs().max().item())


def test_quantize_cli_awq_folds_scales_and_reloads(tiny_model: Path, calib_text: Path, tmp_path: Path) -> None:
    out = tmp_path / "awq"
    assert main(["quantize", str(tiny_model), "--method", "awq", "--calib", str(calib_text), "-o", str(out)]) == 0
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        norm = f.get_tensor("model.layers.0.input_layernorm.weight")
        assert f.get_tensor("model.layers.0.self_attn.q_proj.scales").dtype == torch.float16
    with safe_open(str(tiny_model / "model.safetensors"), "pt") as f:
        original = f.get_tensor("model.layers.0.input_layernorm.weight")
    assert not torch.allclose(norm.float(), original, rtol=1e-2)  # the activation-aware scales live here
    model = load(out)
    assert len(tokens(model)) == 24
