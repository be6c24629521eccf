"""Measured choices are made once per machine and kept: a later start with noisy timings
gets the first start's plan; a change of CPU, torch or kernel source (the key) or an explicit
request measures again, and a re-measure keeps the stored winner through a close call."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from localllm.kernels import cpu_ops, measured


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh measured.json per test (the C++ library stays loaded from the user cache)."""
    cpu_ops.load()
    monkeypatch.setenv("LOCALLLM_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("LOCALLLM_REMEASURE", raising=False)
    return tmp_path


class Timer:
    """A measurement whose result the test sets, counting how often it ran."""

    def __init__(self, times: dict[str, float]) -> None:
        self.times = times
        self.calls = 0

    def __call__(self) -> dict[str, float]:
        self.calls += 1
        return dict(self.times)


def test_a_choice_is_measured_once_and_read_back(own_cache: Path) -> None:
    timer = Timer({"a": 1.0, "b": 2.0})
    first = measured.choose("x", ("shape=1",), timer)
    timer.times = {"a": 9.0, "b": 1.0}  # a later start under load: b would win by far
    second = measured.choose("x", ("shape=1",), timer)
    assert (first.winner, second.winner, timer.calls) == ("a", "a", 1)
    assert second.times == first.times and first.fresh and not second.fresh
    assert first.provenance() == second.provenance()  # one reason line on every start
    assert json.loads((own_cache / measured.FILE).read_text())["x"]["winner"] == "a"


def test_a_changed_key_measures_again(monkeypatch: pytest.MonkeyPatch) -> None:
    timer = Timer({"a": 1.0, "b": 2.0})
    measured.choose("x", ("shape=1",), timer)
    timer.times = {"a": 2.0, "b": 1.0}
    assert measured.choose("x", ("shape=2",), timer).winner == "b"  # another input of the caller
    monkeypatch.setattr(torch, "__version__", "99.0.0")  # another torch
    timer.times = {"a": 1.0, "b": 2.0}
    assert measured.choose("x", ("shape=2",), timer).winner == "a"
    monkeypatch.setattr(cpu_ops, "cpu_signature", lambda: "model name: another CPU")
    timer.times = {"a": 2.0, "b": 1.0}
    assert measured.choose("x", ("shape=2",), timer).winner == "b"
    assert timer.calls == 4


def test_a_requested_remeasure_flips_only_on_a_clear_win(monkeypatch: pytest.MonkeyPatch) -> None:
    timer = Timer({"a": 1.0, "b": 2.0})
    measured.choose("x", (), timer)
    monkeypatch.setenv("LOCALLLM_REMEASURE", "1")
    timer.times = {"a": 1.1, "b": 1.0}  # b ahead by 10%: within the margin, a stays
    assert measured.choose("x", (), timer).winner == "a"
    timer.times = {"a": 1.5, "b": 1.0}  # b ahead by 50%
    assert measured.choose("x", (), timer).winner == "b"
    assert timer.calls == 3


def test_a_first_measure_keeps_the_preferred_option_through_a_close_call() -> None:
    assert measured.choose("x", (), Timer({"kernel": 1.1, "torch": 1.0}), prefer="kernel").winner == "kernel"
    assert measured.choose("y", (), Timer({"kernel": 2.0, "torch": 1.0}), prefer="kernel").winner == "torch"


def test_a_damaged_file_counts_as_empty(own_cache: Path) -> None:
    (own_cache / measured.FILE).write_text("{not json")
    timer = Timer({"a": 1.0})
    assert measured.choose("x", (), timer).winner == "a" and timer.calls == 1
    assert measured.choose("x", (), timer).winner == "a" and timer.calls == 1
