"""A GGUF checkpoint on a GPU plan: its blocks stay as stored for the Triton kernels, sized from
the file's own tensor types, so a consumer card's 8B Q4_K_M takes its file size in VRAM
(instead of an 8B bf16, or int4 rounded again from the dequantized blocks)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hwfixtures import cpu_hw
from test_hw_planner import _held_by_others

from localllm.catalog import load_catalog
from localllm.hardware.planner import DoesNotFit, plan
from localllm.hardware.probe import GiB, hardware_for_gpu
from localllm.hardware.sizing import gguf_q4_k_m_weights, gguf_weights_from_tensors
from localllm.quant import gguf_formats as gf

LLAMA_8B = load_catalog()["llama-3.1-8b-instruct"]
LINE = "gguf blocks as stored (Triton kernels on the GPU, dequantized in registers, no second rounding): Q4_K x..."


def test_a_24gb_card_plans_an_8b_q4_k_m_file_at_its_file_size() -> None:
    hw = _held_by_others(hardware_for_gpu("RTX 4090", None, base=cpu_hw()), 2)  # a desktop holds 2 GiB
    weights = gguf_q4_k_m_weights(LLAMA_8B)  # the tensors of llama.cpp's Q4_K_M, from the dims
    assert {name for name, _ in weights.types} == {"Q4_K", "Q6_K", "F32"} and weights.kernels == "cpu"
    p = plan(LLAMA_8B, hw, gguf=weights, gpu_gguf=LINE)
    assert p.device == "cuda" and p.quant == "gguf" and p.weight_dtype == "bfloat16" and p.precision == "gguf"
    # VRAM weights: exactly the file's tensor bytes (every type has a Triton kernel), ~4.6 GiB
    assert p.weight_bytes == weights.tensor_bytes and 4.3 * GiB < p.weight_bytes < 5 * GiB
    assert p.decode_read_bytes < p.weight_bytes  # the untied embedding's blocks are only indexed
    assert p.precision_reason.startswith(LINE) and "sized from llama.cpp's Q4_K_M recipe" in p.precision_reason
    # room to spare on 22 GiB: the model's full 128K context, graphs on, the reserve kept free
    assert p.max_model_len >= 8192 and p.kv_tokens >= 65_536 and p.kv_dtype == "bfloat16" and p.use_cuda_graphs
    assert hw.gpus[0].free_bytes - p.total_bytes >= p.reserve_bytes + p.margin_bytes
    # the same card without the GGUF file's blocks: the 16 GB bf16 copy it used to dequantize to
    dense = plan(LLAMA_8B, hw)
    assert dense.quant is None and dense.weight_bytes > 3 * p.weight_bytes


def test_a_type_without_a_triton_kernel_is_sized_at_the_fallback() -> None:
    """A type no kernel takes (Q3_K here) is rounded again to Q8_0 and planned at that size."""
    q3k, q8 = gf.fmt("Q3_K"), gf.fmt(gf.FALLBACK)
    assert not q3k.gpu and q8.gpu
    n = 4096 * 4096
    weights = gguf_weights_from_tensors([("blk.0.attn_q.weight", "Q4_K", gf.fmt("Q4_K").nbytes(n)),
                                         ("blk.0.attn_k.weight", "Q3_K", q3k.nbytes(n)),
                                         ("output_norm.weight", "F32", 4096 * 4)], "a test file")
    p = plan(LLAMA_8B, hardware_for_gpu("RTX 4090", None, base=cpu_hw()), gguf=weights, gpu_gguf=LINE)
    assert p.weight_bytes == gf.fmt("Q4_K").nbytes(n) + q8.nbytes(n) + 4096 * 4
    assert weights.memory_bytes(LLAMA_8B, 2) == replace(weights, kernels="triton").memory_bytes(LLAMA_8B, 2)


def test_a_q4_k_m_file_that_does_not_fit_names_the_nearest_plan_that_keeps_its_blocks() -> None:
    """An 8 GiB card holds the 8B Q4_K_M for one chat of 8K tokens, not four: the message names
    the nearest plans, which keep the file's blocks too (a shorter context, fewer chats)."""
    weights = gguf_q4_k_m_weights(LLAMA_8B)
    hw = hardware_for_gpu("RTX 4060", None, base=cpu_hw())
    one = plan(LLAMA_8B, hw, context=8192, gguf=weights, gpu_gguf=LINE)
    assert one.quant == "gguf" and one.weight_bytes == weights.tensor_bytes and one.kv_tokens >= 8192
    with pytest.raises(DoesNotFit) as info:
        plan(LLAMA_8B, hw, context=8192, chats=4, gguf=weights, gpu_gguf=LINE)
    e = info.value
    assert "\n" not in str(e) and e.nearest is not None and e.nearest.quant == "gguf"
    assert e.nearest.precision_reason.startswith(LINE)
    assert e.suggestions[0].startswith("context 4,096 (gguf") and "2 chats at 8,192 tokens (gguf" in str(e)
