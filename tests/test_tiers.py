"""The cost tiers: tests/tiers.py's matrix and the markers tests/conftest.py infers."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiers import matrix


def test_matrix_marks_what_ci_leaves_out_and_refuses_an_unknown_ci_case() -> None:
    cases = matrix(["qwen2", "qwen3", "llama"], ci=["qwen3"])
    assert [c.values for c in cases] == [("qwen2",), ("qwen3",), ("llama",)]
    assert [[m.name for m in c.marks] for c in cases] == [["full"], [], ["full"]]
    two = matrix([("llama", "fp32"), ("qwen2", "fp16")], ci=[("llama", "fp32")])
    assert two[0].values == ("llama", "fp32") and [m.name for m in two[1].marks] == ["full"]
    with pytest.raises(ValueError, match=r"CI cases \['qwen4'\] are not among the values"):
        matrix(["qwen2", "qwen3"], ci=["qwen4"])


def test_a_test_without_costs_is_a_unit_test(request: pytest.FixtureRequest) -> None:
    names = {m.name for m in request.node.iter_markers()}
    assert "unit" in names and not names & {"model", "compile", "interpreter", "subprocess", "slow"}


def test_the_default_model_fixture_makes_a_model_test(request: pytest.FixtureRequest,
                                                      default_model_path: Path) -> None:
    names = {m.name for m in request.node.iter_markers()}
    assert "model" in names and "unit" not in names and default_model_path.suffix == ".gguf"


def _helper_that_starts_a_process() -> None:
    import subprocess
    import sys

    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_a_process_started_in_a_helper_makes_a_subprocess_test(request: pytest.FixtureRequest) -> None:
    _helper_that_starts_a_process()
    assert request.node.get_closest_marker("subprocess") is not None


def test_the_full_matrix_runs_only_when_asked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.conftest import FULL_MATRIX_ENV, full_matrix

    asked = full_matrix(request.config)
    if not asked:  # this very run: every case marked full was deselected
        assert not any(item.get_closest_marker("full") for item in request.session.items)
    monkeypatch.setenv(FULL_MATRIX_ENV, "1")
    assert full_matrix(request.config)
    monkeypatch.setenv(FULL_MATRIX_ENV, "0")
    assert full_matrix(request.config) == ("full" in (request.config.getoption("markexpr") or ""))
