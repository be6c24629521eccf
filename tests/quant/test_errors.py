"""Bad input gets one line that names the file or value and the fix; the CLI exits 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from localllm.cli import main
from localllm.errors import LocalLLMError
from localllm.models.formats import open_checkpoint
from localllm.models.loader import build_model
from localllm.quant import prepare_for_checkpoint, quantize_model
from localllm.quant.checkpoint import save_quantized

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def awq_dir(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    ckpt = open_checkpoint(tiny_model)
    model = build_model(ckpt, torch.float32, CPU, 256)
    quantize_model(model, "rtn4", group_size=32)
    return save_quantized(model, ckpt, tmp_path_factory.mktemp("awq") / "m", "rtn4", 32)


def _copy(src: Path, dst: Path, config: dict | None = None, drop: str | None = None) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    if config is not None:
        cfg = json.loads((src / "config.json").read_text())
        cfg["quantization_config"].update(config)
        (dst / "config.json").write_text(json.dumps(cfg))
    if drop is not None:
        tensors = load_file(str(src / "model.safetensors"))
        del tensors[drop]
        save_file(tensors, str(dst / "model.safetensors"))
    return dst


def _load(path: Path) -> None:
    ckpt = open_checkpoint(path)
    build_model(ckpt, torch.float32, CPU, 64, quantize=lambda m: prepare_for_checkpoint(m, ckpt.config.quantization))


def _one_line(e: pytest.ExceptionInfo[LocalLLMError], *needles: str) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert n in msg, msg
    return msg


def test_config_group_size_disagrees_with_tensors(awq_dir: Path, tmp_path: Path) -> None:
    bad = _copy(awq_dir, tmp_path / "g16", config={"group_size": 16})
    with pytest.raises(LocalLLMError) as e:
        _load(bad)
    _one_line(e, "group size 32", "group_size is 16", "config.json")


def test_config_group_size_does_not_divide_input(awq_dir: Path, tmp_path: Path) -> None:
    bad = _copy(awq_dir, tmp_path / "g48", config={"group_size": 48})
    with pytest.raises(LocalLLMError) as e:
        _load(bad)
    _one_line(e, "group_size 48", "input dim 64")


@pytest.mark.parametrize("tensor", ["model.layers.1.mlp.down_proj.scales", "model.layers.0.self_attn.k_proj.scales"])
def test_missing_scale_tensor(awq_dir: Path, tmp_path: Path, tensor: str) -> None:
    bad = _copy(awq_dir, tmp_path / "missing", drop=tensor)
    with pytest.raises(LocalLLMError) as e:
        _load(bad)
    module = tensor.rsplit(".", 1)[0].replace("k_proj", "qkv_proj")
    _one_line(e, "lacks 1 tensors", f"{module}.scales")


def test_missing_fp8_weight_scale(tiny_model: Path, tmp_path: Path) -> None:
    ckpt = open_checkpoint(tiny_model)
    model = build_model(ckpt, torch.float32, CPU, 256)
    quantize_model(model, "fp8")
    out = save_quantized(model, ckpt, tmp_path / "fp8", "fp8", None)
    bad = _copy(out, tmp_path / "fp8-bad", drop="model.layers.0.mlp.down_proj.weight_scale")
    with pytest.raises(LocalLLMError) as e:
        _load(bad)
    _one_line(e, "down_proj.weight_scale")


@pytest.mark.parametrize("config,needle", [
    ({"quant_method": "gptq"}, "'gptq' is not supported"),
    ({"version": "gemv"}, "'gemv' is not supported"),
    ({"bits": 3}, "bits=3"),
])
def test_unsupported_checkpoint_configs(awq_dir: Path, tmp_path: Path, config: dict, needle: str) -> None:
    bad = _copy(awq_dir, tmp_path / "cfg", config=config)
    with pytest.raises(LocalLLMError) as e:
        _load(bad)
    _one_line(e, needle, "config.json")


def test_unknown_method_in_api(tiny_model: Path) -> None:
    model = build_model(open_checkpoint(tiny_model), torch.float32, CPU, 64)
    with pytest.raises(LocalLLMError) as e:
        quantize_model(model, "int3")
    _one_line(e, "'int3'", "int8", "awq")



def test_awq_without_calibration_rounds_to_nearest(tiny_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = open_checkpoint(tiny_model)
    awq, rtn = (build_model(ckpt, torch.float32, CPU, 64) for _ in range(2))
    quantize_model(awq, "awq")
    quantize_model(rtn, "rtn4")
    assert "rounds to nearest" in capsys.readouterr().err
    assert torch.equal(awq.model.layers[0].mlp.down_proj.qweight, rtn.model.layers[0].mlp.down_proj.qweight)


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    last = err.splitlines()[-1]  # progress lines may come before it
    assert last.startswith("localllm: error: ") and "Traceback" not in err, err
    return last


def test_cli_unknown_method(tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _cli(["quantize", str(tiny_model), "--method", "int3", "-o", str(tmp_path / "x")], capsys)
    assert "'int3'" in err


def test_cli_group_size_mismatch(tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _cli(["quantize", str(tiny_model), "--method", "rtn4", "--group-size", "48", "-o", str(tmp_path / "x")],
               capsys)
    assert "--group-size 48" in err and "use 64" in err


def test_cli_eval_bad_quant_and_same_calib(tiny_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = tiny_model / "config.json"
    assert "'fp4'" in _cli(["eval", str(tiny_model), "--text", str(text), "--quant", "none,fp4"], capsys)
    err = _cli(["eval", str(tiny_model), "--text", str(text), "--quant", "awq", "--calib", str(text)], capsys)
    assert "same file" in err
    assert "cannot be read" in _cli(["eval", str(tiny_model), "--text", "/no/such.txt", "--quant", "int8"], capsys)


def test_cli_quantize_prequantized_model(awq_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "already quantized" in _cli(["quantize", str(awq_dir), "--method", "int8", "-o", str(tmp_path / "y")],
                                       capsys)
