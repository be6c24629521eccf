"""The planner's KV cache dtype: 16-bit while that fits, FP8 on sm89+ when only FP8 fits, FP8
when asked; and the probe showing it."""

from __future__ import annotations

import json

import pytest
from hwfixtures import cpu_hw, gpu_hw

from localllm.catalog import load_catalog
from localllm.cli import main
from localllm.errors import LocalLLMError
from localllm.hardware.planner import DoesNotFit, plan
from localllm.hardware.sizing import kv_bytes_per_token

CATALOG = load_catalog()
LLAMA_70B = CATALOG["llama-3.1-70b-instruct"]


def test_llama_70b_at_128k_fits_an_h100_with_an_fp8_cache() -> None:
    p = plan(LLAMA_70B, gpu_hw("H100"), context=131072)
    assert (p.precision, p.kv_dtype) == ("awq-int4", "fp8")
    assert p.kv_bytes_per_token == kv_bytes_per_token(LLAMA_70B, "bfloat16") // 2 == 163_840
    assert p.kv_tokens >= 131072 and p.max_model_len == 131072
    assert p.total_bytes <= p.budget_bytes
    kv_reason = p.reasons[3]
    assert kv_reason.startswith("KV cache fp8 (e4m3): a 16-bit cache leaves room for ")
    assert "of 131,072 KV tokens even with awq-int4 weights" in kv_reason and "sm90 supports FP8" in kv_reason
    assert "\n" not in kv_reason
    # The weights line says what FP8 weights would have left, with the FP8 cache.
    assert "fp8 with an fp8 KV cache leaves room for" in p.precision_reason


def test_without_fp8_support_the_cache_stays_16_bit() -> None:
    # An A100 (sm80) has no FP8: the same request does not fit, and the message offers no FP8.
    with pytest.raises(DoesNotFit) as info:
        plan(LLAMA_70B, gpu_hw("A100 80GB"), context=131072)
    assert "fp8 KV" not in str(info.value) and "even as awq-int4 (needs" in str(info.value)
    assert info.value.kv_bytes_per_token == kv_bytes_per_token(LLAMA_70B, "bfloat16")


def test_an_fp8_cache_is_only_taken_where_nothing_fits_without_it() -> None:
    # RTX 4090, Llama 8B at 32K x 2: FP8 weights with a bf16 cache fit, so the cache stays bf16.
    p = plan(CATALOG["llama-3.1-8b-instruct"], gpu_hw("RTX 4090"), context=32768, chats=2)
    assert (p.precision, p.kv_dtype) == ("fp8", "bfloat16")
    # Asked for, the FP8 cache leaves room for bf16 weights.
    asked = plan(CATALOG["llama-3.1-8b-instruct"], gpu_hw("RTX 4090"), context=32768, chats=2, kv_cache_dtype="fp8")
    assert (asked.precision, asked.kv_dtype) == ("bf16", "fp8")
    assert asked.reasons[3] == "KV cache fp8 (e4m3) as asked: half the bytes per token of a 16-bit cache (sm89 supports FP8)"
    assert plan(CATALOG["llama-3.1-8b-instruct"], gpu_hw("RTX 4090"), context=32768, chats=2,
                kv_cache_dtype="fp8_e4m3").to_dict() == asked.to_dict()


def test_fp8_cache_on_the_cpu_is_a_storage_option() -> None:
    entry = CATALOG["smollm2-135m-instruct"]
    fp32 = plan(entry, cpu_hw(), chats=2)
    fp8 = plan(entry, cpu_hw(), chats=2, kv_cache_dtype="fp8")
    assert (fp32.kv_dtype, fp8.kv_dtype) == ("float32", "fp8")
    assert fp8.kv_bytes * 4 == fp32.kv_bytes and fp8.kv_tokens == fp32.kv_tokens
    assert "saves memory, not time" in fp8.reasons[3]


@pytest.mark.parametrize("hw, value, message", [
    (gpu_hw("RTX 3090"), "fp8", "an fp8 KV cache needs compute capability 8.9+ (RTX 40xx, L4, H100); RTX 3090 is 8.6"),
    (cpu_hw(), "int4", "unknown KV cache dtype 'int4'; use one of auto, fp8, fp8_e4m3"),
])
def test_bad_kv_cache_dtypes_are_one_line_errors(hw, value: str, message: str) -> None:  # noqa: ANN001
    with pytest.raises(LocalLLMError) as info:
        plan(CATALOG["smollm2-135m-instruct"], hw, kv_cache_dtype=value)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_probe_shows_the_fp8_cache(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["probe", "--gpu", "H100", "--context", "131072", "--model", "llama-3.1-70b-instruct"]
    assert main([*args, "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["models"]
    assert (row["status"], row["precision"], row["kv_dtype"]) == ("fits", "awq-int4", "fp8")
    assert row["kv_bytes_per_token"] == 163_840 and row["kv_reason"].startswith("KV cache fp8")
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "awq-int4 + fp8 KV" in out and "FP8 halves the bytes per token" in out


def test_probe_rejects_an_unknown_kv_cache_dtype(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["probe", "--kv-cache-dtype", "int4"])
    assert info.value.code == 2 and "invalid choice: 'int4'" in capsys.readouterr().err
