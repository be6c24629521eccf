"""Picks the next token of every sequence in the batch.

Order: grammar mask -> penalties -> temperature -> top-k -> top-p -> min-p -> draw. Each cut
is a probability floor, and a row is drawn by inverse CDF from one uniform number (float64
sums: no token is too unlikely to be reached). A seeded request draws its number from its own
generator, so its tokens do not depend on what else is in the batch.

On a CPU the rows go to C++ kernels (``localllm_cpu.sample_rows`` and ``argmax_rows``): torch's
ops over a 49k-token row are slow exactly where sampling needs them (measured on a 2-core
Xeon: a full sort 8.7 ms, ``exponential_`` 2 ms, a division over probabilities that include
subnormals 1.2 ms, ``argmax`` 150 us; the old Gumbel sampler took 10-17 ms a token, more than
a batch-1 decode step of the default model), while the kernel needs 20-90 us. Elsewhere, and
as the reference, the same cuts run in torch ops on a sorted prefix of the likeliest tokens.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from localllm.engine.guided import mask_logits
from localllm.engine.sequence import PenaltyState, SamplingParams, Sequence, TokenColumn
from localllm.kernels import cpu_ops

if TYPE_CHECKING:
    from localllm.engine.guided import GrammarMatcher


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float] | None  # the sampled tokens' logprobs, when any request asked
    top_logprobs: list[dict[int, float]] | None


# sorted tokens looked at first for top-k and top-p; grown 8x until the cut lies inside
PREFIX = 64


def _kernels(logits: torch.Tensor) -> bool:
    """Whether the C++ sampling kernels take these logits (CPU fp32, library built)."""
    return logits.device.type == "cpu" and logits.dtype == torch.float32 and cpu_ops.load()


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """The first index of each row's largest value (torch's ``argmax``, NaN aside; torch's
    own takes 150 us for a 49k row on CPU, the kernel a few)."""
    if _kernels(logits):
        return torch.ops.localllm_cpu.argmax_rows(logits)
    return logits.argmax(dim=-1)


def _uniforms(seqs: list[Sequence]) -> list[float]:
    """One draw in (0, 1] per row; a seeded request's from its own generator."""
    u = torch.rand(len(seqs), dtype=torch.float64)
    for r, s in enumerate(seqs):
        if s.generator is not None:
            u[r] = torch.rand(1, dtype=torch.float64, generator=s.generator)
    return (1.0 - u).tolist()


def skip_uniforms(generator: torch.Generator, n: int) -> None:
    """Advances a seeded request's generator past ``n`` rows' draws, drawn as ``_uniforms``
    draws them: a speculative step that drew a number for each of its rows rewinds, then
    keeps only those of the tokens it yielded, so the request's later tokens are the ones it
    gets without speculation."""
    for _ in range(n):
        torch.rand(1, dtype=torch.float64, generator=generator)


def verify_drafts(targets: Seq[int], drafts: Seq[int]) -> int:
    """How many of ``drafts`` (proposed tokens, ``len(targets) - 1`` of them) a speculative
    step keeps, given ``targets[i]``, the token drawn (by ``sample``, with all its cuts) from
    the target's distribution p_i at the position of ``drafts[i]``: the leading drafts equal
    to their target draws. The step then yields ``targets[:accepted + 1]``.

    Why this is Leviathan et al.'s rejection sampling for an n-gram proposal: the proposal is
    a point mass q = 1 at the draft d. Their rule accepts d with chance min(1, p(d) / q(d)) =
    p(d), and on rejection draws from norm(max(0, p - q)), which is p without d, renormalized.
    Drawing x ~ p and accepting iff x = d does both at once: P(accept) = p(d), and given x != d,
    x is distributed as p restricted to the other tokens. So every token yielded is distributed
    as the target's own, and the next position's distribution is only used when the draft
    before it was kept, i.e. when it is the true context. Greedy (the argmax) is the same rule.
    Using the same uniform numbers as a plain decode makes a seeded request's tokens the same
    as without speculation (``skip_uniforms``)."""
    accepted = 0
    for t, d in zip(targets, drafts):
        if t != d:
            break
        accepted += 1
    return accepted


def sample_rows(
    logits: torch.Tensor, temps: list[float], top_ks: list[int], top_ps: list[float], min_ps: list[float],
    u: list[float],
) -> torch.Tensor:
    """Row r's token: the argmax where ``temps[r]`` is 0, else a draw at ``u[r]`` (in (0, 1])
    from p = softmax(logits[r] / temps[r]) after three cuts, each a probability floor: top-k
    keeps the tokens at least as likely as the ``top_ks[r]``-th likeliest (the vocabulary
    size: no cut); top-p then keeps, of those, the tokens at least as likely as the first one
    (likeliest first) whose running mass reaches ``top_ps[r]`` of theirs; min-p keeps the
    tokens at least ``min_ps[r]`` times as likely as the likeliest. (Ties at a floor stay, so a
    cut may keep a few more tokens than its count.)

    The draw is the first token, in vocabulary order, whose running mass reaches ``u[r]`` of
    the kept mass. Invariant: that token survived every cut and has nonzero probability (a
    token of no mass adds a flat step, so it is never the first to reach the target). The C++
    kernel and the torch reference draw the same token for the same u, but for rounding at a
    token's edge."""
    if _kernels(logits):
        return torch.ops.localllm_cpu.sample_rows(logits, temps, top_ks, top_ps, min_ps, u)
    return sample_rows_ref(logits, temps, top_ks, top_ps, min_ps, u)


def sample_rows_ref(
    logits: torch.Tensor, temps: list[float], top_ks: list[int], top_ps: list[float], min_ps: list[float],
    u: list[float],
) -> torch.Tensor:
    """``sample_rows`` in torch ops: any device, any float dtype. The cuts' floors come from a
    sorted prefix of the likeliest tokens, grown until it holds them (a full sort of a 49k row
    takes 8.7 ms on a CPU)."""
    w = cut_weights(logits, temps, top_ks, top_ps, min_ps)
    f64, dev, vocab = torch.float64, logits.device, logits.shape[1]
    cdf = w.cumsum(-1)
    target = torch.tensor(u, dtype=f64, device=dev)[:, None] * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, target).squeeze(1).clamp_(max=vocab - 1)
    greedy = [r for r in range(len(temps)) if temps[r] <= 0]
    if greedy:
        tokens[greedy] = argmax_rows(logits[greedy])
    return tokens


def cut_weights(
    logits: torch.Tensor, temps: list[float], top_ks: list[int], top_ps: list[float], min_ps: list[float],
) -> torch.Tensor:
    """What ``sample_rows`` draws row r from (but for a greedy row): the probabilities of
    softmax(logits[r] / temps[r]) that survive its cuts, float64, the others 0, not
    renormalized."""
    rows, vocab = logits.shape
    dev = logits.device
    f64 = torch.float64
    scale = torch.tensor([1.0 / t if t > 0 else 1.0 for t in temps], dtype=logits.dtype, device=dev)
    probs = torch.softmax(logits * scale[:, None], dim=-1)
    floor = torch.tensor(min_ps, dtype=f64, device=dev)[:, None] * probs.amax(-1, keepdim=True).double()
    cut = [r for r in range(rows) if top_ks[r] < vocab or top_ps[r] < 1.0]
    if cut:
        ks = torch.tensor([top_ks[r] for r in cut], device=dev)
        ps = torch.tensor([top_ps[r] for r in cut], dtype=f64, device=dev)
        n = min(vocab, max(PREFIX, max((top_ks[r] for r in cut if top_ks[r] < vocab), default=0)))
        while True:
            vals = probs[cut].topk(n, dim=-1).values.double()  # sorted, likeliest first
            cut_floor, short = _prefix_floors(vals, ks, ps, vocab)
            if n == vocab or not short:
                break
            n = min(vocab, n * 8)
        floor[cut] = torch.maximum(floor[cut], cut_floor[:, None])
    w = probs.double()
    return torch.where(w >= floor, w, 0.0)


def _prefix_floors(vals: torch.Tensor, ks: torch.Tensor, ps: torch.Tensor, vocab: int) -> tuple[torch.Tensor, bool]:
    """For each row's likeliest ``n`` probabilities (float64, descending): the floor of its
    top-k and top-p cuts (``sample_rows``), and whether some row's floor may lie past them."""
    n = vals.shape[1]
    rows = torch.arange(vals.shape[0], device=vals.device)
    k_floor = torch.where(ks <= n, vals[rows, (ks.clamp(max=n) - 1)], 0.0)
    k_floor = torch.where(ks < vocab, k_floor, 0.0)
    within_k = vals >= k_floor[:, None]
    v = vals * within_k
    # top-p is a share of what top-k keeps: all of it is known only when the k fit the prefix
    mass = torch.where((ks < vocab) & (ks <= n), v.sum(-1), 1.0)
    keep = within_k & ((v.cumsum(-1) - v) < ps[:, None] * mass[:, None])
    count = keep.sum(-1)
    p_floor = torch.where(ps < 1.0, vals[rows, (count - 1).clamp(min=0)], 0.0)
    short = (ks > n) & ((ks < vocab) | (count == n))
    return torch.maximum(k_floor, p_floor), bool(short.any())


def _penalty_state(seq: Sequence, device: torch.device) -> PenaltyState:
    state = seq.penalties
    if state is None:
        seen, seen_set = None, set()
        if seq.params.repetition_penalty != 1.0:  # the prompt is read once per request
            seen_set = set(seq.token_ids[: seq.num_prompt_tokens])
            seen = TokenColumn(sorted(seen_set), torch.long, device)
        state = seq.penalties = PenaltyState(seen, seen_set, TokenColumn([], torch.long, device),
                                             TokenColumn([], torch.float32, device), {})
    start = seq.num_prompt_tokens + state.absorbed
    for token in seq.token_ids[start:]:  # usually the one token of the last step
        at = state.out_index.get(token)
        if at is None:
            state.out_index[token] = state.out_ids.size
            state.out_ids.append(token)
            state.out_counts.append(1.0)
        else:
            state.out_counts.data[at] += 1
        if state.seen is not None and token not in state.seen_set:
            state.seen_set.add(token)
            state.seen.append(token)
    state.absorbed = seq.num_output_tokens
    return state


def _penalize(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """vLLM's penalties on the rows whose requests ask for one: a repetition penalty divides a
    positive logit of a token seen in the prompt or the output (multiplies a negative one);
    then frequency and presence penalties subtract per occurrence and once per token in the
    output. Returns a new tensor: ``logits`` is left as it is."""
    out = logits.clone()
    for r, seq in enumerate(seqs):
        p = seq.params
        if not p.has_penalties:
            continue
        state = _penalty_state(seq, logits.device)
        row = out[r]
        if state.seen is not None:
            idx = state.seen.view()
            v = row.index_select(0, idx)
            row.index_copy_(0, idx, torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty))
        if (p.frequency_penalty or p.presence_penalty) and state.out_ids.size:
            row.index_add_(0, state.out_ids.view(),
                           state.out_counts.view() * -p.frequency_penalty - p.presence_penalty)
    return out


def _cuts(params: list[SamplingParams], vocab: int) -> tuple[list[float], list[int], list[float], list[float]]:
    """``sample_rows``' temperatures (0: greedy), top-k (the vocabulary size: off), top-p and
    min-p, a row per request."""
    return ([0.0 if p.greedy else p.temperature for p in params],
            [p.top_k if 0 < p.top_k < vocab else vocab for p in params],  # top_k <= 0 (off) keeps every token
            [p.top_p for p in params], [p.min_p for p in params])


def target_probs(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """The distribution ``sample`` draws each row of ``logits`` from (rows of sampled
    requests without grammar or penalties: speculation's), float64, rows summing to 1: the p
    of ``spec_decode.rejection_sample``."""
    w = cut_weights(logits, *_cuts([s.params for s in seqs], logits.shape[-1]))
    return w / w.sum(-1, keepdim=True)


def sample(
    logits: torch.Tensor, seqs: list[Sequence], grammars: Seq[GrammarMatcher | None] = ()
) -> SamplerOutput:
    """logits: [len(seqs), vocab] fp32, row i for seqs[i]; ``grammars[i]``, when given, is row
    i's grammar (None: free text). ``logits`` is not modified. A sequence may own several
    consecutive rows (a speculative step's positions; never one with penalties or a grammar):
    each draws its own number, a seeded one from its generator in row order."""
    params = [s.params for s in seqs]
    want_logprobs = any(p.logprobs is not None for p in params)
    raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None  # the model's, as vLLM reports
    logits = mask_logits(logits, grammars)  # structured output: only what each grammar allows next
    if any(p.has_penalties for p in params):
        logits = _penalize(logits, seqs)
    if all(p.greedy for p in params):
        token_ids = argmax_rows(logits)
    else:
        token_ids = sample_rows(logits, *_cuts(params, logits.shape[-1]), _uniforms(seqs))

    ids = token_ids.tolist()
    if raw_logprobs is None:
        return SamplerOutput(ids, None, None)
    chosen = raw_logprobs.gather(1, token_ids[:, None]).squeeze(1).tolist()
    n_top = min(max(p.logprobs or 0 for p in params), raw_logprobs.shape[-1])
    tops: list[dict[int, float]] = []
    if n_top:
        values, indices = raw_logprobs.topk(n_top, dim=-1)
        for r, p in enumerate(params):
            k = p.logprobs or 0
            tops.append(dict(zip(indices[r, :k].tolist(), values[r, :k].tolist())))
    else:
        tops = [{} for _ in params]
    return SamplerOutput(ids, chosen, tops)
