from __future__ import annotations

import json
from pathlib import Path

import pytest

from localllm.cli import main
from localllm.quant.eval import ModeResult, quality_gates, windows_of


def test_eval_cli_json(tiny_model: Path, calib_text: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "eval.txt"
    text.write_text("Quantization keeps the weights small and the answers the same. " * 6)
    argv = ["eval", str(tiny_model), "--text", str(text), "--quant", "none,int8,fp8,rtn4,awq", "--calib",
            str(calib_text), "--window", "64", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    by = {r["mode"]: r for r in report["results"]}
    assert list(by) == ["none", "int8", "fp8", "rtn4", "awq"]
    assert report["windows"] == report["tokens"] // 64 == 5 and report["group_size"] == 64 and report["calib_tokens"] > 0
    none = by["none"]
    assert none["delta_pct"] == 0 and none["agreement"] > 0.95  # batched decode vs prefill: same tokens
    for mode in ("int8", "fp8", "rtn4", "awq"):
        r = by[mode]
        assert r["perplexity"] > 1 and 0 <= r["agreement"] <= 1 and r["decode_tok_s"] > 0
        assert r["weight_bytes"] < none["weight_bytes"]
    assert by["rtn4"]["weight_bytes"] < by["int8"]["weight_bytes"]
    assert set(report["gates"]) == {"awq <= 60% of rtn4 increase", "int8 within 1%", "fp8 within 2%"}


def test_windows_and_gates() -> None:
    assert windows_of(list(range(10)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert windows_of(list(range(3)), 8) == [[0, 1, 2]]

    def r(mode: str, delta: float) -> ModeResult:
        return ModeResult(mode, 10.0, delta, 1, 1.0, 1.0, 1.0, 0.0)

    gates = quality_gates([r("none", 0), r("rtn4", 10.0), r("awq", 5.0), r("int8", 0.5), r("fp8", 2.5)])
    assert gates["awq <= 60% of rtn4 increase"] == {"value": 0.5, "pass": True}
    assert gates["int8 within 1%"]["pass"] and not gates["fp8 within 2%"]["pass"]


def test_eval_measures_kv_cache_dtypes(tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "eval.txt"
    text.write_text("An FP8 cache keeps three mantissa bits of every key and value. " * 6)
    argv = ["eval", str(tiny_model), "--text", str(text), "--quant", "none", "--window", "64", "--json",
            "--kv-cache-dtype", "float32,bfloat16,fp8"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    rows = report["results"]
    assert [(r["mode"], r["kv_cache_dtype"], r["kv_scales"]) for r in rows] == [
        ("none", "float32", None), ("none", "bfloat16", None), ("none", "fp8", "1.0")]
    fp32, bf16, fp8 = (r["perplexity"] for r in rows)
    assert rows[0]["delta_pct"] == 0 and fp8 != fp32 and abs(rows[2]["delta_pct"]) < 10
    gate = report["gates"]["fp8 KV within 1% of the bfloat16 cache"]
    assert gate["value"] == pytest.approx(100 * (fp8 / bf16 - 1))

    assert main([*argv[:-1], "fp8_e4m3", "--calculate-kv-scales"]) == 0
    (calibrated,) = json.loads(capsys.readouterr().out)["results"]
    assert (calibrated["kv_cache_dtype"], calibrated["kv_scales"]) == ("fp8", "calibrated")
    assert calibrated["perplexity"] != fp8  # the scales changed what the cache holds


def test_eval_rejects_an_unknown_kv_cache_dtype(tiny_model: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "eval.txt"
    text.write_text("words " * 50)
    assert main(["eval", str(tiny_model), "--text", str(text), "--kv-cache-dtype", "auto,int4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("localllm: error: --kv-cache-dtype 'auto,int4': use a comma-separated list of auto, fp8")
