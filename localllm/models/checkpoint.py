"""What every checkpoint reader hands the rest of localllm: a ``Checkpoint``.

A reader (``models.hf`` for HF folders, ``models.gguf_file`` for GGUF files) produces the
config, the tokenizer and a generator of HF-named tensors, consumed one at a time so a shard
(or a dequantized GGUF tensor) is the most that sits in RAM. ``models.formats.open_checkpoint``
picks the reader for a path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from localllm.models.llama import ModelConfig
from localllm.tokenizer import Tokenizer

WeightIter = Iterator[tuple[str, torch.Tensor]]


@dataclass(slots=True)
class Checkpoint:
    path: Path
    format: str  # "hf" or "gguf"
    config: ModelConfig
    tokenizer: Tokenizer
    weights: Callable[..., WeightIter]  # (raw=(), head_from_embedding=False) for GGUF; () for HF
    num_tensors: int
    # GGUF only: HF tensor name -> GGML block type, so a CPU plan can keep the file's blocks
    block_types: dict[str, int] = field(default_factory=dict)
