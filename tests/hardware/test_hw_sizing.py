"""Sizing: the seed's KV figures, weight bytes per precision, and the dims protocol."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from localllm.catalog import CatalogEntry, load_catalog
from localllm.errors import LocalLLMError
from localllm.hardware import sizing

if TYPE_CHECKING:
    from localllm.models.checkpoint import Checkpoint


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


# --- GGUF: sized from the file's tensors --------------------------------------------------------


def test_a_gguf_file_is_sized_from_its_tensors(default_model_path: Path, default_checkpoint: Checkpoint) -> None:
    """The default model's Q4_1 file: the tensors' stored bytes are the file's data section
    (the file less its header and metadata, up to each tensor's alignment padding)."""
    from gguf import GGUFReader

    from localllm.models.gguf_file import gguf_weights_from_file

    weights = gguf_weights_from_file(default_model_path)
    reader = GGUFReader(default_model_path)
    data = default_model_path.stat().st_size - reader.data_offset
    assert data - len(reader.tensors) * reader.alignment < weights.tensor_bytes <= data
    assert dict(weights.types).keys() == {"Q4_1", "Q8_0", "F32"}
    assert weights.label.startswith("Q4_1 69% + Q8_0 31%")
    # token_embd is Q8_0: 49152 x 576 weights, 34 bytes per 32
    assert weights.embedding_bytes == 49152 * 576 // 32 * 34
    cfg = default_checkpoint.config
    # In memory: the tensors as stored, token_embd's blocks serving the tied head and the lookup
    # (the CPU kernels take Q4_1 and Q8_0); for this all-Q4_1 file, exactly the Q4_1 estimate
    # the planner uses for a GGUF it has not read.
    from_file = sizing.weight_bytes(cfg, "float32", "gguf", weights)
    assert from_file == weights.tensor_bytes
    assert from_file == sizing.weight_bytes(cfg, "float32", "gguf")
    assert sizing.decode_read_bytes(cfg, "float32", "gguf", weights) == from_file  # tied: the head reads it all


def test_a_file_that_is_not_gguf_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf file at all")
    from localllm.models.gguf_file import gguf_weights_from_file

    with pytest.raises(LocalLLMError, match="corrupt or truncated GGUF file") as info:
        gguf_weights_from_file(bad)
    assert "\n" not in str(info.value)


def test_q4_k_m_estimate_matches_published_files() -> None:
    """llama.cpp's Q4_K_M recipe applied to the dims: Llama-3.1-8B's published file is 4.92 GB
    (the catalog's figure); SmolLM2-135M requantized by llama-quantize made a 99 MiB file
    (issue #28), its 576-wide rows falling back from Q4_K/Q6_K to Q5_0/Q8_0."""
    catalog = load_catalog()
    llama = catalog["llama-3.1-8b-instruct"]
    estimate = sizing.gguf_q4_k_m_weights(llama)
    assert estimate.tensor_bytes == pytest.approx(llama.gguf_sizes["Q4_K_M"], rel=0.01)
    assert [name for name, _ in estimate.types][:2] == ["Q4_K", "Q6_K"]
    smol = sizing.gguf_q4_k_m_weights(catalog["smollm2-135m-instruct"])
    assert smol.tensor_bytes == pytest.approx(99 * 2**20, rel=0.02)
    assert {"Q5_0", "Q8_0"} <= dict(smol.types).keys()
    # Phi-3's fused attn_qkv is Q5_K in a Q4_K_M: phi-4's published 9.05 GB (1.8% under without it)
    phi4 = catalog["phi-4"]
    assert sizing.gguf_q4_k_m_weights(phi4).tensor_bytes == pytest.approx(phi4.gguf_sizes["Q4_K_M"], rel=0.005)
    # The catalog's published size wins over the estimate where there is one.
    published = sizing.gguf_catalog_weights(llama)
    assert published.tensor_bytes == 4_920_000_000 and "published" in published.source
    assert sizing.gguf_catalog_weights(catalog["qwen3-8b"]).source.startswith("llama.cpp's Q4_K_M recipe")
    with pytest.raises(LocalLLMError, match="no Q5_K_M size"):
        sizing.gguf_catalog_weights(llama, "Q5_K_M")


def test_gguf_type_bytes_come_from_the_traits_table() -> None:
    assert sizing.gguf_type_bytes("Q4_K", 256) == 144
    assert sizing.gguf_type_bytes("Q6_K", 512) == 420
    assert sizing.gguf_type_bytes("Q4_1", 64) == 40
    with pytest.raises(ValueError, match="GGUF tensor type 'Q4_Z' is not one localllm knows"):
        sizing.gguf_type_bytes("Q4_Z", 32)


def test_the_largest_engine_matrix_is_the_fused_gate_up() -> None:
    llama = load_catalog()["llama-3.1-8b-instruct"]
    assert sizing.largest_matrix(llama) == ("gate_up_proj", 4096, 2 * 14336)
    assert sum(k * n for k, n in sizing.engine_matrices(llama).values()) * llama.num_layers == (
        sizing.param_counts(llama).block_linear)
