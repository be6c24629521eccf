"""What one attention layer keeps in the KV cache: the shape of its pool and how far back it looks.

A model states one ``LayerKVSpec`` per layer (``model.kv_spec()``); the KV-cache owner
(engine/kv_cache.py), the planner's sizing and the attention paths read it, so nothing outside a
family file assumes that every layer has Llama's shape.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LayerKVSpec:
    """Invariants: ``num_kv_heads >= 1``, ``head_dim >= 1``; ``sliding_window`` is None (the
    layer attends to every earlier token) or >= 1 (query at position p sees keys at positions
    ``p - sliding_window + 1 .. p``, as transformers' sliding_attention does)."""

    num_kv_heads: int
    head_dim: int
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        assert self.num_kv_heads >= 1 and self.head_dim >= 1
        assert self.sliding_window is None or self.sliding_window >= 1

    def bytes_per_token(self, dtype_bytes: float) -> float:
        """K and V of one token in this layer's pool."""
        return 2 * self.num_kv_heads * self.head_dim * dtype_bytes
