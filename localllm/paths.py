"""Where localllm keeps files. ``LOCALLLM_HOME`` moves all of them (tests, portable installs)."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs


def home_dir() -> Path | None:
    home = os.environ.get("LOCALLLM_HOME")
    return Path(home).expanduser() if home else None


def models_dir() -> Path:
    """Pulled models: one folder per model id."""
    home = home_dir()
    base = home / "models" if home else Path(platformdirs.user_cache_dir("localllm")) / "models"
    base.mkdir(parents=True, exist_ok=True)
    return base


def data_dir() -> Path:
    """User data that must survive cache clean-ups: chat history, config."""
    home = home_dir()
    base = home / "data" if home else Path(platformdirs.user_data_dir("localllm"))
    base.mkdir(parents=True, exist_ok=True)
    return base


def config_path() -> Path:
    home = home_dir()
    base = home if home else Path(platformdirs.user_config_dir("localllm"))
    return base / "config.toml"
