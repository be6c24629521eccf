"""How many prompt tokens a step may take beside running decodes: as many as keep that step
within ``max_gap_ratio`` times a decode-only step, measured as the engine runs.

A token budget alone (``max_num_batched_tokens``) lets one long prompt stretch every running
chat's gap between tokens: on a 2-core CPU a 512-token chunk late in a 7,000-token prompt took
3.5-10 s while a decode step took 0.04 s (a 232x gap, bench/soak.py --prefill-probe). Here the
engine reports each step's time; a decode-only step sets the baseline, a step with prompt tokens
the cost of one prompt token (which grows with the keys the prompt attends to, so the running
average follows the prompt). Without decodes a prompt takes the whole token budget: nobody is
waiting on a gap then.

Invariant: ``cap()`` is None until both costs have been seen, else at least ``min_tokens``, so
a prompt always advances.
"""

from __future__ import annotations

from dataclasses import dataclass


def _average(old: float | None, new: float, weight: float) -> float:
    return new if old is None else old + weight * (new - old)


@dataclass(slots=True)
class PrefillBudget:
    """The engine's step times -> the prompt tokens a step beside decodes may take. The engine
    is the one writer (``observe`` after each step); the scheduler reads ``cap``."""

    max_gap_ratio: float = 3.0
    min_tokens: int = 16
    weight: float = 0.3  # of the newest step in each running average
    decode_s: float | None = None  # a decode-only step
    token_s: float | None = None  # what one prompt token adds to a step

    def observe(self, seconds: float, prompt_tokens: int, decodes: int) -> None:
        if prompt_tokens == 0:
            if decodes:
                self.decode_s = _average(self.decode_s, seconds, self.weight)
            return
        base = self.decode_s if decodes and self.decode_s is not None else 0.0
        self.token_s = _average(self.token_s, max(seconds - base, 0.0) / prompt_tokens, self.weight)

    def cap(self) -> int | None:
        if self.decode_s is None or not self.token_s:
            return None
        return max(self.min_tokens, int((self.max_gap_ratio - 1) * self.decode_s / self.token_s))
