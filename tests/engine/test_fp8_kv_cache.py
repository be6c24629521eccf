"""The FP8 (e4m3) KV cache on the CPU engine with the real default model: a quarter of the fp32
pool, the same answer, scales that really reach the cache, and clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from localllm import LLM, SamplingParams
from localllm.errors import LocalLLMError
from localllm.quant.kv_cache import FP8_MAX, HEADROOM, calibration_prompt
from tests.test_cli import cli_here

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def _llm(path: Path, **kw: object) -> LLM:
    return LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=64, max_model_len=1024, **kw)


def test_fp8_cache_gives_the_reference_answer_in_a_quarter_of_the_memory(default_model_path: Path) -> None:
    llm = _llm(default_model_path, kv_cache_dtype="fp8")
    runner = llm.engine.runner
    assert runner.kv_caches[0][0].dtype == torch.float8_e4m3fn and llm.engine.plan.kv_dtype == "fp8"
    assert runner.kv_bytes == 2 * 30 * 64 * 16 * 3 * 64  # one byte per value: fp32 would be 4x
    assert torch.equal(runner.kv_scales, torch.ones(2, 30, 1))  # vLLM's default scales
    out = llm.chat(FRANCE, SamplingParams(temperature=0, max_tokens=16))[0]
    assert out.outputs[0].text == "The capital of France is Paris."


def test_calibrated_scales_reach_the_cache(default_model_path: Path) -> None:
    llm = _llm(default_model_path, kv_cache_dtype="fp8_e4m3", calculate_kv_scales=True)
    engine = llm.engine
    assert engine.kv_scales is not None and len(engine.kv_scales) == 30
    assert all(0 < k < 1 and 0 < v < 1 for k, v in engine.kv_scales)  # keys reach ~20 here, values ~10
    layer = engine.runner.model.model.layers[5].self_attn
    assert float(layer.k_scale) == pytest.approx(engine.kv_scales[5][0])
    # Prefill the calibration prompt itself: each layer's largest stored |K| and |V| is then
    # its calibration maximum over its scale, 448 / HEADROOM, up to e4m3 steps (16 there) and
    # the FP8 noise earlier layers add. Scales that never reached the kernels would leave the
    # raw values (~20) in the cache.
    ids = calibration_prompt(engine.tokenizer)
    rid = engine.add_request(ids, SamplingParams(temperature=0, max_tokens=2))
    engine.step()
    table = engine.requests[rid].seq.block_table
    kv = torch.stack([torch.stack((k[table], v[table])) for k, v in engine.runner.kv_caches], dim=1)  # [2, layers, ...]
    stored = kv.reshape(2, 30, -1, 3, 64)[:, :, : len(ids)].float().abs().amax(dim=(2, 3, 4))
    assert torch.allclose(stored, torch.full_like(stored, FP8_MAX / HEADROOM), rtol=0.2), stored
    engine.abort_request(rid)


def test_an_unknown_kv_cache_dtype_is_refused(default_model_path: Path) -> None:
    with pytest.raises(LocalLLMError, match="unknown KV cache dtype 'int4'; use one of auto, fp8, fp8_e4m3"):
        _llm(default_model_path, kv_cache_dtype="int4")
    result = cli_here("run", "--kv-cache-dtype", "fp4", "hi")  # argparse refuses it: no process needed
    assert result.returncode == 2 and "invalid choice: 'fp4'" in result.stderr
