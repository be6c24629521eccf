"""The on-disk tuning store (``localllm.kernels.tuning``) under a GPU identity this machine does
not have: autotune picks and GEMM backend choices written by one "start" are read back from
the file by the next, per GPU, and a damaged file or a config no longer offered means "tune
again", never a wrong launch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from localllm.kernels import _triton, tuning

triton = pytest.importorskip("triton")
RTX_4090: tuning.Identity = ("NVIDIA GeForce RTX 4090", 8, 9)
H200: tuning.Identity = ("NVIDIA H200", 9, 0)


@pytest.fixture(autouse=True)
def _fresh_store(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(tuning, "compiled_cache_dir", lambda: tmp_path)
    monkeypatch.setattr(tuning, "_stores", {})


def _new_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tuning, "_stores", {})  # what the next start has: only the file


def test_autotune_picks_persist_per_gpu_and_a_miss_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    configs = [triton.Config({"BLOCK_N": 64}, num_warps=4, num_stages=3),
               triton.Config({"BLOCK_N": 128}, num_warps=8, num_stages=2)]  # fmt: skip
    key = (1, 4096, 14336, "torch.float16", "torch.int32")
    misses: list[int] = []
    cache = tuning.PersistentConfigs("_awq_gemm_kernel", configs, lambda: RTX_4090)
    with tuning.reporting(lambda: misses.append(1)):
        assert key not in cache  # what Triton's Autotuner asks before tuning
        cache[key] = configs[1]  # what it stores after
        assert key in cache
    assert misses == [1]
    path = tuning.store_path(RTX_4090)
    assert path.is_file() and path != tuning.store_path(H200)

    _new_process(monkeypatch)
    again = tuning.PersistentConfigs("_awq_gemm_kernel", configs, lambda: RTX_4090)
    with tuning.reporting(lambda: misses.append(1)):
        assert key in again and again[key] is configs[1]
    assert misses == [1]  # no tuning on the second start
    other_gpu = tuning.PersistentConfigs("_awq_gemm_kernel", configs, lambda: H200)
    assert key not in other_gpu
    changed = tuning.PersistentConfigs("_awq_gemm_kernel", configs[:1], lambda: RTX_4090)
    assert key not in changed  # the stored pick is no longer offered: tune again


def test_a_damaged_store_reads_as_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    tuning.store(RTX_4090).put_gemm("('awq', 1)", "torch")
    path = tuning.store_path(RTX_4090)
    path.write_text('{"gemm": {"(\'awq\', 1)": "tor')  # cut short
    _new_process(monkeypatch)
    assert tuning.store(RTX_4090).gemm == {}


def test_a_saved_gemm_choice_is_used_without_measuring(monkeypatch: pytest.MonkeyPatch) -> None:
    key = ("awq", 1, 14336, 4096, 128, torch.float16, 0)
    tuning.store(RTX_4090).put_gemm(tuning.key_text(key), "torch")
    assert "'torch.float16'" in tuning.key_text(key)
    _new_process(monkeypatch)
    monkeypatch.setattr(_triton, "INTERPRET", False)  # as on the GPU
    monkeypatch.setattr(_triton, "_FORCED", "auto")
    monkeypatch.setattr(_triton, "_CHOICES", {})
    monkeypatch.setattr(_triton, "tuning_identity", lambda: RTX_4090)
    ran: list[str] = []
    candidates = {"triton": lambda: ran.append("triton"), "torch": lambda: ran.append("torch")}
    assert _triton.gemm_backend_choice(key, candidates) == "torch"
    assert ran == [] and _triton.gemm_choices() == {key: "torch"}
