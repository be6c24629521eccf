"""--deterministic on the real default model (its GGUF plan): a prompt's greedy tokens are the
same alone or in a busy batch, chunked differently, with prefix-cache hits; plans it cannot
make invariant are refused in one line."""

from __future__ import annotations

import random

import pytest

from localllm.engine.engine import EngineConfig, LLMEngine
from localllm.engine.sequence import SamplingParams
from localllm.errors import LocalLLMError
from localllm.models.llama import Attention
from localllm.quant.gguf import GGUFLinear

SUBJECTS = ["the ocean", "a red bicycle", "mountains", "bread baking", "the moon", "chess", "rainy days",
            "a library", "trains", "volcanoes"]


@pytest.fixture(scope="module")
def engine(default_model_path) -> LLMEngine:
    # a 96-token step budget splits the longer prompts into chunks whose sizes depend on what
    # else is running: above and below the sizes where the fast paths would switch kernels
    return LLMEngine(EngineConfig(model=str(default_model_path), device="cpu", deterministic=True,
                                  max_num_batched_tokens=96))


def test_the_plan_runs_every_row_on_the_batch_independent_kernels(engine: LLMEngine) -> None:
    model = engine.runner.model
    assert engine.plan.precision == "gguf"
    assert all(m.dense_rows > 10**9 for m in model.modules() if isinstance(m, GGUFLinear))
    assert all(m.batch_invariant for m in model.modules() if isinstance(m, Attention))
    assert not engine.runner._decode_gives_logits  # eager decode: no fused graph beside eager mixed steps


def _run(engine: LLMEngine, requests: list[tuple[str, list[int], int]], params: SamplingParams) -> dict[str, list]:
    """Each request's tokens with their logprobs: equal floats mean equal numbers all the way
    down, a far stronger check than equal greedy tokens."""
    results: dict[str, list] = {}
    pending = sorted(requests, key=lambda r: r[2])
    step = 0
    while pending or engine.has_unfinished():
        while pending and pending[0][2] <= step:
            rid, prompt, _ = pending.pop(0)
            engine.add_request(prompt, params, rid)
        for out in engine.step():
            if out.finished:
                results[out.request_id] = list(zip(out.outputs[0].token_ids, out.outputs[0].logprobs))
        step += 1
    return results


def test_greedy_tokens_do_not_depend_on_the_batch(engine: LLMEngine) -> None:
    tok = engine.tokenizer
    rng = random.Random(11)
    system = "You are a careful assistant who answers in plain words. " * 3  # shared: prefix-cache hits
    pads = [0, 4, 9, 17, 26, 38, 51, 67, 84, 120]  # prompt lengths from below to well past the step budget
    prompts = [tok.encode(system + "Please " * n + f"write two lines about {s}:") for n, s in zip(pads, SUBJECTS)]
    assert max(len(p) for p in prompts) > 96 > min(len(p) for p in prompts) > 16
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    solo: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        solo.update(_run(engine, [(f"s{i}", p, 0)], params))
    hits_before = engine.stats().prefix_cache_hit_tokens
    batched = _run(engine, [(f"b{i}", p, rng.randint(0, 6)) for i, p in enumerate(prompts)], params)
    assert engine.stats().prefix_cache_hit_tokens > hits_before
    assert [batched[f"b{i}"] for i in range(len(prompts))] == [solo[f"s{i}"] for i in range(len(prompts))]


def test_a_plan_it_cannot_make_invariant_is_refused_in_one_line(default_model_path) -> None:
    with pytest.raises(LocalLLMError, match="--deterministic covers GGUF block plans") as e:
        LLMEngine(EngineConfig(model=str(default_model_path), device="cpu", dtype="float32", deterministic=True))
    assert "\n" not in str(e.value)
