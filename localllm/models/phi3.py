"""Phi-3 (mini, small-context and 128k LongRoPE variants) and Phi-4-mini's dense layout.

Phi-3's checkpoints store q/k/v fused in ``qkv_proj`` and gate/up in ``gate_up_proj``, the
same order the shared layers fuse them in; they are split into the shards at load, so that
quantized linears (which quantize shard by shard) and the loader's completeness check see
the same pieces as for Llama. LongRoPE and the sliding window are configuration.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from localllm.errors import LocalLLMError
from localllm.models.layers import CausalLM


class Phi3ForCausalLM(CausalLM):
    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        cfg = self.config
        q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
        for name, tensor in weights:
            if ".qkv_proj." in name:
                for part, t in zip(("q_proj", "k_proj", "v_proj"), _split(name, tensor, (q, kv, kv))):
                    yield name.replace("qkv_proj", part), t
            elif ".gate_up_proj." in name:
                for part, t in zip(("gate_proj", "up_proj"), _split(name, tensor, (inter, inter))):
                    yield name.replace("gate_up_proj", part), t
            else:
                yield name, tensor


def _split(name: str, tensor: torch.Tensor, sizes: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    if tensor.shape[0] != sum(sizes):
        raise LocalLLMError(f"checkpoint tensor {name!r} has {tensor.shape[0]} rows, expected {sum(sizes)}")
    return tuple(t.contiguous() for t in tensor.split(list(sizes), dim=0))
