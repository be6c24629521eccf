"""Which reader opens a path: an HF folder (``models.hf``) or a GGUF file (``models.gguf_file``)."""

from __future__ import annotations

from pathlib import Path

from localllm.errors import LocalLLMError
from localllm.models.checkpoint import Checkpoint
from localllm.models.gguf_file import open_gguf
from localllm.models.hf import open_hf_dir


def open_checkpoint(path: Path) -> Checkpoint:
    """The checkpoint at ``path``, read by its format's reader; a path that is neither a folder
    nor a .gguf file, or does not exist, is one ``LocalLLMError`` line."""
    if not path.exists():
        raise LocalLLMError(f"{path}: no such file or folder")
    if path.is_dir():
        return open_hf_dir(path)
    if path.suffix == ".gguf":
        return open_gguf(path)
    raise LocalLLMError(f"{path}: not a model (expected an HF folder with config.json, or a .gguf file)")
