"""What one request is: its sampling parameters, its tokens, its place in the KV cache and
its timings. Everything the scheduler, block manager and runner read lives here."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch

from localllm.errors import LocalLLMError
from localllm.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from localllm.engine.guided import GrammarMatcher

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")  # see engine/guided.py


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
    # structured output (see engine/guided.py): at most one of these
    guided_json: dict[str, Any] | str | None = None  # a JSON schema
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None  # Lark, llguidance's dialect

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
        self._check_guided()

    def _check_guided(self) -> None:
        named = [f for f in GUIDED_FIELDS if getattr(self, f) is not None]
        if len(named) > 1:
            raise LocalLLMError(f"bad sampling parameter: {' and '.join(named)} exclude each other; set one")
        if isinstance(self.guided_json, str):
            try:
                json.loads(self.guided_json)
            except ValueError as e:
                raise LocalLLMError(f"bad sampling parameter: guided_json is not valid JSON ({e})") from None
        elif self.guided_json is not None and not isinstance(self.guided_json, dict):
            raise LocalLLMError("bad sampling parameter: guided_json must be a JSON schema (an object)")
        if self.guided_choice is not None and (
            not isinstance(self.guided_choice, (list, tuple)) or not self.guided_choice
            or not all(isinstance(c, str) and c for c in self.guided_choice)
        ):
            raise LocalLLMError("bad sampling parameter: guided_choice must be a non-empty list of non-empty strings")

    @property
    def guided(self) -> bool:
        return any(getattr(self, f) is not None for f in GUIDED_FIELDS)

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


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    inter_token_latencies: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass(slots=True, eq=False)
class Sequence:
    """Invariants: ``num_computed_tokens <= len(token_ids)``; ``block_table`` covers at least
    ``num_computed_tokens`` tokens; ``block_hashes[i]`` is the chained hash of full block i."""

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    num_prompt_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # set at first admission; -1 = not admitted yet
    num_preemptions: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    output_text: str = ""
    num_emitted_chars: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    generator: torch.Generator | None = None
    grammar: GrammarMatcher | None = None  # structured output: the request's place in its grammar
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, float]] = field(default_factory=list)
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))

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
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
