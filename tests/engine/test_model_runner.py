"""The runner's inputs on hand-built sequences (a tiny random model, for the KV pool's shape
only): token ids, positions, slot mapping, the varlen offsets and the logits rows."""

from __future__ import annotations

import pytest
import torch

from localllm.engine.model_runner import ModelRunner
from localllm.engine.scheduler import ScheduledBatch
from localllm.engine.sequence import SamplingParams, Sequence
from localllm.models.llama import LlamaForCausalLM, ModelConfig

BS = 4


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    cfg = ModelConfig("LlamaForCausalLM", vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=8, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    model.init_rope(64)
    return ModelRunner(model, num_blocks=16, block_size=BS, kv_dtype=torch.float32, max_model_len=64)


def _seq(rid: str, tokens: list[int], computed: int, table: list[int], n_prompt: int | None = None) -> Sequence:
    seq = Sequence(rid, tokens, SamplingParams(), (), 64, num_prompt_tokens=n_prompt or len(tokens))
    seq.num_computed_tokens = computed
    seq.block_table = table
    return seq


def test_inputs_of_a_mixed_batch(runner: ModelRunner) -> None:
    # a decode at position 5, a prefill finishing its prompt, a prefill chunk mid-prompt
    dec = _seq("dec", [1, 2, 3, 4, 5, 6], 5, [9, 3], n_prompt=4)
    fin = _seq("fin", [10, 11, 12, 13, 14, 15, 16], 4, [0, 7])
    mid = _seq("mid", list(range(20, 30)), 0, [5, 6])
    batch = ScheduledBatch([dec, fin, mid], [1, 3, 8], num_decodes=1, preempted=[])
    inputs = runner.prepare(batch)

    assert inputs.input_ids.tolist() == [6, 14, 15, 16, *range(20, 28)]
    assert inputs.positions.tolist() == [5, 4, 5, 6, *range(8)]
    # slot = block_table[pos // BS] * BS + pos % BS
    assert inputs.meta.slot_mapping.tolist() == [3 * BS + 1, 7 * BS + 0, 7 * BS + 1, 7 * BS + 2,
                                                 *(5 * BS + i for i in range(4)), *(6 * BS + i for i in range(4))]
    assert inputs.meta.query_start_loc.tolist() == [0, 1, 4, 12]
    assert inputs.meta.seq_lens.tolist() == [6, 7, 8]
    assert inputs.meta.block_tables.tolist() == [[9, 3], [0, 7], [5, 6]]
    assert inputs.meta.num_decodes == 1
    # only sequences whose prompt is done sample, from the row of their last new token
    assert inputs.sampling_seqs == [dec, fin]
    assert inputs.logits_indices.tolist() == [0, 3]


def test_block_tables_are_padded_to_the_longest(runner: ModelRunner) -> None:
    short = _seq("short", [1, 2], 1, [4])
    long = _seq("long", list(range(1, 11)), 9, [1, 2, 8])
    inputs = runner.prepare(ScheduledBatch([short, long], [1, 1], num_decodes=2, preempted=[]))
    assert inputs.meta.block_tables.tolist() == [[4, 0, 0], [1, 2, 8]]
    assert inputs.meta.slot_mapping.tolist() == [4 * BS + 1, 8 * BS + 1]
    assert inputs.positions.tolist() == [1, 9]


def test_execute_returns_one_logits_row_per_sampling_sequence(runner: ModelRunner) -> None:
    fin = _seq("fin", [3, 4, 5], 0, [2])
    mid = _seq("mid", list(range(1, 9)), 0, [10, 11])
    seqs, logits = runner.execute(ScheduledBatch([fin, mid], [3, 4], num_decodes=0, preempted=[]))
    assert seqs == [fin] and logits is not None and logits.shape == (1, 64)
    seqs, logits = runner.execute(ScheduledBatch([mid], [2], num_decodes=0, preempted=[]))
    assert seqs == [] and logits is None  # mid-prefill: nothing to sample
