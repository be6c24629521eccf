"""Sizing: the seed's KV figures, weight bytes per precision, and the dims protocol."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from localllm.catalog import CatalogEntry, load_catalog
from localllm.hardware import sizing


@pytest.fixture(scope="module")
def llama70b() -> CatalogEntry:
    return load_catalog()["llama-3.1-70b-instruct"]


def test_seed_llama_70b_kv_figures(llama70b: CatalogEntry) -> None:
    per_token = sizing.kv_bytes_per_token(llama70b, "bfloat16")
    assert per_token == 327_680  # "about 328 KB"
    one = sizing.kv_bytes(llama70b, 128 * 1024, "bfloat16")
    assert one == pytest.approx(43e9, rel=0.01)  # one 128K-token sequence: about 43 GB
    assert 16 * one == pytest.approx(690e9, rel=0.01)  # sixteen of them: about 690 GB


def test_default_model_kv_is_46080_bytes_per_token_in_fp32() -> None:
    entry = load_catalog()["smollm2-135m-instruct"]
    assert sizing.kv_bytes_per_token(entry, "float32") == 46_080


def test_weight_bytes_shrink_down_the_ladder() -> None:
    entry = load_catalog()["llama-3.1-8b-instruct"]
    fp32 = sizing.weight_bytes(entry, "float32")
    bf16 = sizing.weight_bytes(entry, "bfloat16")
    fp8 = sizing.weight_bytes(entry, "bfloat16", "fp8")
    int8 = sizing.weight_bytes(entry, "bfloat16", "int8")
    awq = sizing.weight_bytes(entry, "bfloat16", "awq")
    assert fp32 == 2 * bf16 == 4 * entry.params
    assert fp8 == int8 < bf16
    assert awq < fp8
    counts = sizing.param_counts(entry)
    # AWQ: half a byte per block weight plus group scales and zeros; embeddings stay bf16.
    floor = counts.block_linear / 2 + 2 * (counts.embedding + counts.lm_head)
    assert floor < awq < floor * 1.05
    # Published AWQ-INT4 checkpoints of this model are about 5.7 GB.
    assert awq == pytest.approx(5.7e9, rel=0.05)


def test_awq_group_size_follows_the_widths() -> None:
    catalog = load_catalog()
    assert sizing.awq_group_size(catalog["smollm2-135m-instruct"]) == 64  # 576 = 4.5 x 128
    assert sizing.awq_group_size(catalog["llama-3.1-8b-instruct"]) == 128


def test_decode_reads_an_untied_embedding_table_only_by_row() -> None:
    catalog = load_catalog()
    tied, untied = catalog["qwen2.5-3b-instruct"], catalog["qwen2.5-7b-instruct"]
    assert sizing.decode_read_bytes(tied) == sizing.weight_bytes(tied)
    saved = sizing.weight_bytes(untied) - sizing.decode_read_bytes(untied)
    assert saved == (untied.vocab_size - 1) * untied.hidden_size * 2


@dataclass
class EngineConfig:
    """Stands in for the engine's ModelConfig: same attribute names, nothing else."""

    num_layers: int = 30
    hidden_size: int = 576
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    intermediate_size: int = 1536
    vocab_size: int = 49152
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 8192


def test_any_object_with_the_dims_works() -> None:
    assert sizing.count_params(EngineConfig()) == 134_515_008
    with pytest.raises(ValueError, match="unknown quantization"):
        sizing.weight_bytes(EngineConfig(), "bfloat16", "int3")
