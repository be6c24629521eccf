"""Planner decisions on consumer and datacenter GPUs, and on a machine without one."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hwfixtures import cpu_hw, gpu_hw
from test_hw_sizing import EngineConfig

from localllm.catalog import load_catalog
from localllm.errors import LocalLLMError
from localllm.hardware.planner import CPU_FIRST_COMPILE_BYTES, Beside, DoesNotFit, Plan, compare_memory, decode_tokens_per_s, plan
from localllm.hardware.probe import GiB, MiB, Hardware, find_known_gpu, hardware_for_gpu, lookup_gpu
from localllm.hardware.sizing import gguf_catalog_weights

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


def _held_by_others(hw: Hardware, gib: float) -> Hardware:
    """The card as NVML reports it with ``gib`` held by other processes (the desktop, a browser)."""
    gpu = hw.gpus[0]
    return replace(hw, gpus=(replace(gpu, free_bytes=gpu.total_bytes - int(gib * GiB)),))


def test_gpu_budget_respects_free_memory() -> None:
    busy = _held_by_others(gpu_hw("RTX 4090"), 12)
    p = plan(CATALOG["qwen2.5-3b-instruct"], busy)
    # free, less the reserve for the engine's transients and the margin: none of it planned
    assert p.budget_bytes == int(12 * GiB) - p.reserve_bytes - p.margin_bytes
    assert p.others_bytes == 12 * GiB and "free" in p.reasons[1] and "12.0 GiB held by other processes" in p.reasons[1]


def test_the_held_figure_is_nvmls_per_process_one_and_the_budget_comes_from_free() -> None:
    hw = _held_by_others(gpu_hw("RTX 4090"), 3)  # NVML: 3 GiB used, of which the processes' own 2 GiB
    hw = replace(hw, gpus=(replace(hw.gpus[0], others_bytes=2 * GiB),))
    p = plan(CATALOG["llama-3.1-8b-instruct"], hw, quant="awq")
    assert p.others_bytes == 2 * GiB and "2.0 GiB held by other processes" in p.reasons[1]
    assert p.budget_bytes == 21 * GiB - p.reserve_bytes - p.margin_bytes


# A 24 GB card on a desktop whose display and browser hold 2 GB: the RTX 4090 (sm89) and any
# 24 GiB card (--vram 24: assumed sm86).
DESKTOP_24GB = [("RTX 4090", None), (None, 24)]


@pytest.mark.parametrize("gpu, vram", DESKTOP_24GB)
@pytest.mark.parametrize("quant", ["awq", "gguf"])
def test_a_24gb_card_with_2gb_held_by_others_plans_llama_8b_with_room_to_spare(
    gpu: str | None, vram: float | None, quant: str
) -> None:
    entry = CATALOG["llama-3.1-8b-instruct"]
    hw = _held_by_others(hardware_for_gpu(gpu, vram, base=cpu_hw()), 2)
    free = hw.gpus[0].free_bytes
    gguf = gguf_catalog_weights(entry) if quant == "gguf" else None
    p = plan(entry, hw, quant=quant, gguf=gguf)
    assert p.device == "cuda" and p.quant == quant and p.use_cuda_graphs and p.time_gemm_candidates
    if quant == "gguf":  # the published Q4_K_M file (4.92 GB); a type without a kernel at Q8_0's size
        assert gguf is not None and gguf.tensor_bytes == entry.gguf_sizes["Q4_K_M"] == 4_920_000_000
        assert p.weight_bytes == gguf.memory_bytes(entry, 2) >= 4_920_000_000
    # Room to spare: the model's whole 8K default and far more, at 16-bit KV.
    assert p.kv_dtype == "bfloat16" and p.kv_tokens >= 65_536 and p.max_model_len >= 65_536
    # The reserve (the torch GEMM candidate for the largest matrix, the autotune buffer, cuBLAS)
    # and the margin are left unallocated: nothing the plan counts may use them.
    assert p.others_bytes == 2 * GiB
    candidate = 4096 * 28672 * 12  # gate_up_proj dequantized by the torch candidate
    assert p.reserve_bytes >= candidate + 256 * MiB
    assert free - p.total_bytes >= p.reserve_bytes + p.margin_bytes
    assert p.total_bytes <= p.budget_bytes
    # ... and the plan says so, item by item.
    assert "2.0 GiB held by other processes" in p.reasons[1] and "reserve" in p.reasons[1]
    line = p.reasons[-1]
    assert line.startswith("reserve ") and all(
        word in line for word in ("GEMM choice", "gate_up_proj 4096x28672", "autotune", "cuBLAS", "CUDA context"))
    assert "held by other processes" in p.to_dict()["reasons"][1] and p.to_dict()["reserve_bytes"] == p.reserve_bytes


@pytest.mark.parametrize("gpu, model_id, context, chats, precision", [c for c in CASES if c[0]])
def test_the_reserve_and_margin_are_never_planned(
    gpu: str, model_id: str, context: int | None, chats: int, precision: str
) -> None:
    hw = _held_by_others(gpu_hw(gpu), 1)
    try:
        p = plan(CATALOG[model_id], hw, context=context, chats=chats)
    except DoesNotFit as e:  # a desktop's 1 GiB can tip a tight case over: then the nearest plan keeps it
        assert e.nearest is not None
        p = e.nearest
    assert hw.gpus[0].free_bytes - p.total_bytes >= p.reserve_bytes + p.margin_bytes > 0


def test_a_draft_model_takes_its_share_before_the_kv_pool_is_sized() -> None:
    # an H200 run: the target's pool took the card and the draft's mirror of it (as many
    # blocks) did not fit; with the draft beside, both pools and the draft's weights fit
    hw = _held_by_others(gpu_hw("RTX 4090"), 2)
    target, draft = CATALOG["llama-3.1-8b-instruct"], CATALOG["llama-3.2-1b-instruct"]
    alone = plan(target, hw, quant="awq")
    d = plan(draft, hw, chats=1)
    beside = Beside(d.model, d.weight_bytes + d.workspace_bytes + d.runtime_bytes, d.kv_bytes_per_token)
    p = plan(target, hw, quant="awq", beside=beside)
    assert p.beside_bytes == beside.bytes + p.kv_tokens * beside.kv_bytes_per_token == beside.bytes_for(p.kv_tokens)
    assert p.num_kv_blocks < alone.num_kv_blocks
    assert p.weight_bytes + p.kv_bytes + p.overhead_bytes + p.beside_bytes == p.total_bytes <= p.budget_bytes
    assert hw.gpus[0].free_bytes - p.total_bytes >= p.reserve_bytes + p.margin_bytes
    assert p.expected_measured_bytes == alone.expected_measured_bytes - alone.kv_bytes + p.kv_bytes  # the target's own
    assert any(r.startswith(f"draft model {d.model}:") for r in p.reasons) and "draft model" in p.summary()
    # on a CPU the pool is what the chats need: the draft only has to fit beside it
    cpu = plan(CATALOG["qwen2.5-0.5b-instruct"], cpu_hw(), beside=beside)
    assert cpu.beside_bytes == beside.bytes + cpu.kv_tokens * beside.kv_bytes_per_token


def test_a_card_too_small_refuses_in_one_line_naming_the_nearest_plan() -> None:
    hw = _held_by_others(gpu_hw("RTX 4060"), 2)  # 8 GiB, 6 free
    with pytest.raises(DoesNotFit) as info:
        plan(CATALOG["llama-3.1-8b-instruct"], hw, quant="awq")
    e = info.value
    message = str(e)
    assert "\n" not in message and message.startswith("llama-3.1-8b-instruct does not fit on RTX 4060")
    assert "2.0 GiB held by other processes" in message and "reserve for the engine's transients" in message
    # the nearest plan, with its numbers
    assert "nearest that fits: " in message and " of a " in message and " budget" in message
    assert e.nearest is not None and e.nearest.total_bytes <= e.nearest.budget_bytes
    assert hw.gpus[0].free_bytes - e.nearest.total_bytes >= e.nearest.reserve_bytes + e.nearest.margin_bytes
    assert e.suggestions and all("budget" in s for s in e.suggestions)


def test_a_pinned_precision_that_does_not_fit_names_the_quantized_plan_that_does() -> None:
    with pytest.raises(DoesNotFit) as info:
        plan(CATALOG["llama-3.1-8b-instruct"], gpu_hw("RTX 4060"), quant="fp8")  # 8 GB of weights, 8 GiB card
    e = info.value
    assert "\n" not in str(e) and "as fp8" in str(e)
    assert e.nearest is not None and e.nearest.precision == "awq-int4"
    assert any(s.startswith("awq-int4 weights at 8,192 tokens (awq-int4, ") for s in e.suggestions), e.suggestions


def test_the_gemm_candidates_room_goes_before_a_precision_on_a_small_card() -> None:
    p = plan(CATALOG["llama-3.1-8b-instruct"], gpu_hw("RTX 4060"))
    assert p.precision == "awq-int4" and not p.time_gemm_candidates
    assert not any(k.startswith("GEMM choice") for k in p.reserve)
    assert "no room kept for the GEMM choice's torch candidate (gate_up_proj" in p.reasons[7]


def test_cpu_plans_keep_no_gpu_reserve() -> None:
    p = plan(CATALOG["smollm2-135m-instruct"], cpu_hw())
    assert p.reserve == {} and p.reserve_bytes == p.others_bytes == p.margin_bytes == 0
    assert not any(r.startswith("reserve ") for r in p.reasons)


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


def test_a_plan_takes_no_write_after_the_planner() -> None:
    """plan() is a Plan's one writer: no field, nor the reasons or the reserve inside one, can
    be changed after (what loading adds goes on the LoadedModel)."""
    p = plan(CATALOG["qwen3-8b"], gpu_hw("RTX 4090"))
    with pytest.raises(AttributeError):
        p.num_kv_blocks = 1  # type: ignore[misc]
    with pytest.raises(AttributeError):
        p.reasons.append("a loader's note")  # type: ignore[attr-defined]
    with pytest.raises(TypeError):
        p.reserve["more"] = 1  # type: ignore[index]
    d = p.to_dict()
    assert d["reasons"] == list(p.reasons) and d["reserve"] == dict(p.reserve) and p.reserve_bytes > 0


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


def test_a_checkpoint_too_big_in_floats_names_its_own_q4_k_m_gguf_first() -> None:
    # gpt-oss-20b's experts stay in floats under awq-int4 (39 GiB); its GGUF keeps them in MXFP4
    with pytest.raises(DoesNotFit) as info:
        plan(CATALOG["gpt-oss-20b"], gpu_hw("RTX 4090"))
    e = info.value
    assert e.suggestions[0].startswith("its Q4_K_M GGUF from bartowski/openai_gpt-oss-20b-GGUF at 8,192 tokens (gguf, ")
    assert e.nearest is not None and e.nearest.quant == "gguf"
    assert e.nearest.weight_bytes == gguf_catalog_weights(CATALOG["gpt-oss-20b"]).memory_bytes(CATALOG["gpt-oss-20b"], 2)
    # a GGUF plan that does not fit has no GGUF of itself to suggest
    with pytest.raises(DoesNotFit) as info:
        plan(CATALOG["llama-3.1-70b-instruct"], gpu_hw("RTX 4090"), quant="gguf",
             gguf=gguf_catalog_weights(CATALOG["llama-3.1-70b-instruct"]))
    assert not any(s.startswith("its Q4_K_M GGUF") for s in info.value.suggestions)
