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
