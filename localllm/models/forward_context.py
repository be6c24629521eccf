"""What a layer may need to know about the batch of the forward pass it runs in, beyond its
input rows: how its rows split into sequences. The model runner is the one writer (around
each eager forward of a scheduled batch); a linear that picks its kernel by row count reads it
so that a row's result depends on its own sequence's chunk, never on what else is batched.

Invariant: outside ``batch_rows(...)`` there is no split (``row_split()`` is None), so a
forward called directly (the quantization passes, benchmarks, a traced decode step) sees its
rows as one prompt chunk, as such a caller always has.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RowSplit:
    """Rows ``[0, num_decodes)`` are decodes, one per sequence (a batch puts them first); then
    each prompt chunk's rows in turn, ``chunk_lens[i]`` of them."""

    num_decodes: int
    chunk_lens: tuple[int, ...]


_split: RowSplit | None = None


def row_split() -> RowSplit | None:
    return _split


@contextlib.contextmanager
def batch_rows(num_decodes: int, chunk_lens: Sequence[int]) -> Iterator[None]:
    global _split
    _split = RowSplit(num_decodes, tuple(chunk_lens))
    try:
        yield
    finally:
        _split = None
