"""An out-of-memory while a quantized GEMM's backend is chosen (the torch candidate that
dequantizes a whole weight, or the Triton kernel's autotuning) is a choice, not a crash: a
candidate that runs out is not chosen and the choice is not saved; when every candidate runs
out, one LocalLLMError line. Timing is replaced by calling the candidate (no GPU here); the
logic around it is the real one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from localllm.errors import LocalLLMError
from localllm.kernels import _triton, tuning

RTX_4090: tuning.Identity = ("NVIDIA GeForce RTX 4090", 8, 9)


@pytest.fixture(autouse=True)
def _as_on_a_gpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(tuning, "compiled_cache_dir", lambda: tmp_path)
    monkeypatch.setattr(tuning, "_stores", {})
    monkeypatch.setattr(_triton, "INTERPRET", False)
    monkeypatch.setattr(_triton, "_FORCED", "auto")
    monkeypatch.setattr(_triton, "_CHOICES", {})
    monkeypatch.setattr(_triton, "tuning_identity", lambda: RTX_4090)
    monkeypatch.setattr(_triton, "_time_ms", lambda fn: float(fn()))  # a candidate returns its "time"
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)


def _oom() -> float:
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.31 GiB")


def test_a_candidate_that_runs_out_of_memory_is_not_chosen_nor_saved() -> None:
    key = ("awq", 16, 28672, 4096, 128)
    assert _triton.gemm_backend_choice(key, {"triton": lambda: 2.0, "torch": _oom}) == "triton"
    assert tuning.store(RTX_4090).gemm == {}  # with memory free the torch path may win: measure again
    other = ("awq", 32, 28672, 4096, 128)
    assert _triton.gemm_backend_choice(other, {"triton": lambda: 2.0, "torch": lambda: 1.0}) == "torch"
    assert tuning.store(RTX_4090).gemm == {tuning.key_text(other): "torch"}


def test_every_candidate_out_of_memory_is_one_line() -> None:
    with pytest.raises(LocalLLMError) as info:
        _triton.gemm_backend_choice(("awq", 16, 28672, 4096, 128), {"triton": _oom, "torch": _oom})
    message = str(info.value)
    assert "\n" not in message and message.startswith("out of GPU memory choosing the matmul kernel for awq")
    assert "--context" in message and "--gpu-memory-utilization" in message
