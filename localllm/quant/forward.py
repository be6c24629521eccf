"""Running ``LlamaForCausalLM`` outside the engine: prefill of fresh sequences and greedy
decode over a private KV pool. Calibration (AWQ) and evaluation need logits and layer
inputs for fixed token windows, with none of the scheduler's machinery.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from localllm.models.llama import AttentionMetadata, LlamaForCausalLM
from localllm.quant.kv_cache import kv_scale_tensor

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
    per_seq = [-(-n // BLOCK_SIZE) for n in (capacity or lengths)]
    width = max(per_seq)
    tables = torch.zeros(len(seqs), width, dtype=torch.int32)
    first = 0
    slots = []
    for i, (n, nb) in enumerate(zip(lengths, per_seq)):
        tables[i, :nb] = torch.arange(first, first + nb, dtype=torch.int32)
        slots.append(torch.arange(n) + first * BLOCK_SIZE)  # contiguous blocks: slot = offset
        first += nb
    qsl = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots).to(device),
        query_start_loc=qsl.to(device),
        seq_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        num_decodes=0,
    )
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.int64, device=device)
    positions = torch.cat([torch.arange(n) for n in lengths]).to(device)
    return Batch(ids, positions, meta, lengths)


@dataclass(frozen=True, slots=True)
class KVSpec:
    """How a private pool stores the KV: ``dtype`` None = the model dtype; ``scales`` the
    (k_scale, v_scale) of each layer of an FP8 cache, None = 1.0 each."""

    dtype: torch.dtype | None = None
    scales: Sequence[tuple[float, float]] | None = None


class KVPool:
    """One [blocks, block_size, kv_heads, head_dim] K and V tensor per layer, and their FP8
    scales, attached to the model's attention layers the way the engine's ModelRunner does."""

    def __init__(
        self, model: LlamaForCausalLM, num_blocks: int, dtype: torch.dtype | None = None,
        scales: Sequence[tuple[float, float]] | None = None,
    ) -> None:
        cfg = model.config
        device = model.device
        dtype = dtype or model.dtype
        shape = (2, cfg.num_layers, num_blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
        self.kv = torch.zeros(shape, dtype=dtype, device=device)
        self.scales = kv_scale_tensor(scales, cfg.num_layers, device)
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.k_cache = self.kv[0, i]
            layer.self_attn.v_cache = self.kv[1, i]
            layer.self_attn.k_scale = self.scales[0, i]
            layer.self_attn.v_scale = self.scales[1, i]


def device_of(model: LlamaForCausalLM) -> torch.device:
    return model.device


@torch.inference_mode()
def prefill_logits(model: LlamaForCausalLM, ids: Sequence[int], kv: KVSpec = KVSpec()) -> torch.Tensor:
    """Float32 logits ``[T, vocab]`` of one fresh sequence."""
    KVPool(model, blocks_for([len(ids)]), kv.dtype, kv.scales)
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
    KVPool(model, blocks_for(total), kv.dtype, kv.scales)
    b = prefill_batch(prompts, dev, total)
    hidden = model(b.input_ids, b.positions, b.meta)
    last = b.meta.query_start_loc[1:].long() - 1
    nxt = model.compute_logits(hidden[last]).argmax(-1)
    out = [[int(t)] for t in nxt.tolist()]
    tables = b.meta.block_tables
    seq_lens = b.meta.seq_lens.clone()
    qsl = torch.arange(len(prompts) + 1, dtype=torch.int32, device=dev)
    steps: list[float] = []
    for _ in range(max_new - 1):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        positions = seq_lens.long()  # the new token's position = tokens already cached
        block = tables.gather(1, (positions // BLOCK_SIZE).unsqueeze(1).to(torch.int64)).squeeze(1)
        slots = block.long() * BLOCK_SIZE + positions % BLOCK_SIZE
        seq_lens = seq_lens + 1
        meta = AttentionMetadata(slots, qsl, seq_lens, tables, len(prompts))
        nxt = model.compute_logits(model(nxt, positions, meta)).argmax(-1)
        for seq, t in zip(out, nxt.tolist()):  # .tolist() waits for the step to finish
            seq.append(int(t))
        steps.append(time.perf_counter() - start)
    return Generation(out, steps)
