"""Kernel tests run the Triton kernels under the interpreter on CPU tensors (CI), or for real
on CUDA when TRITON_INTERPRET is not "1" and a GPU is present (bench/gpu_check.py)."""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
ON_GPU = not INTERPRET and torch.cuda.is_available()


@pytest.fixture
def device() -> str:
    if INTERPRET:
        return "cpu"
    if not torch.cuda.is_available():
        pytest.skip("Triton kernels need TRITON_INTERPRET=1 or a CUDA device")
    return "cuda"


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
