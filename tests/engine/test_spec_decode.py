"""Speculative decoding without a model: n-gram proposals, the verification rule against the
target distribution (a statistical test on a small vocabulary), seeded draws, the adaptive k,
rolled-back blocks and the config's checks."""

from __future__ import annotations

import pytest
import torch
from scipy import stats

from localllm.engine.block_manager import BlockManager
from localllm.engine.sampler import sample, skip_uniforms, verify_drafts
from localllm.engine.scheduler import Scheduler
from localllm.engine.sequence import SamplingParams, Sequence
from localllm.engine.spec_decode import (
    NgramIndex,
    SpecCosts,
    SpeculativeConfig,
    choose_k,
    expected_tokens,
    speculative_config,
)
from localllm.errors import LocalLLMError


def _seq(params: SamplingParams, tokens: list[int], prompt_len: int | None = None) -> Sequence:
    return Sequence("r", list(tokens), params, (), 1000, num_prompt_tokens=prompt_len or len(tokens))


# ---- proposals ----

def test_ngram_proposes_what_followed_the_latest_longest_match() -> None:
    index = NgramIndex(1, 3)
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 5, 6, 7]
    # the 3-gram (5, 6, 7) occurred at the start: what followed it comes first, though the
    # 2-gram (6, 7) occurred later (followed by 2)
    assert index.propose(tokens, 4) == [8, 9, 1, 6]
    tokens += [4]  # (6, 7, 4) and (7, 4) never occurred; (4,) neither
    assert index.propose(tokens, 4) == []
    tokens += [9]  # the 1-gram (9,): latest occurrence ends at 5, followed by 1, 6, 7
    assert index.propose(tokens, 3) == [1, 6, 7]
    assert index.indexed == len(tokens) - 1  # built as tokens arrive, never rescanned


def test_ngram_proposal_may_run_into_the_tokens_it_matches() -> None:
    index = NgramIndex(2, 2)
    tokens = [1, 2, 1, 2, 1, 2]  # a repetition: the match ends two tokens back
    assert index.propose(tokens, 5) == [1, 2]
    assert NgramIndex(2, 4).propose([3], 5) == []


# ---- verification follows the target distribution ----

def _cut_probs(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    p = torch.softmax(logits.double() / temperature, -1)
    keep = p >= p.topk(top_k).values[-1]
    p = torch.where(keep, p, 0.0)
    return p / p.sum()


def test_verification_yields_the_target_distribution_and_accepts_a_draft_with_its_probability() -> None:
    """Leviathan et al.'s rule for a point-mass proposal d: accept with chance p(d), else draw
    from p without d. ``verify_drafts`` over the sampler's own draws must give exactly that:
    the first token ~ p0 (with temperature and top-k cuts), acceptance rate p0(d0), and after
    an accepted draft the next token ~ p1."""
    torch.manual_seed(0)
    vocab, trials = 6, 20000
    l0 = torch.tensor([1.0, 0.2, -0.5, 0.7, -2.0, 0.0])
    l1 = torch.tensor([-1.0, 0.5, 0.3, 0.0, 1.2, -0.3])
    params = SamplingParams(temperature=0.8, top_k=4)
    p0, p1 = _cut_probs(l0, 0.8, 4), _cut_probs(l1, 0.8, 4)
    draft = 3  # not the likeliest token: acceptance well inside (0, 1)
    seq = _seq(params, [0])
    logits = torch.stack([l0, l1]).repeat(trials, 1)  # each trial: the two rows of one verify step
    tokens = sample(logits, [seq] * (2 * trials)).token_ids
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)
    accepted = 0
    for i in range(trials):
        targets = tokens[2 * i : 2 * i + 2]
        a = verify_drafts(targets, [draft])
        first[targets[0]] += 1
        if a:
            accepted += 1
            second[targets[1]] += 1
    kept = p0 > 0
    assert (first[~kept] == 0).all() and (second[p1 == 0] == 0).all()  # never a cut token
    assert stats.chisquare(first[kept], p0[kept] * trials).pvalue > 1e-3
    assert stats.chisquare(second[p1 > 0], p1[p1 > 0] * accepted).pvalue > 1e-3
    assert stats.binomtest(accepted, trials, float(p0[draft])).pvalue > 1e-3


def test_greedy_verification_keeps_the_drafts_up_to_the_first_other_argmax() -> None:
    assert verify_drafts([4, 5, 6, 7], [4, 5, 9]) == 2
    assert verify_drafts([4, 5, 6, 7], [4, 5, 6]) == 3
    assert verify_drafts([1, 5], [4]) == 0


def test_a_seeded_request_draws_the_same_tokens_with_and_without_speculation() -> None:
    """One verify step over two positions draws a number per row; rewinding and keeping only
    the yielded tokens' numbers leaves the generator where plain decoding leaves it."""
    rows = torch.randn(3, 8, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=1.0, seed=77)
    plain = _seq(params, [0])
    plain_tokens = [sample(rows[i : i + 1], [plain]).token_ids[0] for i in range(3)]
    spec = _seq(params, [0])
    saved = spec.generator.get_state()
    targets = sample(rows[:2], [spec, spec]).token_ids
    assert targets == plain_tokens[:2]  # the same numbers, row by row
    accepted = verify_drafts(targets, [targets[0]])  # a draft equal to the draw: kept
    spec.generator.set_state(saved)
    skip_uniforms(spec.generator, accepted + 1)
    assert sample(rows[2:3], [spec]).token_ids[0] == plain_tokens[2]


# ---- it pays or steps aside ----

def test_expected_tokens_per_verify_step() -> None:
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_the_measure_drifts_to_the_requests_record() -> None:
    """Between proposals the acceptance drifts back toward what the request has kept so far
    (the prior counting as a few trials): a reply that rejected most proposals is not tried
    again at the prior's 0.5, one that kept most is, and a fresh one drifts to the prior."""
    from localllm.engine.spec_decode import PRIOR_ACCEPTANCE, SpecState

    prose, code, fresh = SpecState(None), SpecState(None), SpecState(None, acceptance=0.0)
    for i in range(20):
        prose.observe(i % 6 == 0)  # 4 of 20 kept
        code.observe(i % 10 != 0)  # 18 of 20
    for s in (prose, code, fresh):
        for _ in range(200):
            s.drift()
    assert prose.acceptance == pytest.approx((4 + 4 * PRIOR_ACCEPTANCE) / 24, abs=1e-3)
    assert code.acceptance == pytest.approx((18 + 4 * PRIOR_ACCEPTANCE) / 24, abs=1e-3)
    assert fresh.acceptance == pytest.approx(PRIOR_ACCEPTANCE, abs=1e-3)
    costs = SpecCosts()
    for rows, t in ((1, 10.0), (2, 10.5), (4, 11.0), (6, 11.5), (9, 12.5)):
        costs.observe(rows, t)
    assert choose_k([prose.acceptance], [8], costs)[0] < choose_k([code.acceptance], [8], costs)[0]


def test_k_follows_acceptance_and_measured_cost() -> None:
    costs = SpecCosts()
    for rows, t in ((1, 10.0), (2, 10.5), (4, 11.0), (6, 11.5), (9, 12.5)):
        costs.observe(rows, t)
    assert choose_k([0.9], [8], costs)[0] >= 4  # copying: long drafts pay
    assert choose_k([0.05], [8], costs) == [0]  # prose: no proposal pays its rows
    assert 0 < choose_k([0.5], [8], costs)[0] < 5
    costly = SpecCosts()
    for rows, t in ((1, 10.0), (2, 20.0), (6, 60.0)):  # compute-bound: a row costs a step
        costly.observe(rows, t)
    assert choose_k([0.9], [5], costly) == [0]
    assert choose_k([0.9, 0.9], [4, 0], costs)[1] == 0  # no proposal, no drafts


def test_measured_costs_follow_the_load() -> None:
    costs = SpecCosts()
    costs.observe(1, 10.0)
    costs.observe(3, 12.0)
    assert costs.ratio(1, 2) == pytest.approx(1.2)
    assert costs.ratio(1, 1) == pytest.approx(1.1)  # between two measured sizes
    for _ in range(50):
        costs.observe(3, 30.0)
    assert costs.ratio(1, 2) > 2.5


def test_a_size_seen_once_in_a_compiling_step_does_not_price_itself_out() -> None:
    # an H200 run: the first 2-row step compiled the GGUF head's kernel (3.3 s against 1.7 ms
    # for one row); a step of more rows measured since bounds it, and the sizes between
    costs = SpecCosts()
    costs.observe(1, 1.7e-3)
    costs.observe(2, 3.25)
    assert costs.ratio(1, 1) == pytest.approx(2.0)  # at most two one-row steps
    costs.observe(6, 3.8e-3)
    assert costs.ratio(1, 1) == pytest.approx(2.0)
    assert costs.ratio(1, 3) == pytest.approx(3.8 / 1.7)
    assert choose_k([0.95], [5], costs)[0] == 5
    costs.observe(12, 1.13)  # the largest size seen, compiling: bounded by 2 x the 6-row step
    assert costs.ratio(6, 6) == pytest.approx(2.0)


def test_a_request_no_draft_can_pay_for_is_skipped_only_where_no_k_pays() -> None:
    # choose_k skips the k search when even free rows could not pay for one draft step; that
    # holds only if every k's gain is then at most 1, whatever the measured costs
    costs = SpecCosts()
    for rows, t in ((1, 10.0), (2, 10.1), (4, 10.3), (6, 10.6), (9, 11.0)):
        costs.observe(rows, t)
    skipped = 0
    for n in (1, 2, 3):
        for a in (0.0, 0.05, 0.1, 0.3, 0.5, 0.7, 0.9, 0.99):
            for dc in (0.02, 0.1, 0.3, 0.6, 1.0):
                if n - 1 + 1 / (1 - a) <= n * (1 + dc):
                    skipped += 1
                    assert all((n - 1 + expected_tokens(a, k)) / (n * (costs.ratio(n, k) + k * dc)) <= 1.0
                               for k in range(1, 9))
                    assert choose_k([a] * n, [8] * n, costs, dc) == [0] * n
    assert skipped > 20
    assert choose_k([0.9], [4], costs, 0.1)[0] > 0  # a draft worth running still runs


def test_verify_rows_set_the_graph_batch() -> None:
    config = SpeculativeConfig(num_speculative_tokens=5, disable_by_batch_size=4)
    assert config.max_verify_rows(16) == 24  # 4 sequences x (1 + 5) rows: more than 16 decodes
    assert config.max_verify_rows(2) == 12


def _decoding_alone(max_num_seqs: int) -> tuple[Scheduler, Sequence]:
    """A scheduler (proposals off above 4 sequences) with one request prefilled and past its
    first token, whose tokens repeat: its next step has a proposal to verify."""
    config = SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=4)
    scheduler = Scheduler(BlockManager(64, 4), 256, max_num_seqs, config)
    seq = _seq(SamplingParams(temperature=0.0, max_tokens=50), [1, 2, 3, 4, 5, 1, 2])
    scheduler.add(seq)
    scheduler.update(scheduler.schedule(), [(seq, 3)])
    return scheduler, seq


def test_no_proposal_in_the_step_a_burst_joins() -> None:
    scheduler, seq = _decoding_alone(max_num_seqs=16)
    alone = scheduler.schedule()
    drafts = seq.spec_token_ids
    assert alone.num_speculative == 1 and drafts and drafts == [4, 5, 1, 2][: len(drafts)]
    scheduler.update(alone, [])
    scheduler.append(seq, 4)
    scheduler.end_verify(seq, 0)
    for i in range(15):  # requests opened together while it decodes: a batch of 16 from this step on
        scheduler.add(Sequence(f"b{i}", [100 + i, 7, 8], SamplingParams(max_tokens=4), (), 1000))
    burst = scheduler.schedule()
    assert len(burst.seqs) == 16 and burst.num_speculative == 0 and burst.num_draft_tokens == 0
    assert burst.seqs[0] is seq and burst.num_new_tokens[0] == 1  # a plain decode

    # waiting requests with no slot do not make the batch large: it stays at max_num_seqs
    scheduler, seq = _decoding_alone(max_num_seqs=2)
    for i in range(15):
        scheduler.add(Sequence(f"b{i}", [100 + i, 7, 8], SamplingParams(max_tokens=4), (), 1000))
    step = scheduler.schedule()
    drafts = seq.spec_token_ids
    assert len(step.seqs) == 2 and step.num_speculative == 1 and drafts and drafts == [4, 5, 1, 2][: len(drafts)]


# ---- rolled-back blocks ----

def test_trim_gives_back_the_blocks_of_rejected_proposals_unhashed() -> None:
    bm = BlockManager(8, 4)
    seq = _seq(SamplingParams(), list(range(6)))
    assert bm.allocate(seq, 6 + 5)  # the last token and 5 proposals: 3 blocks
    seq.num_computed_tokens = 7  # one proposal kept: 7 tokens computed
    seq.token_ids += [100, 101]
    bm.cache_full_blocks(seq)
    assert len(seq.block_hashes) == 1  # only the full block of accepted tokens
    bm.trim(seq, seq.num_tokens)
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 6
    freed = next(iter(bm.free_queue))  # reused first: it holds nothing worth keeping
    assert bm.blocks[freed].ref_count == 0 and not bm.blocks[freed].token_ids
    bm.free(seq)
    assert bm.num_free_blocks == 8


# ---- configuration ----

def test_speculative_config_from_a_dict_or_json_and_its_errors() -> None:
    assert speculative_config(None) is None
    assert speculative_config({"method": "ngram", "num_speculative_tokens": 3}) == SpeculativeConfig(
        num_speculative_tokens=3)
    assert speculative_config('{"prompt_lookup_max": 5}').prompt_lookup_max == 5  # type: ignore[union-attr]
    for bad, words in (({"method": "eagle"}, "method"), ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
                       ({"num_speculative_tokens": 99}, "num_speculative_tokens"), ({"lookup": 3}, "unknown"),
                       ("{not json", "JSON"), ({"prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup_min"),
                       ([1], "JSON object")):
        with pytest.raises(LocalLLMError, match=words):
            speculative_config(bad)  # type: ignore[arg-type]


def test_cli_flags_make_the_engine_config() -> None:
    import argparse

    from localllm.cli_common import add_engine_args, add_model_arg, engine_config_from_args

    p = argparse.ArgumentParser()
    add_model_arg(p)
    add_engine_args(p)
    assert engine_config_from_args(p.parse_args([])).speculative_config is None
    config = engine_config_from_args(p.parse_args(["--speculative-ngram", "3"])).speculative_config
    assert config == SpeculativeConfig(num_speculative_tokens=3)
    given = '{"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_max": 3}'
    config = engine_config_from_args(p.parse_args(["--speculative-config", given])).speculative_config
    assert config == SpeculativeConfig(num_speculative_tokens=6, prompt_lookup_max=3)
    with pytest.raises(LocalLLMError, match="exclude each other"):
        engine_config_from_args(p.parse_args(["--speculative-config", given, "--speculative-ngram", "2"]))
