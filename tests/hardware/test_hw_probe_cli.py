"""`localllm probe` end to end, and the probe on this machine (which has no NVIDIA driver)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from localllm.cli import main
from localllm.hardware.probe import MemoryMeter, cpus_for_threads, measure_bandwidth, probe_hardware

REPO = Path(__file__).resolve().parents[2]


def test_probe_hardware_never_raises_and_explains_a_missing_gpu() -> None:
    hw = probe_hardware()
    assert hw.cpu.logical_cores >= 1 and hw.ram_total_bytes > 0
    if hw.gpu is None:
        assert hw.device == "cpu"
        assert any(n.startswith("no NVIDIA GPU:") for n in hw.notes)
    json.dumps(hw.to_dict())


def test_probe_prints_a_cpu_profile_and_every_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["probe"]) == 0
    out = capsys.readouterr().out
    assert "Hardware" in out and "CPU" in out and "RAM" in out
    assert "smollm2-135m-instruct" in out and "llama-3.1-70b-instruct" in out


def test_probe_json_for_one_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["probe", "--json", "--model", "smollm2-135m-instruct"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema_version"] == 1
    assert set(doc) >= {"hardware", "bandwidth", "request", "models"}
    (row,) = doc["models"]
    assert row["id"] == "smollm2-135m-instruct" and row["status"] == "fits"
    assert row["kv_bytes_per_token"] in (46_080, 23_040)  # fp32 KV on CPU, bf16 on a GPU
    assert row["plan"]["max_model_len"] == 8192
    if doc["hardware"]["device"] == "cpu":
        assert row["plan"]["kv_dtype"] == "float32"


def test_probe_for_a_gpu_this_machine_lacks(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["probe", "--json", "--gpu", "RTX 4090", "--context", "32768", "--chats", "2"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["hardware"]["hypothetical"] and doc["hardware"]["device"] == "cuda"
    assert doc["bandwidth"] == {"gbs": 1008, "source": "GPU table"}
    rows = {r["id"]: r for r in doc["models"]}
    assert rows["llama-3.1-8b-instruct"]["precision"] == "fp8"
    assert rows["llama-3.1-8b-instruct"]["decode_tok_s_bound"] > 0
    assert rows["llama-3.1-70b-instruct"]["status"] == "does_not_fit"
    assert rows["llama-3.1-70b-instruct"]["suggestions"]
    assert rows["smollm2-135m-instruct"]["status"] == "error"  # 32K is beyond its 8K context


def test_probe_by_vram_alone(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["probe", "--json", "--vram", "12", "--model", "qwen3-8b"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["models"][0]["precision"] == "int8"  # 12 GiB, assumed sm86: no FP8 tensor cores


@pytest.mark.parametrize("quant", ["awq", "gguf"])
def test_probe_plans_llama_8b_on_a_4090_with_2_gib_held_by_the_desktop(
    quant: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["probe", "--gpu", "RTX 4090", "--vram-used", "2", "--model", "llama-3.1-8b-instruct", "--quant", quant]
    assert main([*args, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["hardware"]["gpus"][0]["free_bytes"] == 22 * 2**30 and doc["request"]["vram_used_gib"] == 2
    (row,) = doc["models"]
    plan = row["plan"]
    assert row["status"] == "fits" and plan["quant"] == quant and row["max_context"] >= 65_536
    assert plan["others_bytes"] == 2 * 2**30 and plan["reserve_bytes"] > 2**30
    assert 22 * 2**30 - plan["total_bytes"] >= plan["reserve_bytes"] + plan["margin_bytes"]
    if quant == "gguf":
        assert "published Q4_K_M file size" in row["reason"] and "Q4_K" in row["reason"]
    # The table run prints the plan's reasons: the budget, the reserve item by item.
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "2.0 GiB held by other processes" in out and "reserve for the engine's transients" in out
    assert "GEMM choice: torch candidate for gate_up_proj" in out and "Triton autotune" in out


def test_probe_sizes_a_gguf_file_from_its_tensors(default_model_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["probe", "--json", "--model", str(default_model_path)]) == 0
    (row,) = json.loads(capsys.readouterr().out)["models"]
    assert row["id"] == default_model_path.name and row["status"] == "fits"
    assert row["precision"] == "gguf" and "Q4_1 69% + Q8_0 31%" in row["reason"]
    # each type and what runs it, as the engine names them at load
    assert "gguf blocks as stored (int8-dot CPU kernels, no second rounding): Q4_1 x210, Q8_0 x1" in row["reason"]
    # the tensors as stored: token_embd's blocks are the tied head and the lookup table
    assert row["weight_bytes"] == 96_576_768


def test_probe_quant_gguf_sizes_a_catalog_model_as_its_q4_k_m(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["probe", "--json", "--quant", "gguf", "--model", "smollm2-135m-instruct"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["models"]
    # no published size for this one: llama.cpp's recipe, its 576-wide rows on Q5_0/Q8_0
    assert row["precision"] == "gguf" and "Q4_K_M recipe" in row["reason"] and "Q5_0" in row["reason"]


def _run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "localllm.cli", "probe", *args],
        capture_output=True, text=True, cwd=REPO, env={**os.environ, **(env or {})}, timeout=120,
    )


def test_probe_subprocess_exits_0_with_a_cpu_profile() -> None:
    result = _run_cli("--model", "smollm2-135m-instruct")
    assert result.returncode == 0, result.stderr
    assert "CPU" in result.stdout and "smollm2-135m-instruct" in result.stdout


@pytest.mark.parametrize("args, message", [
    (["--gpu", "RTX 9999"], "unknown GPU 'RTX 9999'"),
    (["--context", "-5"], "--context must be a positive"),
    (["--model", "nope"], "unknown catalog model 'nope'"),
    (["--chats", "0"], "--chats must be at least 1"),
    (["--vram", "0"], "--vram must be a positive"),
    (["--gpu", "H100", "--measure"], "--measure measures this machine"),
    (["--vram-used", "2"], "--vram-used describes a card named with --gpu or --vram"),
    (["--vram", "8", "--vram-used", "8"], "--vram-used 8 GiB is not less than the card's 8 GiB"),
    (["--gpu", "RTX 4090", "--vram-used", "-1"], "--vram-used must be 0 or more"),
    (["--model", "missing.gguf"], "missing.gguf: no such file"),
    (["--model", "missing.gguf", "--quant", "awq"], "--quant awq with a .gguf file"),
])
def test_bad_input_exits_2_with_one_line(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # main() is what the console script runs; the subprocess tests below cover the real process.
    assert main(["probe", *args]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("localllm: error:") and message in lines[0]
    assert "Traceback" not in captured.err and captured.out == ""


def test_malformed_models_toml_exits_2_with_one_line_and_no_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "models.toml"
    bad.write_text('[[model]]\nid = "x"\nhf_repo = "o/x"\n')
    result = _run_cli(env={"LOCALLLM_CATALOG": str(bad)})
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and str(bad) in lines[0] and "model 'x'" in lines[0]
    assert "Traceback" not in result.stderr


def test_measure_bandwidth_on_cpu() -> None:
    gbs = measure_bandwidth("cpu", nbytes=32 << 20, repeats=2)
    assert 0.1 < gbs < 10_000


def test_memory_meter_sees_touched_pages() -> None:
    # A fresh process: inside the suite, pages freed by earlier tests are reused without
    # growing RSS, which would hide the allocation.
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from localllm.hardware.probe import MemoryMeter\n"
        "with MemoryMeter('cpu') as meter:\n"
        "    t = torch.ones(64 << 20, dtype=torch.uint8)\n"
        "print(meter.actual_bytes)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout.strip()) >= 56 << 20


def test_cpus_for_threads_takes_one_cpu_per_physical_core_from_those_allowed() -> None:
    smt = lambda cpu: ("0", str(cpu % 4))  # noqa: E731 - 4 cores, siblings i and i + 4 (Linux's numbering)
    assert cpus_for_threads(4, set(range(8)), smt) == [0, 1, 2, 3]
    assert cpus_for_threads(2, set(range(8)), smt) == [0, 1]
    assert cpus_for_threads(2, {5, 6, 2}, smt) == [2, 5]  # 6 shares a core with 2: the lower one
    assert cpus_for_threads(3, {5, 6, 2}, smt) is None  # more threads than cores: the OS places them
    assert cpus_for_threads(5, set(range(8)), smt) is None
    assert cpus_for_threads(1, set(range(8)), smt) is None  # one thread: nothing to keep apart
    two_sockets = lambda cpu: (str(cpu // 2), "0")  # noqa: E731 - core ids repeat per package
    assert cpus_for_threads(2, {0, 1, 2, 3}, two_sockets) == [0, 2]


def test_cpus_for_threads_reads_this_machines_topology() -> None:
    allowed = os.sched_getaffinity(0)
    cpus = cpus_for_threads(2)
    if cpus is None:
        pytest.skip("fewer than two cores here")
    assert len(cpus) == 2 and set(cpus) <= allowed and cpus == sorted(cpus)
