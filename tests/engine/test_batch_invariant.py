"""--deterministic on the real default model, in each CPU plan kind (its GGUF blocks, and its
weights as fp32 and as bf16): a prompt's greedy tokens, and their logprobs to the last bit,
are the same alone or in a busy batch, chunked differently, with prefix-cache hits; plans it
cannot make invariant are refused in one line."""

from __future__ import annotations

import importlib
import random
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from localllm.engine.batch_invariant import InvariantLinear
from localllm.engine.engine import EngineConfig, LLMEngine
from localllm.engine.sequence import SamplingParams
from localllm.errors import LocalLLMError
from localllm.kernels import _triton
from localllm.models.llama import Attention
from localllm.quant.gguf import GGUFLinear
from tests.engine.test_rehearsal import TINY, Launches, _engine, launches, rehearse  # noqa: F401 - fixtures
from tests.models.test_random_models import tokenizer_folder, write_random_model  # noqa: F401 - fixture
from tests.tiers import matrix

invariant_gemm = importlib.import_module("localllm.kernels.invariant_gemm")

SUBJECTS = ["the ocean", "a red bicycle", "mountains", "bread baking", "the moon", "chess", "rainy days",
            "a library", "trains", "volcanoes"]


# CI: the GGUF plan and a float one (bf16: its kernel path and the 16-bit head's top-8 recompute);
# fp32 is the matrix's other case (its kernel rows: tests/kernels/test_dense_linear.py)
PLANS = matrix(["auto", "bfloat16", "float32"], ci=["auto", "bfloat16"])


@pytest.fixture(scope="module", params=PLANS)
def engine(request, default_model_path) -> LLMEngine:
    # a 96-token step budget splits the longer prompts into chunks whose sizes depend on what
    # else is running: above and below the sizes where the fast paths would switch kernels
    return LLMEngine(EngineConfig(model=str(default_model_path), device="cpu", dtype=request.param,
                                  deterministic=True, max_num_batched_tokens=96))


def test_the_plan_runs_every_row_on_the_batch_independent_kernels(engine: LLMEngine) -> None:
    model = engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, (nn.Linear, GGUFLinear))]
    if engine.plan.precision == "gguf":
        assert all(m.dense_rows > 10**9 for m in linears if isinstance(m, GGUFLinear))
    else:  # every float linear, the LM head included, on the batch-invariant kernel
        assert linears and all(type(m) is InvariantLinear for m in linears)
        assert model.lm_head.out_dtype == torch.float32
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
    with pytest.raises(LocalLLMError, match="--deterministic covers fp32, bf16 and GGUF plans") as e:
        LLMEngine(EngineConfig(model=str(default_model_path), device="cpu", dtype="float32", quant="int8",
                               deterministic=True))
    assert "\n" not in str(e.value)


# ---- the GPU path, rehearsed: the Triton kernels on CPU tensors under the interpreter ----


@pytest.fixture(scope="module")
def small_vocab_model(tokenizer_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    # the tiny rehearsal model with a 1,024-row head: the interpreter pays per element loaded,
    # and a 49k-row head cost ~90% of this test's time
    return write_random_model(tmp_path_factory.mktemp("tiny") / "llama", "LlamaForCausalLM", tokenizer_folder,
                              vocab=1024, **TINY)


@pytest.mark.skipif(not (_triton.HAS_TRITON and _triton.INTERPRET), reason="rehearsal needs TRITON_INTERPRET=1")
def test_the_triton_path_gives_the_same_tokens_alone_and_batched(
    small_vocab_model: Path, rehearse: Callable[[bool], None], launches: Launches,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # What a GPU would run under --deterministic (fixed-tile GEMM for every float linear,
    # one key slice per decode row), rehearsed: it shows the dispatch and the launch
    # configurations are fixed whatever the batch; the GPU's own MMA order is not tested here.
    gemm = Counter[int]()
    run = invariant_gemm._invariant_gemm_kernel.run

    def counted(*args: Any, **kw: Any) -> Any:
        gemm[args[4]] += 1  # by M
        return run(*args, **kw)

    monkeypatch.setattr(invariant_gemm._invariant_gemm_kernel, "run", counted)
    rehearse(True)
    engine = _engine(small_vocab_model, deterministic=True, max_num_batched_tokens=12)
    assert all(type(m) is InvariantLinear for m in engine.runner.model.modules() if isinstance(m, nn.Linear))
    rng = random.Random(5)
    shared = [rng.randrange(100, 1024) for _ in range(16)]  # two cached blocks of 8: prefix hits
    prompts = [shared + [rng.randrange(100, 1024) for _ in range(n)] for n in (1, 4, 9, 13)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1)
    solo: dict[str, list] = {}
    for i, p in enumerate(prompts):
        solo.update(_run(engine, [(f"s{i}", p, 0)], params))
    batched = _run(engine, [(f"b{i}", p, i % 2) for i, p in enumerate(prompts)], params)
    assert [batched[f"b{i}"] for i in range(len(prompts))] == [solo[f"s{i}"] for i in range(len(prompts))]
    assert engine.stats().prefix_cache_hit_tokens >= 16
    assert len(gemm) > 2, f"the fixed-tile GEMM ran at too few batch sizes: {dict(gemm)}"
    assert launches.counts["attention decode"] and not launches.counts["attention decode split-K"], dict(launches.counts)
