"""The GGUF traits table (localllm/quant/gguf_formats.py) against the gguf package's own block
table and dequantizers, and docs/quantization.md against the table."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from localllm.quant import gguf_formats as gf

DOC = Path(__file__).resolve().parents[2] / "docs" / "quantization.md"


@pytest.mark.parametrize("f", gf.FORMATS, ids=lambda f: f.name)
def test_each_type_matches_the_gguf_package(f: gf.GGUFFormat) -> None:
    t = GGMLQuantizationType(f.type_id)
    assert t.name == f.name
    assert GGML_QUANT_SIZES[t] == (f.block_weights, f.block_bytes)
    assert sum(b.nbytes for b in f.fields) == f.block_bytes  # the fields tile the block
    assert f.block_weights % f.sub_block == 0
    if f.row_fallback is not None:  # a 32-weight type that any row of whole 32-blocks fits
        assert gf.BY_NAME[f.row_fallback].block_weights == 32 < f.block_weights


@pytest.mark.parametrize("f", [f for f in gf.FORMATS if not f.is_float], ids=lambda f: f.name)
def test_a_block_of_each_type_dequantizes_to_its_block_weights(f: gf.GGUFFormat) -> None:
    """Random bytes of two rows of two blocks: gguf's reference gives ``block_weights`` values
    per block, the row lengths the table states (values aside: a random fp16 scale may be NaN)."""
    rng = np.random.default_rng(f.type_id)
    raw = rng.integers(0, 256, size=(2, 2 * f.block_bytes), dtype=np.uint8)
    with np.errstate(all="ignore"):
        out = quants.dequantize(raw, GGMLQuantizationType(f.type_id))
    assert out.shape == (2, 2 * f.block_weights)
    assert f.row_bytes(2 * f.block_weights) == 2 * f.block_bytes


def test_lookups_and_errors_name_the_type() -> None:
    assert gf.fmt("q4_k") is gf.fmt(12) is gf.fmt(GGMLQuantizationType.Q4_K)
    assert gf.fmt("Q4_K").bits_per_weight == 4.5
    assert gf.fmt("Q6_K").bits_per_weight == 6.5625
    assert gf.fmt("IQ4_XS").bits_per_weight == 4.25
    assert gf.fmt("Q4_K").nbytes(257) == 288  # whole blocks, for sizing
    assert gf.type_name(99) == "type 99"
    with pytest.raises(ValueError, match="Q4_Z"):
        gf.fmt("Q4_Z")
    with pytest.raises(ValueError, match="whole blocks of 256"):
        gf.fmt("Q4_K").row_bytes(576)


def test_cpu_kernel_types_are_the_packed_ones() -> None:
    assert {gf.type_name(t) for t in gf.cpu_kernel_types()} >= {"Q4_0", "Q4_1", "Q8_0"}
    assert gf.fmt(gf.FALLBACK).cpu_kernel  # the fallback of a type without a kernel has one


def test_the_docs_show_the_table() -> None:
    assert gf.markdown_table() in DOC.read_text(), (
        "docs/quantization.md's GGUF table differs from localllm.quant.gguf_formats.markdown_table(): paste it in")


# tests/fixtures/gguf_blocks.gguf: llama.cpp's quantizer on one float source, for the types the
# gguf package cannot quantize (remade by tests/fixtures/make_gguf_blocks.py). Relative RMS
# error of each dequantized type against the source, with room over what was measured
# (Q2_K 0.34, Q3_K 0.20, Q4_K 0.090, Q5_K 0.045, Q6_K 0.027, IQ4_NL 0.110, IQ4_XS 0.112).
BLOCKS = Path(__file__).resolve().parents[1] / "fixtures" / "gguf_blocks.gguf"
FIXTURE_ERROR = {"Q2_K": 0.4, "Q3_K": 0.25, "Q4_K": 0.11, "Q5_K": 0.06, "Q6_K": 0.035, "IQ4_NL": 0.13, "IQ4_XS": 0.13}


def test_the_committed_blocks_are_quantizations_of_their_source() -> None:
    from localllm.models.gguf_file import read_gguf

    _, tensors = read_gguf(BLOCKS)
    src = quants.dequantize(tensors["source"].data, tensors["source"].tensor_type).astype(np.float64)
    assert {n for n in tensors} == {"source", *FIXTURE_ERROR}
    for name, bound in FIXTURE_ERROR.items():
        t = tensors[name]
        f = gf.fmt(int(t.tensor_type))
        assert f.name == name and t.data.shape == (src.shape[0], f.row_bytes(src.shape[1]))
        w = quants.dequantize(t.data, t.tensor_type).reshape(src.shape)
        err = np.sqrt(((w - src) ** 2).mean() / (src**2).mean())
        assert 0 < err < bound, (name, err)
