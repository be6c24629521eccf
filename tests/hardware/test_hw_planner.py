"""Planner decisions on consumer and datacenter GPUs, and on a machine without one."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hwfixtures import cpu_hw, gpu_hw
from test_hw_sizing import EngineConfig

from localllm.catalog import load_catalog
from localllm.errors import LocalLLMError
from localllm.hardware.planner import CPU_FIRST_COMPILE_BYTES, DoesNotFit, Plan, compare_memory, decode_tokens_per_s, plan
from localllm.hardware.probe import GiB, find_known_gpu, lookup_gpu

CATALOG = load_catalog()

# (GPU or None for no GPU, model, context, chats, expected precision).
# Ada (sm89) falls back to FP8, Ampere (sm86/sm80) to INT8; Hopper starts at FP8.
CASES = [
    ("RTX 4060", "qwen2.5-3b-instruct", 32768, 1, "fp8"),
    ("RTX 4060", "llama-3.1-8b-instruct", None, 1, "awq-int4"),
    ("RTX 3070", "qwen2.5-3b-instruct", 32768, 1, "int8"),
    ("RTX 3070", "llama-3.1-8b-instruct", None, 1, "awq-int4"),
    ("RTX 3060", "qwen2.5-3b-instruct", 32768, 1, "bf16"),
    ("RTX 3060", "llama-3.1-8b-instruct", None, 1, "int8"),
    ("RTX 3060", "llama-3.1-8b-instruct", 32768, 1, "awq-int4"),
    ("RTX 4080", "llama-3.1-8b-instruct", None, 1, "fp8"),
    ("RTX 4080", "qwen3-14b", None, 1, "awq-int4"),
    ("RTX 3090", "llama-3.1-8b-instruct", 32768, 1, "bf16"),
    ("RTX 3090", "qwen3-14b", None, 1, "int8"),
    ("RTX 3090", "qwen2.5-32b-instruct", None, 1, "awq-int4"),
    ("RTX 4090", "llama-3.1-8b-instruct", 32768, 1, "bf16"),
    ("RTX 4090", "llama-3.1-8b-instruct", 32768, 2, "fp8"),
    ("RTX 4090", "qwen3-14b", None, 1, "fp8"),
    ("RTX 4090", "qwen2.5-32b-instruct", 8192, 1, "awq-int4"),
    ("A100 80GB", "qwen2.5-32b-instruct", 32768, 1, "bf16"),
    ("A100 80GB", "llama-3.1-70b-instruct", None, 1, "int8"),
    ("H100", "llama-3.1-8b-instruct", None, 1, "fp8"),
    ("H100", "qwen2.5-32b-instruct", 32768, 4, "fp8"),
    ("H100", "llama-3.1-70b-instruct", None, 1, "fp8"),
    (None, "smollm2-135m-instruct", None, 1, "fp32"),
    (None, "smollm2-135m-instruct", 8192, 4, "fp32"),
    (None, "qwen2.5-7b-instruct", None, 1, "int8"),
]


@pytest.mark.parametrize("gpu, model_id, context, chats, precision", CASES)
def test_planner_decisions(gpu: str | None, model_id: str, context: int | None, chats: int, precision: str) -> None:
    hw = gpu_hw(gpu) if gpu else cpu_hw()
    entry = CATALOG[model_id]
    p = plan(entry, hw, context=context, chats=chats)
    assert p.precision == precision
    wanted = context or min(entry.max_context, 8192)
    # The pool holds what was asked for, and the whole plan stays inside the budget.
    assert p.kv_tokens >= wanted * chats
    assert p.max_model_len >= wanted
    assert p.max_model_len <= entry.max_context
    assert p.total_bytes <= p.budget_bytes
    assert p.max_num_seqs >= chats
    assert p.num_kv_blocks * p.block_size * p.kv_bytes_per_token == p.kv_bytes
    assert len(p.reasons) >= 6 and all(r and "\n" not in r for r in p.reasons)
    if gpu:
        assert p.device == "cuda" and p.kv_dtype == "bfloat16"
    else:
        assert p.device == "cpu" and p.kv_dtype == "float32" and not p.use_cuda_graphs


@pytest.mark.parametrize("gpu, model_id, context, chats", [
    ("RTX 4060", "qwen3-14b", None, 1),
    ("RTX 3070", "llama-3.1-8b-instruct", 32768, 1),
    ("RTX 3090", "llama-3.1-70b-instruct", None, 1),
    ("RTX 4090", "qwen2.5-32b-instruct", 32768, 1),
    ("H100", "llama-3.1-70b-instruct", 131072, 16),
    (None, "qwen2.5-32b-instruct", None, 1),
])
def test_nothing_fits_names_the_nearest_plan(gpu: str | None, model_id: str, context: int | None, chats: int) -> None:
    hw = gpu_hw(gpu) if gpu else cpu_hw()
    with pytest.raises(DoesNotFit) as info:
        plan(CATALOG[model_id], hw, context=context, chats=chats)
    e = info.value
    message = str(e)
    assert "\n" not in message and "does not fit" in message and "nearest that fits" in message
    assert e.nearest is not None and e.suggestions
    assert e.nearest.total_bytes <= e.nearest.budget_bytes


def test_a_shorter_context_is_suggested_when_the_weights_fit() -> None:
    with pytest.raises(DoesNotFit) as info:
        plan(CATALOG["qwen2.5-32b-instruct"], gpu_hw("RTX 4090"), context=32768)
    e = info.value
    assert e.nearest is not None and e.nearest.model == "qwen2.5-32b-instruct"
    assert 8192 <= e.nearest.max_model_len < 32768
    assert any(s.startswith("context ") for s in e.suggestions)


def test_seed_sixteen_128k_sequences_of_llama_70b_fit_nowhere() -> None:
    with pytest.raises(DoesNotFit) as info:
        plan(CATALOG["llama-3.1-70b-instruct"], gpu_hw("H100"), context=131072, chats=16)
    # ~690 GB of bf16 KV alone, ~345 GB as FP8: far beyond one H100 even with int4 weights.
    assert info.value.needed_bytes > 16 * 131072 * 163_840
    assert "even as awq-int4 with an fp8 KV cache" in str(info.value)


def test_hopper_takes_the_full_path() -> None:
    p = plan(CATALOG["llama-3.1-8b-instruct"], gpu_hw("H100"))
    assert (p.quant, p.use_cuda_graphs, p.max_num_seqs) == ("fp8", True, 256)
    assert p.max_model_len == 131072  # no context given: the pool holds the model's full context
    assert "Hopper" in p.reasons[2]
    consumer = plan(CATALOG["llama-3.1-8b-instruct"], gpu_hw("RTX 4090"))
    assert consumer.max_num_seqs < p.max_num_seqs


def test_fp8_on_a_card_without_fp8_tensor_cores_is_storage_only() -> None:
    p = plan(CATALOG["llama-3.1-8b-instruct"], gpu_hw("RTX 3090"), quant="fp8")
    assert p.quant == "fp8" and "storage only" in p.reasons[2]


def test_explicit_quant_and_dtype_are_honoured() -> None:
    p = plan(CATALOG["qwen3-8b"], gpu_hw("A100 80GB"), quant="awq")
    assert p.precision == "awq-int4"
    p = plan(CATALOG["smollm2-135m-instruct"], cpu_hw(("avx2", "avx512_bf16")), dtype="float32")
    assert p.weight_dtype == "float32"
    with pytest.raises(LocalLLMError, match="compute capability 8.0"):
        plan(CATALOG["qwen3-8b"], gpu_hw("T4"), dtype="bfloat16")
    assert plan(CATALOG["qwen3-0.6b"], gpu_hw("T4")).weight_dtype == "float16"


def test_cpu_precision_follows_the_isa() -> None:
    entry = CATALOG["smollm2-135m-instruct"]
    assert plan(entry, cpu_hw(("avx2",))).weight_dtype == "float32"
    for flag in ("avx512_bf16", "amx_bf16"):
        p = plan(entry, cpu_hw(("avx2", flag)))
        assert p.weight_dtype == "bfloat16" and p.kv_dtype == "float32"


def test_cpu_pool_is_context_times_chats() -> None:
    entry = CATALOG["smollm2-135m-instruct"]
    p = plan(entry, cpu_hw(), chats=2)
    assert p.kv_tokens == 8192 * 2
    assert p.kv_bytes == 8192 * 2 * 46_080
    # What a MemoryMeter sees on CPU: weights + KV + workspace + the runtime allowance.
    assert p.expected_measured_bytes == p.weight_bytes + p.kv_bytes + p.workspace_bytes + p.runtime_bytes
    assert p.context_bytes == 0


def test_gpu_budget_respects_free_memory() -> None:
    hw = gpu_hw("RTX 4090")
    busy = replace(hw, gpus=(replace(hw.gpus[0], free_bytes=int(12 * GiB)),))
    p = plan(CATALOG["qwen2.5-3b-instruct"], busy)
    assert p.budget_bytes == int(12 * GiB) and "free" in p.reasons[1]


def test_the_engine_config_is_planned_like_a_catalog_entry() -> None:
    p = plan(EngineConfig(), cpu_hw())
    assert p.max_model_len == 8192 and p.kv_bytes_per_token == 46_080
    with pytest.raises(LocalLLMError, match="maximum of 8,192"):
        plan(EngineConfig(), cpu_hw(), context=16384)


@pytest.mark.parametrize("kwargs, match", [
    ({"context": 0}, "context must be a positive"),
    ({"context": -5}, "context must be a positive"),
    ({"chats": 0}, "chats must be at least 1"),
    ({"quant": "int3"}, "unknown quantization"),
    ({"dtype": "float8"}, "unknown dtype"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ({"block_size": 12}, "power of two"),
])
def test_bad_input_is_one_line(kwargs: dict, match: str) -> None:
    with pytest.raises(LocalLLMError, match=match) as info:
        plan(CATALOG["qwen3-8b"], gpu_hw("RTX 4090"), **kwargs)
    assert "\n" not in str(info.value)


def test_summary_and_dict() -> None:
    p = plan(CATALOG["qwen3-8b"], gpu_hw("RTX 4090"))
    text = p.summary()
    assert "qwen3-8b on cuda" in text and all(r in text for r in p.reasons)
    d = p.to_dict()
    assert d["precision"] == p.precision and d["total_bytes"] == p.total_bytes
    assert isinstance(p, Plan)


def test_decode_bound_is_bandwidth_over_bytes_per_token() -> None:
    p = plan(CATALOG["llama-3.1-8b-instruct"], gpu_hw("RTX 4090"))
    bound = decode_tokens_per_s(p, 1008, 8192)
    assert bound == pytest.approx(1008e9 / (p.decode_read_bytes + 8192 * p.kv_bytes_per_token))
    assert bound is not None and 50 < bound < 70  # llama.cpp reports ~61 tok/s for a 7B in F16 on this card
    assert decode_tokens_per_s(p, None, 8192) is None


def test_compare_memory_within_ten_percent() -> None:
    p = plan(CATALOG["smollm2-135m-instruct"], cpu_hw())
    assert compare_memory(p, int(p.expected_measured_bytes * 1.05)).ok
    assert not compare_memory(p, int(p.expected_measured_bytes * 1.2)).ok
    # a start that compiled its decode graphs (rather than loading them) holds more, and is held to that
    first = compare_memory(p, p.expected_measured_bytes + CPU_FIRST_COMPILE_BYTES, compiled_graphs=2)
    assert first.predicted_bytes == p.expected_measured_bytes + CPU_FIRST_COMPILE_BYTES and first.error == 0


@pytest.mark.parametrize("nvml_name, vram_gib, expected", [
    ("NVIDIA GeForce RTX 4060 Ti", 8, "RTX 4060 Ti"),
    ("NVIDIA GeForce RTX 4060 Ti", 16, "RTX 4060 Ti 16GB"),
    ("NVIDIA GeForce RTX 4060", 8, "RTX 4060"),
    ("NVIDIA A100-SXM4-40GB", 40, "A100 40GB"),
    ("NVIDIA A100-SXM4-80GB", 80, "A100 80GB"),
    ("NVIDIA H100 80GB HBM3", 80, "H100"),
    ("NVIDIA H200", 140, "H200"),
    ("NVIDIA L4", 22, "L4"),
    ("NVIDIA L40S", 45, "L40S"),
    ("Tesla T4", 15, "T4"),
    ("NVIDIA RTX A6000", 48, "RTX A6000"),
])
def test_device_names_map_to_the_gpu_table(nvml_name: str, vram_gib: float, expected: str) -> None:
    known = find_known_gpu(nvml_name, int(vram_gib * GiB))
    assert known is not None and known.name == expected


def test_typed_gpu_names() -> None:
    assert lookup_gpu("rtx4090").name == "RTX 4090"
    assert lookup_gpu("4090").name == "RTX 4090"
    assert lookup_gpu("a100").vram_gib == 80
    with pytest.raises(LocalLLMError, match="unknown GPU 'RTX 9999'"):
        lookup_gpu("RTX 9999")
    assert gpu_hw("RTX 4060 Ti", 16).gpu.total_bytes == 16 * GiB  # type: ignore[union-attr]
