"""Measured choices are made once per machine and kept: a later start with noisy timings
gets the first start's plan; a change of CPU, torch or kernel source (the key) or an explicit
request measures again, and a re-measure keeps the stored winner through a close call."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from localllm.kernels import cpu_ops, measured
from localllm.models.loader import Checkpoint


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


@pytest.mark.skipif(not cpu_ops.has_gguf_kernels(), reason="GGUF kernels need an x86-64-v3 CPU")
def test_the_same_model_gets_the_same_plan_on_every_start(
    default_checkpoint: Checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loader's choice (``measure_cpu_choice`` feeding the planner) on two starts, the
    second with timings where bf16 wins by far (a start beside a busy program): one plan."""
    from localllm.hardware.planner import plan as make_plan
    from localllm.hardware.probe import probe_hardware
    from localllm.quant import gguf

    hw = replace(probe_hardware(), gpus=())

    def start() -> tuple[str | None, str, list[str]]:
        why = gguf.measure_cpu_choice(default_checkpoint.block_types)
        p = make_plan(default_checkpoint.config, hw, chats=4, cpu_gguf=why, name="default")
        return p.quant, p.weight_dtype, list(p.reasons)

    # the first start measures for real, then its choice is pinned to the kernel so the
    # test does not depend on this machine's figures
    monkeypatch.setattr(gguf, "_time_options", Timer({"gguf": 40e-6, "bf16": 170e-6, "fp32": 140e-6}))
    first = start()
    assert first[0] == "gguf" and any("kept; LOCALLLM_REMEASURE=1" in r for r in first[2])
    noisy = Timer({"gguf": 12e-3, "bf16": 1e-4, "fp32": 1e-4})
    monkeypatch.setattr(gguf, "_time_options", noisy)
    assert start() == first and noisy.calls == 0
    monkeypatch.setenv("LOCALLLM_REMEASURE", "1")  # asked for: the clear win now counts
    assert start()[0] != "gguf" and noisy.calls == 1


@pytest.mark.skipif(not cpu_ops.has_gguf_kernels(), reason="GGUF kernels need an x86-64-v3 CPU")
def test_the_real_timing_names_all_three_options() -> None:
    from localllm.quant import gguf

    threads = torch.get_num_threads()
    times = gguf._time_options()
    assert set(times) == {"gguf", "bf16", "fp32"} and all(0 < t < 1 for t in times.values())
    assert torch.get_num_threads() == threads  # timed on one thread, then given back
