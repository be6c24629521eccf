"""What one request is to the scheduler, block manager, runner and sampler: its sampling
parameters, its tokens and its place in the KV cache. What only the engine's front needs
(prompt text, detokenizer, stop-string state, logprobs, timings) lives in ``outputs``."""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch

from localllm.errors import InvalidParameterError
from localllm.tokenizer import lone_surrogate

if TYPE_CHECKING:
    from localllm.engine.spec_decode import SpecState

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
MAX_LOGPROBS = 20
# vLLM's rule: below this, temperature means greedy (logits / 1e-7 overflow the softmax).
GREEDY_EPS = 1e-5

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")  # see engine/guided.py


@dataclass(slots=True)
class SamplingParams:
    """vLLM's names and meanings. ``temperature`` below ``GREEDY_EPS`` (0 included) is greedy;
    ``top_k`` -1 or 0 is no limit.

    Invariant once admitted: every field has its type and range, and every token id or count
    (``top_k``, ``stop_token_ids``, ``logprobs``) fits the model's vocabulary, so nothing a user
    sends reaches a tensor index unchecked. Construction checks what needs no model;
    ``LLMEngine.add_request`` calls ``validate`` again with the vocabulary size, which also
    catches fields changed after construction."""

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
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, (list, tuple)):  # any other type is refused by validate
            self.stop = [s for s in self.stop if s != ""]
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids)
        self.validate()
        self._check_guided()

    def validate(self, vocab_size: int | None = None) -> None:
        """Raises ``InvalidParameterError`` naming the first bad field; with ``vocab_size``,
        also checks what depends on the model."""
        _integer("n", self.n, "an integer >= 1", lo=1)
        _real("temperature", self.temperature, "a finite number >= 0 (0 is greedy)", lo=0.0)
        _real("top_p", self.top_p, "a number in (0, 1]", lo=0.0, lo_open=True, hi=1.0)
        if vocab_size is None:
            _integer("top_k", self.top_k, "-1 or 0 (no limit) or a positive integer", lo=-1)
        else:
            _integer("top_k", self.top_k, f"-1 or 0 (no limit) or at most {vocab_size} (the vocabulary size)",
                     lo=-1, hi=vocab_size)
        _real("min_p", self.min_p, "a number in [0, 1]", lo=0.0, hi=1.0)
        _real("repetition_penalty", self.repetition_penalty, "a finite number > 0 (1 is off)", lo=0.0, lo_open=True)
        _real("presence_penalty", self.presence_penalty, "a number in [-2, 2]", lo=-2.0, hi=2.0)
        _real("frequency_penalty", self.frequency_penalty, "a number in [-2, 2]", lo=-2.0, hi=2.0)
        if self.seed is not None:
            _integer("seed", self.seed, f"an integer in [{SEED_MIN}, {SEED_MAX}]", lo=SEED_MIN, hi=SEED_MAX)
        if self.max_tokens is not None:
            _integer("max_tokens", self.max_tokens, "an integer >= 1", lo=1)
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise InvalidParameterError("stop", f"must be a string or a list of strings, got {_show(self.stop)}")
        for s in self.stop:
            if (at := lone_surrogate(s)) is not None:
                raise InvalidParameterError(
                    "stop", f"{_show(s)} holds a lone surrogate at character {at}, which is not valid Unicode text")
        if not isinstance(self.stop_token_ids, list):
            raise InvalidParameterError("stop_token_ids", f"must be a list of token ids, got {_show(self.stop_token_ids)}")
        hi = None if vocab_size is None else vocab_size - 1
        for t in self.stop_token_ids:
            _integer("stop_token_ids", t, "token ids >= 0" if hi is None else f"token ids in [0, {hi}]", lo=0, hi=hi)
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidParameterError(name, f"must be true or false, got {_show(getattr(self, name))}")
        if self.logprobs is not None:
            top = MAX_LOGPROBS if vocab_size is None else min(MAX_LOGPROBS, vocab_size)
            _integer("logprobs", self.logprobs, f"an integer in [0, {top}]", lo=0, hi=top)

    def _check_guided(self) -> None:
        named = [f for f in GUIDED_FIELDS if getattr(self, f) is not None]
        if len(named) > 1:
            raise InvalidParameterError(named[1], f"{' and '.join(named)} exclude each other; set one")
        if isinstance(self.guided_json, str):
            try:
                json.loads(self.guided_json)
            except ValueError as e:
                raise InvalidParameterError("guided_json", f"not valid JSON ({e})") from None
        elif self.guided_json is not None and not isinstance(self.guided_json, dict):
            raise InvalidParameterError("guided_json", "must be a JSON schema (an object)")
        if self.guided_choice is not None and (
            not isinstance(self.guided_choice, (list, tuple)) or not self.guided_choice
            or not all(isinstance(c, str) and c for c in self.guided_choice)
        ):
            raise InvalidParameterError("guided_choice", "must be a non-empty list of non-empty strings")

    @property
    def guided(self) -> bool:
        return any(getattr(self, f) is not None for f in GUIDED_FIELDS)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice ``index`` of an n > 1 request: seed + index, wrapped into the seed
    range so that a valid seed never makes an invalid one."""
    if seed is None or index == 0:
        return seed
    return SEED_MIN + (seed + index - SEED_MIN) % (SEED_MAX - SEED_MIN + 1)


def _show(value: Any) -> str:
    """A value for an error message: one short line, whatever it is."""
    try:
        text = repr(value)
    except ValueError:  # an int too long to print (Python's 4300-digit limit)
        return "a very large integer"
    return text if len(text) <= 40 else text[:37] + "..."


def _integer(param: str, value: Any, expected: str, lo: int | None = None, hi: int | None = None) -> None:
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if not ok or (lo is not None and value < lo) or (hi is not None and value > hi):
        raise InvalidParameterError(param, f"must be {expected}, got {_show(value)}")


def _real(
    param: str, value: Any, expected: str, lo: float | None = None, hi: float | None = None, lo_open: bool = False,
) -> None:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if ok:
        try:
            x = float(value)
        except OverflowError:  # an int beyond float range
            ok = False
        else:
            ok = (math.isfinite(x) and (lo is None or (x > lo if lo_open else x >= lo))
                  and (hi is None or x <= hi))
    if not ok:
        raise InvalidParameterError(param, f"must be {expected}, got {_show(value)}")


class TokenColumn:
    """A 1-D device tensor used as a list that grows at its end (capacity doubles), so adding
    an item is one small write, never a copy of what is there."""

    __slots__ = ("data", "size")

    def __init__(self, values: list[int] | list[float], dtype: torch.dtype, device: torch.device) -> None:
        self.data = torch.zeros(max(2 * len(values), 64), dtype=dtype, device=device)
        self.data[: len(values)] = torch.tensor(values, dtype=dtype)
        self.size = len(values)

    def append(self, value: float) -> None:
        if self.size == self.data.shape[0]:
            grown = torch.zeros(2 * self.size, dtype=self.data.dtype, device=self.data.device)
            grown[: self.size] = self.data
            self.data = grown
        self.data[self.size] = value
        self.size += 1

    def view(self) -> torch.Tensor:
        return self.data[: self.size]


@dataclass(slots=True, eq=False)
class PenaltyState:
    """A sequence's tokens as the sampler's penalties need them, on the logits' device. The
    sampler is its one writer and brings it up to date at each step for the tokens added since,
    so a step costs the same whatever the length of the prompt and the reply, and touches only the
    tokens seen, not the vocabulary (rebuilding counts over the vocabulary from every id each
    step was ~1.2 ms a token on CPU).

    Invariants, over the first ``absorbed`` output tokens: ``seen`` (only for a repetition
    penalty) holds each distinct token of the prompt and those outputs once, ``seen_set`` the
    same in Python; ``out_ids`` each distinct output token once, ``out_counts`` how often each
    came, ``out_index`` where each is in ``out_ids``."""

    seen: TokenColumn | None
    seen_set: set[int]
    out_ids: TokenColumn
    out_counts: TokenColumn
    out_index: dict[int, int]
    absorbed: int = 0


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
    ``stop_reason``; the block manager for ``block_table`` and ``block_hashes``; the sampler
    for ``penalties``; the scheduler for ``spec``.

    Speculation: a step may compute ``1 + len(spec_token_ids)`` positions (the last token,
    then the proposals); only those of accepted tokens count as computed, so
    ``num_computed_tokens`` and the prefix-cache hashes never cover a rejected proposal, and
    blocks past the accepted tokens go back to the free queue (``BlockManager.trim``)."""

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
    penalties: PenaltyState | None = None  # made at the first step that applies a penalty
    # speculative decoding (engine/spec_decode.py): None when off for this request
    spec: SpecState | None = None

    @property
    def spec_token_ids(self) -> list[int]:
        """The proposed tokens this step verifies after ``token_ids`` (none: a plain step)."""
        return self.spec.drafts if self.spec is not None else []

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
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
