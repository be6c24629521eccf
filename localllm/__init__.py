"""localllm: local-first LLM inference. ``from localllm import LLM, SamplingParams``."""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "SamplingParams", "AsyncEngine", "EngineConfig"]


def __getattr__(name: str) -> Any:
    # Lazy, so `localllm --version` and the CLI's argument parsing never import torch.
    if name in ("LLM", "SamplingParams"):
        from localllm import api

        return getattr(api, name)
    if name == "AsyncEngine":
        from localllm.engine.async_engine import AsyncEngine

        return AsyncEngine
    if name == "EngineConfig":
        from localllm.engine.engine import EngineConfig

        return EngineConfig
    raise AttributeError(f"module 'localllm' has no attribute {name!r}")
