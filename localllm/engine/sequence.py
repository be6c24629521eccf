"""What one request is to the scheduler, block manager, runner and sampler: its sampling
parameters, its tokens and its place in the KV cache. What only the engine's front needs
(prompt text, detokenizer, stop-string state, logprobs, timings) lives in ``outputs``."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from localllm.errors import LocalLLMError


@dataclass(slots=True)
class SamplingParams:
    """vLLM's names and meanings. ``temperature == 0`` is greedy."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        checks = [
            (self.n >= 1, "n must be at least 1"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.top_k == -1 or self.top_k >= 0, "top_k must be -1 (off) or >= 0"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens must be at least 1"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs must be in [0, 20]"),
        ]
        for ok, message in checks:
            if not ok:
                raise LocalLLMError(f"bad sampling parameter: {message}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """Invariants: ``num_computed_tokens <= len(token_ids)``; ``block_table`` covers at least
    ``num_computed_tokens`` tokens; ``block_hashes[i]`` is the chained hash of full block i.

    ``token_ids`` only ever grows at the end (``Scheduler.update`` appends each sampled token;
    preemption keeps them), so views of it handed out in earlier outputs stay valid. One
    writer each: the scheduler for ``status``, ``num_computed_tokens``, ``finish_reason`` and
    ``stop_reason``; the block manager for ``block_table`` and ``block_hashes``."""

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    num_prompt_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # set at first admission; -1 = not admitted yet
    num_preemptions: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        self.num_prompt_tokens = self.num_prompt_tokens or len(self.token_ids)
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        """A copy: for the sampler's penalties, which need every output token anyway."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
