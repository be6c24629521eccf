"""Running ``LlamaForCausalLM`` outside the engine: prefill of fresh sequences and greedy
decode over a private KV pool (an engine/kv_cache.py ``KVCache``, as the engine's).
Calibration (AWQ) and evaluation need logits and layer inputs for fixed token windows, with
none of the scheduler's machinery.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from localllm.engine.kv_cache import KVCache, contiguous_tables, decode_metadata, varlen_metadata
from localllm.models.llama import AttentionMetadata, LlamaForCausalLM

BLOCK_SIZE = 16


@dataclass(slots=True)
class Batch:
    """Fresh sequences packed back to back, each at positions 0..len-1, block tables laid out
    contiguously in the pool."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    lengths: list[int]


def blocks_for(lengths: Sequence[int]) -> int:
    return sum(-(-n // BLOCK_SIZE) for n in lengths)


def prefill_batch(
    seqs: Sequence[Sequence[int]], device: torch.device, capacity: Sequence[int] | None = None
) -> Batch:
    """``capacity[i]`` (default: its length) is how many tokens sequence i may grow to."""
    lengths = [len(s) for s in seqs]
    tables = contiguous_tables(capacity or lengths, BLOCK_SIZE)
    positions, meta = varlen_metadata([0] * len(seqs), lengths, tables, BLOCK_SIZE, 0, device)
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.int64, device=device)
    return Batch(ids, positions, meta, lengths)


@dataclass(frozen=True, slots=True)
class KVSpec:
    """How a private pool stores the KV: ``dtype`` None = the model dtype; ``scales`` the
    (k_scale, v_scale) of each layer of an FP8 cache, None = 1.0 each."""

    dtype: torch.dtype | None = None
    scales: Sequence[tuple[float, float]] | None = None


def device_of(model: LlamaForCausalLM) -> torch.device:
    return model.device


@torch.inference_mode()
def prefill_logits(model: LlamaForCausalLM, ids: Sequence[int], kv: KVSpec = KVSpec()) -> torch.Tensor:
    """Float32 logits ``[T, vocab]`` of one fresh sequence."""
    KVCache.for_model(model, blocks_for([len(ids)]), BLOCK_SIZE, kv.dtype, kv.scales)
    b = prefill_batch([ids], device_of(model))
    return model.compute_logits(model(b.input_ids, b.positions, b.meta))


@dataclass(slots=True)
class Generation:
    tokens: list[list[int]]
    step_seconds: list[float]  # wall time of each decode step (after the prefill)

    @property
    def median_step(self) -> float:
        """Robust to the bursts of foreign load on shared machines, unlike the mean."""
        ordered = sorted(self.step_seconds)
        return ordered[len(ordered) // 2] if ordered else float("nan")


@torch.inference_mode()
def greedy_generate(
    model: LlamaForCausalLM, prompts: Sequence[Sequence[int]], max_new: int, kv: KVSpec = KVSpec()
) -> Generation:
    """Greedy continuation of every prompt by exactly ``max_new`` tokens (EOS ignored, so
    runs are comparable token for token), all prompts decoded together as one batch."""
    dev = device_of(model)
    total = [len(p) + max_new for p in prompts]
    KVCache.for_model(model, blocks_for(total), BLOCK_SIZE, kv.dtype, kv.scales)
    b = prefill_batch(prompts, dev, total)
    hidden = model(b.input_ids, b.positions, b.meta)
    last = b.meta.query_start_loc[1:].long() - 1
    nxt = model.compute_logits(hidden[last]).argmax(-1)
    out = [[int(t)] for t in nxt.tolist()]
    tables = b.meta.block_tables
    cached = b.meta.seq_lens.clone()  # tokens in the pool per sequence: the next one's position
    steps: list[float] = []
    for _ in range(max_new - 1):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        positions, meta = decode_metadata(cached, tables, BLOCK_SIZE)
        cached = meta.seq_lens
        nxt = model.compute_logits(model(nxt, positions, meta)).argmax(-1)
        for seq, t in zip(out, nxt.tolist()):  # .tolist() waits for the step to finish
            seq.append(int(t))
        steps.append(time.perf_counter() - start)
    return Generation(out, steps)
