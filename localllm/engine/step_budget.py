"""How many prompt tokens a step may take beside running decodes: as many as the measured cost
of a step says keep it within its limit, so that a long prompt never stretches the running
chats' gap between tokens by more than a bounded factor.

Why a cost model and not a running average of "seconds per prompt token": a chunk's cost
grows with where it starts in its prompt (each new token attends to every key before it, and
on CPU a chunk's keys are gathered once per step). On a 2-core CPU with the default model a
16-token chunk beside one decode took 30 ms at position 0 and 210 ms at position 7,800, and
the average of the chunks before always lagged behind the next one (bench/prefill_gap.py).

The model, fitted to the engine's step times (least squares, older steps forgotten
geometrically, every coefficient kept >= 0): a step with ``d`` decode rows and prompt chunks
of ``n_i`` tokens starting at ``p_i`` takes

    t = c0 + c1 * d + c2 * sum(n_i) + c3 * sum(n_i * (p_i + n_i / 2)) + c4 * sum(p_i)

(a fixed cost; decode rows; the chunk's own rows: GEMMs; attention to the keys before each
token; work per chunk that grows with its start, such as gathering its keys). A step beside
decodes may take ``limit`` seconds: ``max_gap_ratio`` times a decode-only step, or, where even
the smallest chunk at this position costs more than that (an eager mixed step beside a
compiled decode on CPU: ~6x), ``headroom`` times that smallest step (smoothed over the steps
of a prefill), and never more than ``max_limit_ratio`` decode-only steps (measured before the
prefill, so load during it cannot raise the limit through the model's fixed cost). The limit then grows with the prompt's position no faster than the unavoidable
cost does, so over one prefill the longest step stays within a small factor of the median one.
A step beside decodes can never be within ``max_gap_ratio`` decode steps where even the
smallest mixed step costs more: the chats' gap is then bounded relative to that step.

Safety while the model learns: before a step with prompt tokens has been measured, a chunk
beside decodes is ``first_tokens``; the prompt tokens of a step beside decodes grow at most
``growth`` times per step; after a step that overran its limit, the next takes at most its
tokens scaled down by the overrun; one step over twice its prediction (another process took
the cores) is not learnt, a second in a row is. Without decodes nobody waits on a gap: a prompt takes the
whole token budget (the engine's prefill speed alone is unchanged).

A burst of short prompts (``burst_tokens`` or fewer each, two or more waiting) joins whole,
within the token budget and ``max_limit_ratio`` decode-only steps (``fit_burst``): chats opened
together then start together, and a step waits for them once instead of over a ramp.

Invariants: ``fit`` gives a step's first chunk at least ``min(want, min_tokens)`` (a prompt
always advances), never more than ``want`` or the token budget left, never a 1-token chunk of
a longer prompt (it would pass for a decode); the engine is the one writer of the measurements (``observe``), the scheduler
of a step's plan (``begin``, ``fit``, ``take``).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

# features: 1, decode rows, prompt tokens / 100, attended keys (n * (p + n/2)) / 1e5, starts / 1e3;
# scaled so that their coefficients are of like size (seconds per unit, well conditioned)
NUM_FEATURES = 5
_SCALES = (1.0, 1.0, 1e-2, 1e-5, 1e-3)


@dataclass(slots=True)
class StepSample:
    """One measured step, as the budget saw it (for benchmarks and tests)."""

    decodes: int
    prompt_tokens: int
    start: int  # where the step's first prompt chunk starts; -1 without one
    seconds: float
    predicted_s: float | None  # the model's cost for this step when it was planned
    limit_s: float | None  # the step's limit beside decodes; None: no limit (no decodes, or none known)


def _features(decodes: int, chunks: list[tuple[int, int]]) -> list[float]:
    n = sum(c for _, c in chunks)
    keys = sum(c * (p + c / 2) for p, c in chunks)
    starts = sum(p for p, _ in chunks)
    raw = (1.0, float(decodes), float(n), keys, float(starts))
    return [r * s for r, s in zip(raw, _SCALES)]


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """``a x = b`` by Gaussian elimination with partial pivoting; None when singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-18:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            if f:
                for c in range(col, n + 1):
                    m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


@dataclass(slots=True)
class PrefillBudget:
    """The engine's step times -> the prompt tokens a step beside decodes may take. The engine
    is the one writer of measurements (``observe`` after each step); the scheduler plans each
    step with ``begin``, ``fit`` and ``take``."""

    max_gap_ratio: float = 3.0  # a step beside decodes: up to this many decode-only steps...
    headroom: float = 2.0  # ...or this many of the cheapest such step at the prompt's position
    max_limit_ratio: float = 64.0  # ...but never more than this many decode-only steps
    min_tokens: int = 16  # the least a prompt takes in a step: it always advances
    first_tokens: int = 32  # a chunk beside decodes before any step with prompt tokens was measured
    burst_tokens: int = 64  # a prompt this short, waiting with others as short, joins a step whole (``fit_burst``)
    growth: float = 2.0  # the prompt tokens of steps beside decodes grow at most this much a step
    forget: float = 0.9  # weight of a measurement one step older (about 10 steps remembered)
    ridge: float = 1e-6  # keeps the fit defined before every feature has varied
    weight: float = 0.3  # of the newest decode-only step in its running average
    decode_s: float | None = None  # a decode-only step, running average
    coef: list[float] | None = None  # the cost model's coefficients (scaled features), None until fitted
    history: deque[StepSample] = field(default_factory=lambda: deque(maxlen=4096))
    # the normal equations, older steps forgotten: sum w x x^T, sum w x y
    _xtx: list[list[float]] = field(default_factory=lambda: [[0.0] * NUM_FEATURES for _ in range(NUM_FEATURES)])
    _xty: list[float] = field(default_factory=lambda: [0.0] * NUM_FEATURES)
    # the step being planned (scheduler) and then measured (engine)
    _decodes: int = 0
    _chunks: list[tuple[int, int]] = field(default_factory=list)
    _limit: float | None = None
    _last_tokens: int = 0  # prompt tokens of the last measured step beside decodes
    _overrun: float = 1.0  # that step's seconds over its limit (1.0: within)
    _last_limit: float | None = None  # the limit of the last step beside decodes in this prefill
    _outlier_before: bool = False  # the last step with prompt tokens took over 2x its prediction

    # ---- the scheduler's side ----

    def begin(self, decodes: int) -> None:
        """A new step with ``decodes`` decode rows (plain or speculative) before its prompt
        chunks; its limit is set by the first chunk ``fit`` sees."""
        self._decodes = decodes
        self._chunks = []
        self._limit = None

    def fit(self, start: int, want: int, tokens_left: int) -> int:
        """How many of ``want`` prompt tokens, starting at position ``start`` of their
        sequence, this step takes, with ``tokens_left`` of the step's token budget left."""
        if want <= 0 or tokens_left <= 0 or not self._decodes:
            return max(min(want, tokens_left), 0)
        if self._limit is None and self.coef is not None and self.decode_s is not None:
            # the smallest step at this position: what the chats' gap costs here anyway
            smallest = self.predict(self._decodes, [(start, self.min_tokens)])
            limit = max(self.max_gap_ratio * self.decode_s, self.headroom * smallest)
            # the decode-only step was measured before this prefill began: an anchor that a
            # burst of load during it cannot move (the model's fixed cost can, and a limit
            # that follows it runs away: 0.16 s to 9.9 s in one loaded run)
            limit = min(limit, self.max_limit_ratio * self.decode_s)
            # smoothed over the steps of a prefill: the true limit moves slowly with the
            # position, the model's guess at the smallest step jumps with its noise
            last = self._last_limit
            self._limit = limit if last is None else last + 0.25 * (limit - last)
            self._last_limit = self._limit
        want = min(want, tokens_left)
        floor = 0 if self._chunks else min(want, self.min_tokens)  # the step's first chunk advances
        if self.coef is None or self.decode_s is None:
            # nothing measured yet: a small chunk, whatever it is beside
            return max(floor, min(want, self.first_tokens - self.planned_tokens))
        n = self._largest(start, want)
        # while the model learns: no jump past what was measured, less after an overrun
        cap = max(self.min_tokens, self._last_tokens) * self.growth / max(self._overrun, 1.0)
        n = max(floor, min(n, int(cap) - self.planned_tokens, want))
        return 0 if n == 1 < want else n  # a 1-token chunk would pass for a decode

    def fit_burst(self, start: int, want: int, tokens_left: int) -> int:
        """A short prompt of a burst (several short prompts waiting at once: chats opened
        together): all of its ``want`` tokens, or 0 (the caller then chunks it by ``fit``).
        Ramping up by ``fit`` let 16 chats of ~40-token prompts beside the first one's decode
        join over 5 mixed steps, each an eager step; admitted together, the running chats wait
        one step, which is still bounded: by the token budget, and once the model is fitted by
        ``max_limit_ratio`` decode-only steps, the bound a long prefill's steps keep too. A
        long prompt never takes this path, so it never stalls the running chats."""
        if want <= 0 or want > min(self.burst_tokens, tokens_left):
            return 0
        if self._decodes and self.coef is not None and self.decode_s is not None:
            if self.predict(self._decodes, [*self._chunks, (start, want)]) > self.max_limit_ratio * self.decode_s:
                return 0
        return want

    def take(self, start: int, n: int) -> None:
        """``n`` prompt tokens from ``start`` are in this step (after ``fit``, once their
        blocks are allocated)."""
        if n > 0:
            self._chunks.append((start, n))

    @property
    def planned_tokens(self) -> int:
        return sum(n for _, n in self._chunks)

    @property
    def limit_s(self) -> float | None:
        """The limit of the step being planned (None: none yet, or no decodes)."""
        return self._limit

    def predict(self, decodes: int, chunks: list[tuple[int, int]]) -> float:
        """Seconds a step with ``decodes`` decode rows and ``chunks`` ((start, tokens) each)
        takes by the model (0.0 before it is fitted)."""
        if self.coef is None:
            return 0.0
        return sum(c * x for c, x in zip(self.coef, _features(decodes, chunks)))

    def _largest(self, start: int, want: int) -> int:
        """The most tokens from ``start`` (at most ``want``) that keep the planned step within
        its limit by the model: cost is increasing in the tokens, so a bisection."""
        assert self._limit is not None
        chunks = self._chunks
        lo, hi = 0, want
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.predict(self._decodes, [*chunks, (start, mid)]) <= self._limit:
                lo = mid
            else:
                hi = mid - 1
        return lo

    # ---- the engine's side ----

    def observe(self, seconds: float, prompt_tokens: int, decodes: int) -> None:
        """The step just planned took ``seconds``; it had ``prompt_tokens`` prompt tokens and
        ``decodes`` decode rows. A step whose prompt tokens differ from the plan (a failed
        forward pass, a plan the scheduler did not finish) teaches nothing about chunks."""
        chunks, self._chunks = self._chunks, []
        limit, self._limit = self._limit, None
        if prompt_tokens == 0:
            if decodes:
                old = self.decode_s
                self.decode_s = seconds if old is None else old + self.weight * (seconds - old)
                self.history.append(StepSample(decodes, 0, -1, seconds, None, None))
                # no prompt beside them: the next one ramps up again
                self._last_tokens, self._overrun, self._last_limit = 0, 1.0, None
            return
        if sum(n for _, n in chunks) != prompt_tokens:
            return
        predicted = self.predict(decodes, chunks) if self.coef is not None else None
        self.history.append(StepSample(decodes, prompt_tokens, chunks[0][0], seconds, predicted, limit))
        if decodes:
            self._last_tokens = prompt_tokens
            self._overrun = seconds / limit if limit else 1.0
        # A step stretched by something else (another process took the cores, a collection)
        # is skipped once; a second in a row is the cost moving, learnt (at most 3x at a time).
        outlier = predicted is not None and predicted > 0 and seconds > 2.0 * predicted
        if outlier and not self._outlier_before:
            self._outlier_before = True
            return
        self._outlier_before = False
        y = seconds if predicted is None or predicted <= 0 else min(seconds, 3.0 * predicted)
        x = _features(decodes, chunks)
        f = self.forget
        for i in range(NUM_FEATURES):
            self._xty[i] = f * self._xty[i] + x[i] * y
            row = self._xtx[i]
            for j in range(NUM_FEATURES):
                row[j] = f * row[j] + x[i] * x[j]
        self.coef = self._nonnegative_fit()

    def _nonnegative_fit(self) -> list[float] | None:
        """Least squares over the remembered steps with every coefficient >= 0: a feature
        whose coefficient comes out negative (noise, or a feature that has not varied) is
        dropped and the rest refitted."""
        active = list(range(NUM_FEATURES))
        while active:
            a = [[self._xtx[i][j] + (self.ridge if i == j else 0.0) for j in active] for i in active]
            x = _solve(a, [self._xty[i] for i in active])
            if x is None:
                return self.coef
            worst = min(range(len(active)), key=lambda k: x[k])
            if x[worst] >= 0:
                coef = [0.0] * NUM_FEATURES
                for k, i in enumerate(active):
                    coef[i] = x[k]
                return coef if all(math.isfinite(c) for c in coef) else self.coef
            active.pop(worst)
        return self.coef
