"""Speculative decoding: what is proposed, how much of it, and what is kept.

Two proposers: prompt lookup (n-gram, no second model: ``NgramIndex``) and a small draft model
of the same tokenizer (``engine/draft_model.py`` runs it; ``scheduler.DraftProposer`` is what
the scheduler sees of it). Either way the target verifies the proposals in one pass.

A decoding sequence whose last few tokens also occur earlier in its own tokens (prompt and
reply) proposes the tokens that followed that earlier occurrence; one forward pass then
computes the target model's logits at the sequence's next position and at each proposed one
(a ``1 + k``-token extend over its cached prefix), and the sampler keeps the proposals the
target itself would have drawn (``sampler.verify_drafts``), plus one token of its own. So a
step yields 1 to k + 1 tokens, every one of them a draw of the target model.

Three pieces, each with one writer:
- ``NgramIndex`` (per sequence, written by the scheduler when it asks for a proposal): where
  each n-gram of the sequence last ended, built as tokens arrive, so a proposal costs O(new
  tokens), never a scan of the prompt.
- ``SpecState`` (per sequence, written by the scheduler): the proposals of this step and the
  measured acceptance that sets k.
- ``SpecCosts`` (per engine, written by the engine after each step): what a decode step of
  r rows costs, measured; a verify step is one (a row per position).

Pays or steps aside: k is the one that maximizes expected tokens per step over the step's
measured cost (``choose_k``); a request whose best gain is below 1 does not speculate, and a
batch above ``disable_by_batch_size`` sequences, the waiting ones that have a slot counted in,
does not either (its steps are compute-bound: extra rows cost nearly what they yield). While
a request does not speculate, its proposals are still made and checked against the token
that came ("shadow" acceptance), so it starts again when its reply begins to copy.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence as Seq
from dataclasses import dataclass, field

from typing import TYPE_CHECKING

from localllm.errors import LocalLLMError

if TYPE_CHECKING:
    import torch

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 15  # 1 + k query rows stay within the CPU attention's in-place kernel (16)


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """vLLM's ``speculative_config`` names: ``{"method": "ngram", "num_speculative_tokens": k,
    "prompt_lookup_max": n, "prompt_lookup_min": m, "disable_by_batch_size": b}`` or
    ``{"method": "draft_model", "model": path_or_id, "num_speculative_tokens": k}``. ``k`` is the
    most tokens proposed in one step (the adaptive k stays at or below it); an n-gram of
    ``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens is looked up; above ``b``
    sequences running or waiting (as many as ``max_num_seqs`` leaves slots for) nothing is
    proposed. The method left out is "draft_model" when a ``model`` is given (as vLLM infers
    it), else "ngram"."""

    method: str | None = None
    model: str | None = None  # the draft model (method "draft_model")
    num_speculative_tokens: int = 5
    prompt_lookup_max: int = 4
    # down to one token: a reply that copies finds its span from its last token alone (the
    # longest match still wins), and the measured acceptance keeps a wrong guess cheap
    prompt_lookup_min: int = 1
    disable_by_batch_size: int = 4

    def __post_init__(self) -> None:
        if self.method is None:
            object.__setattr__(self, "method", "draft_model" if self.model is not None else "ngram")
        if self.method not in METHODS:
            raise LocalLLMError(f"speculative_config: method {self.method!r} is not supported; "
                                "use \"ngram\" or \"draft_model\"")
        if self.method == "draft_model" and (not isinstance(self.model, str) or not self.model):
            raise LocalLLMError("speculative_config: method \"draft_model\" needs \"model\", "
                                "a path or id of a small model with the same tokenizer")
        if self.method == "ngram" and self.model is not None:
            raise LocalLLMError("speculative_config: \"model\" is for method \"draft_model\"; "
                                "leave it out for \"ngram\"")
        for name, lo, hi in (("num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS), ("prompt_lookup_max", 1, 64),
                             ("prompt_lookup_min", 1, 64), ("disable_by_batch_size", 1, 1 << 20)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                raise LocalLLMError(f"speculative_config: {name} must be an integer in [{lo}, {hi}], got {v!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise LocalLLMError("speculative_config: prompt_lookup_min must not exceed prompt_lookup_max")

    def max_verify_rows(self, max_num_seqs: int) -> int:
        """The most rows a decode step can have while speculating: every sequence of a batch
        small enough to speculate (``disable_by_batch_size``) with a row per position."""
        return min(max_num_seqs, self.disable_by_batch_size) * (1 + self.num_speculative_tokens)


def speculative_config(value: SpeculativeConfig | Mapping[str, object] | str | None) -> SpeculativeConfig | None:
    """A ``SpeculativeConfig`` from what a caller gave: one, a dict of its fields, a JSON object
    (the CLI's ``--speculative-config``), or None (off). Raises ``LocalLLMError`` naming the bad
    field."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise LocalLLMError(f"speculative_config: not valid JSON ({e})") from None
    if not isinstance(value, Mapping):
        raise LocalLLMError("speculative_config: must be a JSON object such as "
                            "{\"method\": \"ngram\", \"num_speculative_tokens\": 5} or "
                            "{\"method\": \"draft_model\", \"model\": \"PATH\", \"num_speculative_tokens\": 4}")
    unknown = sorted(set(value) - set(SpeculativeConfig.__dataclass_fields__))
    if unknown:
        raise LocalLLMError(f"speculative_config: unknown field {unknown[0]!r}; known: "
                            + ", ".join(SpeculativeConfig.__dataclass_fields__))
    return SpeculativeConfig(**value)  # type: ignore[arg-type]


class NgramIndex:
    """Where each n-gram (``n_min <= n <= n_max``) of a token list last ended, for the lists'
    ends up to ``indexed`` (exclusive end positions ``e``, so ``tokens[e - n:e]`` is the n-gram
    and ``tokens[e]`` what followed it). Invariant: ``indexed <= len(tokens) - 1`` of the list
    it was last given; that list only grows at its end (``Sequence.token_ids``)."""

    __slots__ = ("n_min", "n_max", "ends", "indexed")

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.ends: list[dict[tuple[int, ...], int]] = [{} for _ in range(n_max - n_min + 1)]
        self.indexed = 0

    def propose(self, tokens: Seq[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest
        n-gram ending ``tokens``; [] when none occurred before."""
        length = len(tokens)
        for e in range(self.indexed + 1, length):  # ends whose next token is known
            for i, table in enumerate(self.ends):
                n = self.n_min + i
                if e >= n:
                    table[tuple(tokens[e - n : e])] = e
        self.indexed = max(self.indexed, length - 1)
        for n in range(self.n_max, self.n_min - 1, -1):
            if length < n:
                continue
            e = self.ends[n - self.n_min].get(tuple(tokens[length - n :]))
            if e is not None:
                return list(tokens[e : e + k])
        return []


# acceptance assumed before anything was measured, and how fast the measure follows the text
PRIOR_ACCEPTANCE = 0.5
# a draft model of the target's family usually agrees with it on most tokens (drafts in
# Leviathan et al. and vLLM's reports keep 0.6-0.8 of them): its requests start, and drift
# back, there
PRIOR_DRAFT_ACCEPTANCE = 0.75
ACCEPTANCE_WEIGHT = 0.25
DRIFT_WEIGHT = 0.05
# The drift leads to the request's own record so far (its kept over its tried proposals, run
# or shadow), the prior counted as this many trials: drifting to the prior alone brought a
# prose reply, whose spurious n-gram matches keep 10-20% of tokens, back to 0.5 between
# matches, and each match then ran a losing verify step (prose on/off 0.88-0.97x on 3 of 4
# prompts, Zen 4, 2026-12-04).
PRIOR_TRIALS = 4


@dataclass(slots=True, eq=False)
class SpecState:
    """A sequence's speculation. ``drafts``: the tokens proposed for the step being run (empty:
    a plain decode); ``shadow``: a proposal made but not run, checked against the next token;
    ``acceptance``: the chance that a proposed token is the target's own draw (an average
    weighted toward recent tokens); ``draft_probs``: for a draft model's sampled proposals,
    the distribution each was drawn from (``[len(drafts), vocab]``, the q of
    ``rejection_sample``; None: greedy proposals, or n-gram ones, a point mass). Writer: the
    scheduler (``draft_probs``: the draft proposer it calls)."""

    index: NgramIndex | None
    drafts: list[int] = field(default_factory=list)
    shadow: int | None = None
    acceptance: float = PRIOR_ACCEPTANCE
    draft_probs: torch.Tensor | None = None
    prior: float = PRIOR_ACCEPTANCE  # before anything is tried
    tried: int = 0  # proposed tokens checked so far (run or shadow) ...
    kept: int = 0  # ... and how many were the target's token

    def observe(self, accepted: bool) -> None:
        self.acceptance += ACCEPTANCE_WEIGHT * (float(accepted) - self.acceptance)
        self.tried += 1
        self.kept += accepted

    def drift(self) -> None:
        """A step without proposals and no shadow to check (a draft model is not run for
        nothing): the measure drifts back toward the request's record (its kept share, the
        prior as ``PRIOR_TRIALS`` trials), so the request tries again later and a text that
        turned predictable is found, while one that never was stays off."""
        record = (self.kept + self.prior * PRIOR_TRIALS) / (self.tried + PRIOR_TRIALS)
        self.acceptance += DRIFT_WEIGHT * (record - self.acceptance)

    def record(self, proposed: int, accepted: int) -> None:
        """A verify step of ``proposed`` drafts kept ``accepted``: each draft up to the first
        rejected one was a trial."""
        for _ in range(accepted):
            self.observe(True)
        if accepted < proposed:
            self.observe(False)


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a verify step of k drafts yields when each is accepted with chance ``acceptance``
    (given the ones before it were): 1 + a + a^2 + ... + a^k."""
    a = min(max(acceptance, 0.0), 1.0)
    return k + 1.0 if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


# a decode step's time grows with its rows (a verify step is a decode step with a row per
# position): per extra row, as a share of a one-row step, before anything is measured
PRIOR_ROW_COST = 0.08
# a draft model's step, as a share of the target's, before it was measured (a draft some 10x
# smaller than its target)
PRIOR_DRAFT_COST = 0.1
COST_WEIGHT = 0.2
WARMUP_STEPS = 3


class SpecCosts:
    """What a decode-only step of r rows takes (``times[r]``, a decaying average, so it follows
    the machine's load): plain decodes are one row each, a speculative decode one per
    position. Writer: the engine, after each decode-only step."""

    __slots__ = ("times", "_seen", "_memo")

    def __init__(self) -> None:
        self.times: dict[int, float] = {}
        self._seen: dict[int, int] = {}
        # each size's estimate until the next observation: choose_k asks for the same few
        # sizes for every sequence and k of a step (scanning the table each time was most of a
        # step's scheduling, ~40 us, with a draft model)
        self._memo: dict[int, float | None] = {}

    def observe(self, rows: int, seconds: float) -> None:
        self._memo.clear()
        old = self.times.get(rows)
        seen = self._seen[rows] = self._seen.get(rows, 0) + 1
        if old is None or seen <= WARMUP_STEPS:
            # the least of the first few: a size's first steps may load or warm a graph, and
            # noise only ever adds time
            self.times[rows] = seconds if old is None else min(old, seconds)
        else:
            self.times[rows] = old + COST_WEIGHT * (seconds - old)

    def time(self, rows: int) -> float | None:
        """Seconds a decode-only step of ``rows`` rows takes, measured or between two measured
        sizes; None before that."""
        return self._time(rows)

    def ratio(self, rows: int, extra: int) -> float:
        """A step of ``rows + extra`` rows over one of ``rows``: measured where both were,
        else from the nearest measured sizes, else the prior."""
        if extra <= 0:
            return 1.0
        a, b = self._time(rows), self._time(rows + extra)
        if a is None or b is None:
            return 1.0 + PRIOR_ROW_COST * extra / rows
        return max(b / a, 1.0)

    def _time(self, rows: int) -> float | None:
        if rows not in self._memo:
            self._memo[rows] = self._estimate(rows)
        return self._memo[rows]

    def _estimate(self, rows: int) -> float | None:
        t = self.times
        if rows in t:
            est = t[rows]
        else:
            below = max((r for r in t if r < rows), default=None)
            above = min((r for r in t if r > rows), default=None)
            if below is None or above is None:
                return None
            w = (rows - below) / (above - below)  # between two measured sizes: a straight line
            est = t[below] + w * (t[above] - t[below])
        if rows in t and self._seen[rows] > WARMUP_STEPS:
            return est
        # a size seen only a few times (or none) is never more than a measured step of more
        # rows, nor than one of fewer rows scaled by the rows (weights are read once a step): a
        # size seen once, in a step that also compiled a kernel (seconds on a GPU), would
        # otherwise price itself, and the sizes next to it, out of use for good
        return min([est, *(v if r > rows else v * rows / r for r, v in t.items() if r != rows)])


def choose_k(acceptances: Seq[float], max_k: Seq[int], costs: SpecCosts, draft_cost: float = 0.0) -> list[int]:
    """Drafts per sequence for one step of ``len(acceptances)`` decoding sequences (``max_k``:
    the most each may take: proposal length, token limits): each the k with the most expected
    tokens per unit of cost, and all zero unless the whole step then yields more tokens per
    second than a plain decode step of the same sequences. ``draft_cost``: what making one
    proposed token costs (a draft model's step, as a share of a plain step of these
    sequences; 0 for an n-gram lookup); proposals are made for all sequences at once, so a
    step pays it ``max(ks)`` times."""
    n = len(acceptances)
    ks: list[int] = []
    for a, top in zip(acceptances, max_k):
        best, best_gain = 0, 1.0
        # no k can pay when even free rows would not: at most 1/(1 - a) tokens for at least
        # one draft step (a draft model stepping aside costs its requests nothing then)
        if draft_cost > 0.0 and a < 1.0 and n - 1 + 1.0 / (1.0 - a) <= n * (1.0 + draft_cost):
            top = 0
        for k in range(1, top + 1):
            # as if this sequence alone speculated: its tokens over what its rows add to the step
            gain = (n - 1 + expected_tokens(a, k)) / (n * (costs.ratio(n, k) + k * draft_cost))
            if gain > best_gain:
                best, best_gain = k, gain
        ks.append(best)
    if not any(ks):
        return ks
    yielded = sum(expected_tokens(a, k) for a, k in zip(acceptances, ks))
    if yielded / (n * (costs.ratio(n, sum(ks)) + max(ks) * draft_cost)) <= 1.0:
        return [0] * n
    return ks


def rejection_sample(
    p: torch.Tensor, q: torch.Tensor, drafts: Seq[int], bonus: int, uniforms: Seq[float],
) -> tuple[list[int], int]:
    """Leviathan et al.'s rejection sampling (vLLM's rejection sampler) for ``k = len(drafts)``
    tokens drawn by a draft model: ``p[i]`` is the target's distribution at the position of
    ``drafts[i]`` (``p[k]``: after the last one), ``q[i]`` the draft's that ``drafts[i]`` was
    drawn from, rows summing to 1 (float64); ``bonus`` a draw from ``p[k]``; ``uniforms``
    2k numbers in [0, 1). Draft i is kept with chance min(1, p_i(d) / q_i(d)), the first
    rejected one replaced by a draw from norm(max(0, p_i - q_i)); all kept: ``bonus`` follows.
    Returns the tokens yielded and how many drafts were kept. Every token yielded is then
    distributed as the target's own draw given the ones before it, whatever q is."""
    import torch

    k = len(drafts)
    for i, d in enumerate(drafts):
        pd, qd = float(p[i, d]), float(q[i, d])
        if qd > 0.0 and uniforms[2 * i] * qd < pd:  # u < p/q without dividing
            continue
        residual = (p[i] - q[i]).clamp_(min=0.0)
        total = float(residual.sum())
        if total <= 0.0:  # p == q up to rounding: the rejection had no mass; draw from p itself
            residual, total = p[i].clone(), float(p[i].sum())
        cdf = residual.cumsum(0)
        at = int(torch.searchsorted(cdf, torch.tensor([uniforms[2 * i + 1] * total], dtype=cdf.dtype),
                                    right=True).item())
        token = min(at, residual.shape[0] - 1)
        while token > 0 and residual[token] <= 0.0:  # past the top by rounding: the last token with mass
            token -= 1
        return [*drafts[:i], token], i
    return [*drafts, bonus], k


def is_eligible(guided: bool, has_penalties: bool) -> bool:
    """Whether a request may speculate. Structured output and penalties change each position's
    logits by the tokens before it, the drafts included, which one pass cannot apply: those
    requests decode one token a step (their output is then exactly what it is without)."""
    return not guided and not has_penalties


__all__ = [
    "METHODS", "MAX_SPECULATIVE_TOKENS", "PRIOR_DRAFT_ACCEPTANCE", "PRIOR_DRAFT_COST", "NgramIndex", "SpecCosts", "SpecState", "SpeculativeConfig",
    "choose_k", "expected_tokens", "is_eligible", "rejection_sample", "speculative_config",
]
