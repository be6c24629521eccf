"""Turns a scheduled batch into one forward pass over the paged KV cache, then samples.

The batch is flat (varlen): the new tokens of every sequence back to back, decodes first,
described by ``AttentionMetadata``. Slot mapping and positions are computed with tensor ops
from per-sequence offsets, so the Python work per step is one short loop over sequences.
On CUDA, pure-decode steps replay CUDA graphs captured per batch-size bucket.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from localllm.engine.sampler import SamplerOutput, sample
from localllm.engine.scheduler import ScheduledBatch
from localllm.engine.sequence import Sequence
from localllm.models.llama import AttentionMetadata, LlamaForCausalLM
from localllm.quant.kv_cache import kv_scale_tensor

GRAPH_BATCH_SIZES = [1, 2, 4, 8] + list(range(16, 257, 16))


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the hidden states that need the next token
    sampling_seqs: list[Sequence]


class ModelRunner:
    """Owns the model and the KV pool: ``[2, layers, num_blocks, block_size, kv_heads, head_dim]``,
    and for an FP8 pool its per-layer K and V scales ``[2, layers]`` (fp32; the pool stores
    ``K / k_scale``), which never change after start-up.

    Invariant: after ``execute`` returns, the KV of every scheduled token is in the pool at the
    slot its sequence's block table gives for its position.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype,
        max_model_len: int,
        use_cuda_graphs: bool = False,
        max_graph_batch: int = 256,
        kv_scales: Seq[tuple[float, float]] | None = None,
    ) -> None:
        """``kv_scales``: (k_scale, v_scale) per layer for an FP8 pool; default 1.0 (vLLM's)."""
        cfg = model.config
        self.model = model
        self.device = model.lm_head.weight.device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.kv_cache = torch.empty(
            2, cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
            dtype=kv_dtype, device=self.device,
        )
        self.kv_cache.fill_(0)  # touch every page now: the pool is reserved up front, and measured
        self.kv_scales = kv_scale_tensor(kv_scales, cfg.num_layers, self.device)
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.k_cache = self.kv_cache[0, i]
            layer.self_attn.v_cache = self.kv_cache[1, i]
            layer.self_attn.k_scale = self.kv_scales[0, i]
            layer.self_attn.v_scale = self.kv_scales[1, i]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if use_cuda_graphs and self.device.type == "cuda":
            self._capture_graphs(max_graph_batch)

    @property
    def kv_bytes(self) -> int:
        return self.kv_cache.numel() * self.kv_cache.element_size()

    # ---- inputs ----

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        seqs, counts = batch.seqs, batch.num_new_tokens
        input_ids: list[int] = []
        starts: list[int] = []
        tables: list[list[int]] = []
        sampling: list[Sequence] = []
        logits_rows: list[int] = []
        row = 0
        for seq, n in zip(seqs, counts):
            start = seq.num_computed_tokens
            input_ids += seq.token_ids[start : start + n]
            starts.append(start)
            tables.append(seq.block_table)
            row += n
            if start + n == seq.num_tokens:  # the prompt is done: this row yields a token
                sampling.append(seq)
                logits_rows.append(row - 1)
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        q_lens = torch.tensor(counts, dtype=torch.int32)
        starts_t = torch.tensor(starts, dtype=torch.int32)
        query_start_loc = torch.zeros(len(seqs) + 1, dtype=torch.int32)
        torch.cumsum(q_lens, 0, out=query_start_loc[1:])
        seq_index = torch.repeat_interleave(torch.arange(len(seqs)), q_lens)
        positions = torch.arange(row, dtype=torch.int64) - query_start_loc[seq_index] + starts_t[seq_index]
        slots = block_tables[seq_index, positions // self.block_size].long() * self.block_size
        slots += positions % self.block_size
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=slots.to(dev, non_blocking=True),
            query_start_loc=query_start_loc.to(dev, non_blocking=True),
            seq_lens=(starts_t + q_lens).to(dev, non_blocking=True),
            block_tables=block_tables.to(dev, non_blocking=True),
            num_decodes=batch.num_decodes,
        )
        return StepInputs(
            torch.tensor(input_ids, dtype=torch.int64).to(dev, non_blocking=True),
            positions.to(dev, non_blocking=True),
            meta,
            torch.tensor(logits_rows, dtype=torch.int64).to(dev, non_blocking=True),
            sampling,
        )

    # ---- execution ----

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[list[Sequence], SamplerOutput | None]:
        inputs = self.prepare(batch)
        n = len(batch.seqs)
        if self.graphs and batch.num_decodes == n and n <= max(self.graphs):
            hidden = self._replay(inputs, n)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        if not inputs.sampling_seqs:
            return [], None
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        return inputs.sampling_seqs, sample(logits, inputs.sampling_seqs)

    # ---- CUDA graphs (decode only) ----

    def _capture_graphs(self, max_batch: int) -> None:
        """Captures one graph per batch bucket over static input buffers. Padding rows write
        nowhere (slot -1) and attend to one token of block 0; their outputs are discarded."""
        dev = self.device
        sizes = [b for b in GRAPH_BATCH_SIZES if b <= max_batch]
        top = sizes[-1]
        self._g_input_ids = torch.zeros(top, dtype=torch.int64, device=dev)
        self._g_positions = torch.zeros(top, dtype=torch.int64, device=dev)
        self._g_slots = torch.full((top,), -1, dtype=torch.int64, device=dev)
        self._g_seq_lens = torch.ones(top, dtype=torch.int32, device=dev)
        self._g_tables = torch.zeros(top, self.max_blocks_per_seq, dtype=torch.int32, device=dev)
        self._g_qsl = torch.arange(top + 1, dtype=torch.int32, device=dev)
        self._g_hidden: dict[int, torch.Tensor] = {}
        pool = None
        for b in reversed(sizes):  # largest first so smaller graphs reuse its memory pool
            meta = AttentionMetadata(self._g_slots[:b], self._g_qsl[: b + 1], self._g_seq_lens[:b],
                                     self._g_tables[:b], b)
            for _ in range(2):  # warm up: Triton compiles and autotunes outside the capture
                self.model(self._g_input_ids[:b], self._g_positions[:b], meta)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._g_hidden[b] = self.model(self._g_input_ids[:b], self._g_positions[:b], meta)
            pool = graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize()

    def _replay(self, inputs: StepInputs, n: int) -> torch.Tensor:
        b = next(s for s in sorted(self.graphs) if s >= n)
        meta = inputs.meta
        self._g_input_ids[:n] = inputs.input_ids
        self._g_positions[:n] = inputs.positions
        self._g_slots[:n] = meta.slot_mapping
        self._g_slots[n:b] = -1
        self._g_seq_lens[:n] = meta.seq_lens
        self._g_seq_lens[n:b] = 1
        self._g_tables[:n, : meta.block_tables.shape[1]] = meta.block_tables
        self.graphs[b].replay()
        return self._g_hidden[b][:n]
