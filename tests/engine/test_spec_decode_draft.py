"""Speculative decoding with a draft model: the rejection sampler keeps the target's
distribution whatever the draft's (a model-free chi-square test on a small vocabulary); on the
real default model drafting for itself, greedy output is the one without speculation (batched,
preempted, with prefix hits, stop strings and token limits), sampled requests go through the
rejection sampler, and the blocks of both pools are freed; a draft of another tokenizer is
refused in one line."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest
import torch

from localllm.engine.sequence import SamplingParams
from localllm.engine.spec_decode import SpeculativeConfig, rejection_sample, speculative_config
from localllm.errors import LocalLLMError

# ---- the rejection sampler, model-free ----

VOCAB = 5
# the target's distribution at positions 0, 1, 2 (a zero: a token a top-k cut removed) and a
# draft's that is close but not equal, with mass where the target has none
P = torch.tensor([[0.40, 0.25, 0.20, 0.15, 0.00],
                  [0.05, 0.10, 0.50, 0.05, 0.30],
                  [0.30, 0.30, 0.10, 0.20, 0.10]], dtype=torch.float64)
Q = torch.tensor([[0.20, 0.40, 0.10, 0.10, 0.20],
                  [0.25, 0.25, 0.25, 0.15, 0.10],
                  [0.10, 0.50, 0.10, 0.10, 0.20]], dtype=torch.float64)
# chi-square critical value for 4 degrees of freedom at p = 0.001 (scipy.stats.chi2.isf(1e-3, 4))
CHI2_CRIT_4 = 18.467


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = float(counts.sum())
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token of no target mass came out"
    expected = probs[keep] * n
    return float(((counts[keep] - expected) ** 2 / expected).sum())


def _speculate(gen: torch.Generator, k: int) -> list[int]:
    """One verify step at position 0 of k drafts drawn from Q, as the engine runs it (the
    target's own draw from P after the last draft as the bonus)."""
    drafts = [int(torch.multinomial(Q[i], 1, generator=gen)) for i in range(k)]
    bonus = int(torch.multinomial(P[k], 1, generator=gen))
    u = torch.rand(2 * k, dtype=torch.float64, generator=gen).tolist()
    tokens, accepted = rejection_sample(P[: k + 1], Q[:k], drafts, bonus, u)
    assert tokens[:accepted] == drafts[:accepted] and len(tokens) == accepted + 1
    return tokens


def test_rejection_sampling_follows_the_target_distribution() -> None:
    gen = torch.Generator().manual_seed(1234)
    trials = 12_000
    first = torch.zeros(VOCAB, dtype=torch.float64)
    second = torch.zeros(VOCAB, dtype=torch.float64)
    kept = 0
    for _ in range(trials):
        tokens = _speculate(gen, 2)
        first[tokens[0]] += 1
        if len(tokens) > 1:  # position 1's token, whenever a step reached it: as likely as the target's
            second[tokens[1]] += 1
        kept += len(tokens) - 1
    assert _chi2(first, P[0]) < CHI2_CRIT_4
    assert _chi2(second, P[1]) < CHI2_CRIT_4
    # the draft is not the target: some drafts were rejected, most were kept
    assert 0.2 * trials < kept < 2 * trials
    # and the test can fail: the drafts themselves (what keeping every draft would yield) are far off
    drafted = torch.zeros(VOCAB, dtype=torch.float64)
    for _ in range(2000):
        drafted[int(torch.multinomial(Q[0], 1, generator=gen))] += 1
    assert float(((drafted - P[0] * 2000) ** 2 / (P[0] * 2000).clamp(min=1e-9)).sum()) > 10 * CHI2_CRIT_4


def test_a_draft_equal_to_the_target_is_always_kept() -> None:
    u = [0.999999] * 6
    tokens, accepted = rejection_sample(P, P[:2], [3, 2], 1, u)
    assert (tokens, accepted) == ([3, 2, 1], 2)
    # a draft the target gives no mass is always replaced, by a token the target does give mass
    tokens, accepted = rejection_sample(P[:2], Q[:1], [4], 0, [0.0, 0.999999])
    assert accepted == 0 and tokens[0] != 4 and P[0, tokens[0]] > 0


# ---- configuration ----


def test_draft_model_config_names_and_errors() -> None:
    config = speculative_config({"model": "some/draft", "num_speculative_tokens": 3})
    assert config == SpeculativeConfig(method="draft_model", model="some/draft", num_speculative_tokens=3)
    assert speculative_config({"num_speculative_tokens": 3}).method == "ngram"
    for bad, words in (({"method": "draft_model"}, "needs \"model\""),
                       ({"method": "ngram", "model": "x"}, "\"model\" is for")):
        with pytest.raises(LocalLLMError, match=words):
            speculative_config(bad)


def test_draft_model_flag() -> None:
    from localllm.cli_common import DRAFT_TOKENS, speculative_from_args

    def args(**kw: object) -> argparse.Namespace:
        return argparse.Namespace(**{"speculative_config": None, "speculative_ngram": None, "draft_model": None, **kw})

    assert speculative_from_args(args(draft_model="d.gguf")) == SpeculativeConfig(
        method="draft_model", model="d.gguf", num_speculative_tokens=DRAFT_TOKENS)
    merged = speculative_from_args(args(draft_model="d.gguf", speculative_config='{"num_speculative_tokens": 2}'))
    assert (merged.method, merged.model, merged.num_speculative_tokens) == ("draft_model", "d.gguf", 2)
    with pytest.raises(LocalLLMError, match="exclude each other"):
        speculative_from_args(args(draft_model="d.gguf", speculative_ngram=3))
    with pytest.raises(LocalLLMError, match="exclude each other"):
        speculative_from_args(args(draft_model="d.gguf", speculative_config='{"method": "ngram"}'))


# ---- the real default model drafting for itself ----


@pytest.fixture(scope="module")
def draft_engine(default_model_path: Path):
    from localllm.engine.engine import EngineConfig, LLMEngine

    path = str(default_model_path)
    engine = LLMEngine(EngineConfig(
        model=path, dtype="float32", device="cpu", num_kv_blocks=8, max_num_batched_tokens=64,
        decode_buckets=[1, 2, 4, 8, 16, 32],
        speculative_config={"method": "draft_model", "model": path, "num_speculative_tokens": 4,
                            "disable_by_batch_size": 8},
    ))
    # a draft as costly as its target never pays: measured as free here, so that it is run
    # (what is tested is the output, not the policy)
    assert engine.drafter is not None
    # the draft's memory came out of the target's plan (its weights and a mirror of each KV token)
    assert engine.plan.beside_bytes > 0
    assert any(r.startswith("draft model ") for r in engine.plan.reasons)
    engine.drafter.step_cost = lambda rows: 1e-9  # type: ignore[method-assign]
    return engine


def _run(engine, prompts, params, speculate: bool):
    scheduler = engine.scheduler
    config, scheduler.speculative = scheduler.speculative, (scheduler.speculative if speculate else None)
    try:
        return engine.generate(prompts, [dataclasses.replace(p) for p in params])
    finally:
        scheduler.speculative = config


def _freed(engine) -> None:
    for bm in (engine.block_manager, engine.drafter.block_manager):
        assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
    assert not engine.drafter.mirrors


def test_greedy_output_with_a_draft_model_is_the_same(draft_engine) -> None:
    engine = draft_engine
    poem = engine.encode_prompt([{"role": "user", "content": "Write a short poem about autumn."}])[1]
    colors = engine.encode_prompt([{"role": "user", "content": "Name three colors and say why you like them."}])[1]
    g = SamplingParams(temperature=0.0, max_tokens=28)
    prompts = [poem, colors, poem, colors]
    params = [g, dataclasses.replace(g, ignore_eos=True), dataclasses.replace(g, stop=["leaves"]),
              dataclasses.replace(g, max_tokens=2)]
    before = engine.stats()
    preempted = engine.scheduler.num_preemptions
    spec = _run(engine, prompts, params, speculate=True)
    after = engine.stats()
    assert after.spec_method == "draft_model"
    assert after.spec_num_accepted_tokens - before.spec_num_accepted_tokens >= 15, "it was meant to speculate"
    assert engine.scheduler.num_preemptions > preempted, "the pool was meant to force preemption"
    plain = _run(engine, prompts, params, speculate=False)
    for x, y in zip(spec, plain):
        ox, oy = x.outputs[0], y.outputs[0]
        assert list(ox.token_ids) == list(oy.token_ids), x.request_id
        assert (ox.text, ox.finish_reason, ox.stop_reason) == (oy.text, oy.finish_reason, oy.stop_reason)
    assert spec[2].outputs[0].stop_reason == "leaves" and len(spec[3].outputs[0].token_ids) == 2
    _freed(engine)

    # a prompt that continues a speculated reply: prefix hits in the target's pool, a fresh
    # prefill in the draft's; the same tokens as computed without speculation
    follow = [*poem, *spec[0].outputs[0].token_ids]
    short = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    hit = _run(engine, [follow], [short], speculate=True)
    assert hit[0].num_cached_tokens >= len(poem)
    assert list(hit[0].outputs[0].token_ids) == list(_run(engine, [follow], [short], speculate=False)[0]
                                                      .outputs[0].token_ids)
    _freed(engine)


def test_sampled_requests_go_through_the_rejection_sampler(draft_engine) -> None:
    engine = draft_engine
    prompt = engine.encode_prompt([{"role": "user", "content": "Tell me about the sea."}])[1]
    params = [SamplingParams(temperature=0.9, top_k=40, seed=5, max_tokens=16, logprobs=1),
              SamplingParams(temperature=0.0, max_tokens=8)]
    before = engine.stats()
    a = _run(engine, [prompt, prompt], params, speculate=True)
    after = engine.stats()
    assert after.spec_num_draft_tokens > before.spec_num_draft_tokens
    b = _run(engine, [prompt, prompt], params, speculate=True)
    out = a[0].outputs[0]
    # a seeded request draws its drafts and its acceptance from its own generator: reproducible
    assert list(out.token_ids) == list(b[0].outputs[0].token_ids)
    assert len(out.token_ids) == 16 and out.logprobs is not None and len(out.logprobs) == 16
    # each token's reported logprob is the target's for that token (rejection replaced some draws)
    assert all(t in lp for t, lp in zip(out.token_ids, out.logprobs))
    assert out.cumulative_logprob == pytest.approx(sum(lp[t] for t, lp in zip(out.token_ids, out.logprobs)),
                                                   abs=1e-3)
    _freed(engine)


def test_a_draft_of_another_tokenizer_is_refused(draft_engine) -> None:
    gemma = Path.home() / ".cache" / "localllm-fixtures" / "gemma-3-270m-q4_k_m.gguf"
    if not gemma.is_file():
        pytest.skip("no gemma-3-270m fixture in ~/.cache/localllm-fixtures")
    from localllm.engine.draft_model import DraftModel

    engine = draft_engine
    with pytest.raises(LocalLLMError) as e:
        DraftModel(str(gemma), engine.tokenizer, engine.runner.model.config.vocab_size, num_blocks=8, block_size=16,
                   max_model_len=256, dtype="float32", device="cpu", max_num_seqs=4, compile=False)
    msg = str(e.value)
    assert "\n" not in msg and "tokenizer" in msg and "vocabulary" in msg
