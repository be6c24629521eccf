"""The sampler on synthetic logits (no model): top-k, top-p, min-p, penalties, seeds, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from localllm.engine.sampler import sample
from localllm.engine.sequence import SamplingParams, Sequence

VOCAB = 10


def _seq(params: SamplingParams, prompt: tuple[int, ...] = (0,), outputs: tuple[int, ...] = ()) -> Sequence:
    return Sequence("r", [*prompt, *outputs], params, (), 1000, num_prompt_tokens=len(prompt))


def _draws(logits: list[float], n: int = 300, **kw: object) -> set[int]:
    """The tokens seen over ``n`` seeded draws of one row."""
    row = torch.tensor([logits])
    return {sample(row, [_seq(SamplingParams(seed=s, **kw))]).token_ids[0] for s in range(n)}  # type: ignore[arg-type]


PROBS = [0.5, 0.3, 0.15, 0.05]
LOGITS = [math.log(p) for p in PROBS]


def test_top_k_keeps_only_the_k_largest() -> None:
    assert _draws(LOGITS, top_k=2) == {0, 1}
    assert _draws(LOGITS, top_k=1) == {0}


@pytest.mark.parametrize("k", [VOCAB, VOCAB + 1, 100_000, -1, 0])
def test_top_k_at_or_beyond_the_vocabulary_is_no_top_k(k: int) -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1))
    for seed in range(20):
        off = sample(logits, [_seq(SamplingParams(seed=seed + r)) for r in range(3)]).token_ids
        big = sample(logits, [_seq(SamplingParams(seed=seed + r, top_k=k)) for r in range(3)]).token_ids
        assert big == off


def test_top_k_mixed_with_rows_beyond_the_vocabulary() -> None:
    logits = torch.tensor([LOGITS, LOGITS])
    for seed in range(50):
        ids = sample(logits, [_seq(SamplingParams(seed=seed, top_k=1)),
                              _seq(SamplingParams(seed=seed, top_k=10**9))]).token_ids
        assert ids[0] == 0


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    assert _draws(LOGITS, top_p=0.7) == {0, 1}
    assert _draws(LOGITS, top_p=0.45) == {0}  # the top token alone reaches it
    assert _draws(LOGITS, top_p=0.81) == {0, 1, 2}


def test_min_p_drops_tokens_below_a_fraction_of_the_top() -> None:
    assert _draws(LOGITS, min_p=0.5) == {0, 1}  # 0.3 >= 0.25 > 0.15
    assert _draws(LOGITS, min_p=0.2) == {0, 1, 2}
    assert _draws(LOGITS) == {0, 1, 2, 3}


def test_greedy_is_argmax_whatever_else_is_in_the_batch() -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(2))
    seqs = [_seq(SamplingParams(temperature=0)), _seq(SamplingParams(temperature=1.5)),
            _seq(SamplingParams(temperature=0, top_p=0.3)), _seq(SamplingParams(top_k=1))]
    ids = sample(logits, seqs).token_ids
    argmax = logits.argmax(-1).tolist()
    assert [ids[0], ids[2], ids[3]] == [argmax[0], argmax[2], argmax[3]]


def test_repetition_penalty_covers_prompt_and_output_tokens() -> None:
    # token 3 leads, 4 is close behind; 3 was generated before, so a penalty of 2 halves it
    logits = torch.tensor([[0.0, 0.0, 0.0, 2.0, 1.9, 0.0, 0.0, 0.0, 0.0, 0.0]])
    assert sample(logits, [_seq(SamplingParams(temperature=0), outputs=(3,))]).token_ids == [3]
    assert sample(logits, [_seq(SamplingParams(temperature=0, repetition_penalty=2.0), outputs=(3,))]).token_ids == [4]
    # a prompt token counts as seen too, as in vLLM
    assert sample(logits, [_seq(SamplingParams(temperature=0, repetition_penalty=2.0), prompt=(3,))]).token_ids == [4]
    # negative logits are multiplied, so a penalty always makes a seen token less likely
    neg = torch.tensor([[-1.0, -1.5] + [-9.0] * 8])
    assert sample(neg, [_seq(SamplingParams(temperature=0, repetition_penalty=2.0), prompt=(0,))]).token_ids == [1]


def test_presence_and_frequency_penalties() -> None:
    logits = torch.tensor([[0.0, 0.0, 0.0, 2.0, 1.5, 1.2, 0.0, 0.0, 0.0, 0.0]])
    seen = (3, 3, 4)  # token 3 twice, token 4 once
    greedy = dict(temperature=0)
    assert sample(logits, [_seq(SamplingParams(**greedy), outputs=seen)]).token_ids == [3]
    # presence: -0.6 once per seen token -> 3: 1.4, 4: 0.9, 5: 1.2
    assert sample(logits, [_seq(SamplingParams(presence_penalty=0.6, **greedy), outputs=seen)]).token_ids == [3]
    # frequency: -0.45 per occurrence -> 3: 1.1, 4: 1.05, 5: 1.2
    assert sample(logits, [_seq(SamplingParams(frequency_penalty=0.45, **greedy), outputs=seen)]).token_ids == [5]
    # prompt tokens do not count for presence or frequency
    assert sample(logits, [_seq(SamplingParams(presence_penalty=2.0, **greedy), prompt=(3,))]).token_ids == [3]


def _penalized_by_definition(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """One row's penalties from the whole token list, as vLLM defines them."""
    p, row = seq.params, logits.clone()
    outputs = seq.token_ids[seq.num_prompt_tokens :]
    for t in set(seq.token_ids) if p.repetition_penalty != 1.0 else ():
        row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
    for t in set(outputs):
        row[t] -= p.frequency_penalty * outputs.count(t) + p.presence_penalty
    return row


def test_penalties_kept_step_by_step_equal_their_definition_on_a_mixed_batch() -> None:
    """The sampler keeps each sequence's token counts across steps instead of recounting the
    prompt and reply; over 12 steps of a batch that mixes penalised and plain rows (and a
    retry that samples a row a second time in one step), each row's penalised logits equal
    the definition's on the whole token list, and the tokens drawn are their argmax."""
    from localllm.engine.sampler import _penalize

    gen = torch.Generator().manual_seed(5)
    vocab = 64
    seqs = [
        _seq(SamplingParams(temperature=0, repetition_penalty=1.7), prompt=tuple(range(0, 40, 3))),
        _seq(SamplingParams(temperature=0)),
        _seq(SamplingParams(temperature=0, presence_penalty=0.8, frequency_penalty=0.3), prompt=(5, 6)),
        _seq(SamplingParams(temperature=0, repetition_penalty=0.8, frequency_penalty=-0.4), prompt=(1, 1, 2)),
    ]
    for step in range(12):
        logits = torch.randn(len(seqs), vocab, generator=gen) * 3
        want = torch.stack([_penalized_by_definition(logits[r], s) for r, s in enumerate(seqs)])
        got = _penalize(logits, seqs)
        assert torch.allclose(got, want, atol=1e-5), step
        assert torch.equal(_penalize(logits, seqs), got)  # a second pass in the same step adds nothing
        ids = sample(logits, seqs).token_ids
        assert ids == want.argmax(-1).tolist()
        for s, t in zip(seqs, ids):
            s.token_ids.append(t if step % 3 else 7)  # token 7 again and again: frequency counts grow
    assert seqs[1].penalties is None  # a row without penalties keeps no state


def test_a_seed_fixes_the_tokens_and_ignores_the_batch() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(3))

    def run(seed: int, batch: bool) -> list[int]:
        target = _seq(SamplingParams(seed=seed, temperature=1.0))
        seqs = [_seq(SamplingParams(temperature=0.9)), target, _seq(SamplingParams(seed=7))] if batch else [target]
        rows = logits if batch else logits[1:2]
        out = []
        for _ in range(16):  # the generator advances with each draw
            out.append(sample(rows, seqs).token_ids[1 if batch else 0])
        return out

    assert run(5, batch=False) == run(5, batch=True)
    assert run(5, batch=False) != run(6, batch=False)


def test_logprobs_are_of_the_raw_distribution() -> None:
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(4))
    raw = torch.log_softmax(logits, -1)
    out = sample(logits, [_seq(SamplingParams(temperature=0, logprobs=3)), _seq(SamplingParams(temperature=0))])
    assert out.logprobs is not None and out.top_logprobs is not None
    for r in range(2):
        assert out.logprobs[r] == pytest.approx(raw[r, out.token_ids[r]].item())
    top = out.top_logprobs[0]
    assert list(top) == raw[0].topk(3).indices.tolist()
    assert list(top.values()) == pytest.approx(raw[0].topk(3).values.tolist())
    assert out.top_logprobs[1] == {}  # this row asked for none


def test_more_logprobs_than_the_vocabulary_holds() -> None:
    logits = torch.randn(1, 4)
    out = sample(logits, [_seq(SamplingParams(temperature=0, logprobs=20))])
    assert out.top_logprobs is not None and len(out.top_logprobs[0]) == 4


# ---- the row draw (sample_rows) against its definition, in both implementations ----

def _impls() -> list:
    from localllm.engine.sampler import sample_rows, sample_rows_ref
    from localllm.kernels import cpu_ops

    impls = [pytest.param(sample_rows_ref, id="torch")]
    if cpu_ops.load():
        impls.append(pytest.param(sample_rows, id="kernel"))
    return impls


def _kept_probs(row: torch.Tensor, temp: float, k: int, p: float, min_p: float) -> torch.Tensor:
    """The definition, by a full sort: the probabilities the cuts keep (the rest zeroed)."""
    probs = torch.softmax(row.double() / temp, -1)
    ranked = probs.sort(descending=True).values
    keep = torch.ones_like(probs, dtype=torch.bool)
    if k < len(probs):
        keep &= probs >= ranked[k - 1]
    if p < 1.0:
        within = probs[keep].sort(descending=True).values
        first = int((within.cumsum(0) >= p * within.sum()).nonzero()[0])
        keep &= probs >= within[first]
    keep &= probs >= min_p * ranked[0]
    return torch.where(keep, probs, 0.0)


CUTS = [  # temperature, top_k (0: none), top_p, min_p
    (1.0, 0, 1.0, 0.0), (0.7, 0, 0.9, 0.0), (0.8, 40, 1.0, 0.0), (1.0, 40, 0.95, 0.05), (1.3, 0, 1.0, 0.1),
    (0.5, 300, 0.5, 0.0), (2.0, 0, 0.99, 0.0), (1.0, 1000, 1.0, 0.0), (1.0, 3, 0.2, 0.0),
]


@pytest.mark.parametrize("impl", _impls())
@pytest.mark.parametrize("spread", [0.5, 2.0, 6.0])
@pytest.mark.parametrize("cut", CUTS, ids=str)
def test_draws_follow_the_cut_distribution_exactly(impl, spread: float, cut: tuple) -> None:
    # u on an even grid of n points: an inverse-CDF draw gives token i about p_i * n of them,
    # so any token outside the cuts, or any wrong share, shows
    temp, k, p, min_p = cut
    vocab = n = 2000
    row = torch.randn(1, vocab, generator=torch.Generator().manual_seed(int(spread * 10) + k)) * spread
    k = k or vocab
    grid = [(i + 0.5) / n for i in range(n)]
    b = 500
    tokens = torch.cat([impl(row.expand(b, -1), [temp] * b, [k] * b, [p] * b, [min_p] * b, grid[i : i + b])
                        for i in range(0, n, b)])
    want = _kept_probs(row[0], temp, k, p, min_p)
    want = want / want.sum() * n
    counts = torch.bincount(tokens, minlength=vocab).double()
    assert set(tokens.tolist()) <= set(want.nonzero().flatten().tolist())
    assert float((counts - want).abs().max()) <= 1.01


@pytest.mark.parametrize("impl", _impls())
def test_masked_tokens_are_never_drawn(impl) -> None:
    row = torch.full((1, 3000), float("-inf"))
    allowed = [5, 77, 2999]
    row[0, allowed] = torch.tensor([0.0, -30.0, 1.0])
    for u in (1e-12, 0.3, 0.999999, 1.0):
        for cut in CUTS:
            temp, k, p, min_p = cut
            assert int(impl(row, [temp], [k or 3000], [p], [min_p], [u])[0]) in allowed


@pytest.mark.parametrize("impl", _impls())
def test_greedy_rows_are_the_first_argmax(impl) -> None:
    rows = torch.randn(5, 4000, generator=torch.Generator().manual_seed(9))
    rows[1, [10, 20]] = 50.0  # a tie: the first wins
    rows[2] = float("-inf")
    rows[2, 3999] = 0.0
    rows[3, 0] = 99.0
    out = impl(rows, [0.0, 0.0, 0.0, 0.0, 1.0], [4000] * 5, [1.0] * 5, [0.0] * 5, [0.5] * 5)
    assert out[:4].tolist() == [int(rows[0].argmax()), 10, 3999, 0]


def test_the_kernel_and_the_reference_draw_the_same_tokens() -> None:
    from localllm.engine.sampler import sample_rows, sample_rows_ref
    from localllm.kernels import cpu_ops

    if not cpu_ops.load():
        pytest.skip("CPU kernels could not be built here")
    gen = torch.Generator().manual_seed(11)
    rows = torch.randn(len(CUTS), 49152, generator=gen) * torch.tensor([0.5, 2.0, 4.0] * 3)[:, None]
    args = [list(c) for c in zip(*CUTS)]
    args[1] = [k or 49152 for k in args[1]]
    same = total = 0
    for _ in range(30):
        u = (1.0 - torch.rand(len(CUTS), dtype=torch.float64, generator=gen)).tolist()
        a, b = sample_rows(rows, *args, u), sample_rows_ref(rows, *args, u)
        same += int((a == b).sum())
        total += len(CUTS)
    assert same >= 0.99 * total
