"""What the engine hands out for a request, and the per-request state that produces it.

``RequestState`` is the engine-side record beside a request's ``Sequence``: the prompt
text, the detokenizer, the stop-string state, the grammar of a structured-output request,
logprobs and timings. Each step adds one
token to it and turns it into a ``RequestOutput`` at a cost that does not grow with the
prompt or the reply: the text and ids so far go out as O(1) ``Prefix`` views of lists the
engine only appends to, the new text and ids as deltas. The finished output carries plain
lists and a plain string instead, so a caller that keeps results gets ordinary values.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar, overload

if TYPE_CHECKING:
    from localllm.engine.guided import GrammarMatcher
    from localllm.engine.sequence import Sequence
    from localllm.tokenizer import IncrementalDetokenizer

T = TypeVar("T")


class Prefix(Seq[T], Generic[T]):
    """The items ``start:stop`` of a list that only ever grows at its end, taken in O(1).

    Invariant (kept by the list's one writer, the engine): items are appended, never replaced
    or removed, so a view reads the same items however much the list has grown since."""

    __slots__ = ("_items", "_start", "_stop")

    def __init__(self, items: list[T], start: int = 0, stop: int | None = None) -> None:
        self._items = items
        self._start = start
        self._stop = len(items) if stop is None else stop

    def __len__(self) -> int:
        return self._stop - self._start

    @overload
    def __getitem__(self, index: int) -> T: ...
    @overload
    def __getitem__(self, index: slice) -> list[T]: ...
    def __getitem__(self, index: int | slice) -> T | list[T]:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step == 1:
                return self._items[self._start + start : self._start + max(start, stop)]
            return [self._items[self._start + i] for i in range(start, stop, step)]
        n = len(self)
        if not -n <= index < n:
            raise IndexError("Prefix index out of range")
        return self._items[self._start + (index % n)]

    def __iter__(self) -> Iterator[T]:
        return itertools.islice(self._items, self._start, self._stop)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (Prefix, list, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to a list, so unhashable like one

    def __repr__(self) -> str:
        return repr(list(self))


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

    def on_token(self, now: float) -> None:
        if self.first_token_time is None:
            self.first_token_time = now
        elif self.last_token_time is not None:
            self.inter_token_latencies.append(now - self.last_token_time)
        self.last_token_time = now


@dataclass(slots=True)
class CompletionOutput:
    """One choice of a request (vLLM's fields). ``delta_text``/``delta_token_ids`` are what
    this output adds; ``text``, ``token_ids`` and ``logprobs`` are everything so far, and
    ``text`` is the concatenation of every ``delta_text`` handed out (joined on first read)."""

    index: int
    text_pieces: Seq[str]
    token_ids: Seq[int]
    cumulative_logprob: float | None
    logprobs: Seq[dict[int, float]] | None
    finish_reason: str | None
    stop_reason: str | int | None = None
    delta_text: str = ""
    delta_token_ids: Seq[int] = ()
    _text: str | None = field(default=None, repr=False, compare=False)

    @property
    def text(self) -> str:
        if self._text is None:
            self._text = "".join(self.text_pieces)
        return self._text


@dataclass(slots=True)
class RequestOutput:
    """``error`` is set when this request failed on its own (its sampling, detokenizing or
    stop check raised, or the forward pass of its batch did); ``finished`` is then True."""

    request_id: str
    prompt: str | None
    prompt_token_ids: Seq[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics
    error: Exception | None = None


@dataclass(slots=True, eq=False)
class RequestState:
    """The engine's record of one request beside its ``Sequence``.

    Invariants: ``"".join(text_pieces)`` is the text handed out so far; ``held`` is text
    already decoded but not handed out because it may be the start of a stop string (shorter
    than the longest one); a stop string never overlaps text handed out, so looking for one
    in ``held`` plus the new text is enough, at a cost bounded by the stop strings' length."""

    seq: Sequence
    prompt: str | None
    detokenizer: IncrementalDetokenizer
    metrics: RequestMetrics
    grammar: GrammarMatcher | None = None  # structured output: the request's place in its grammar
    text_pieces: list[str] = field(default_factory=list)
    held: str = ""
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, float]] = field(default_factory=list)

    def add_logprobs(self, token: int, logprob: float, top: dict[int, float] | None) -> None:
        self.cumulative_logprob += logprob
        if self.seq.params.logprobs is not None:
            entry = dict(top or {})
            entry.setdefault(token, logprob)
            self.logprobs.append(entry)

    def add_text(self, token: int) -> tuple[str, str | None]:
        """Detokenizes ``token`` and looks for a stop string; returns the text to hand out now
        and the stop string found (None if none). Text after a stop string is dropped."""
        new = self.detokenizer.add([token])
        stops = self.seq.params.stop
        if not stops:
            return self._emit(new), None
        buf = self.held + new
        best, which = -1, None
        for s in stops:
            at = buf.find(s)
            if at != -1 and (best == -1 or at < best):
                best, which = at, s
        if which is not None:
            self.held = ""
            return self._emit(buf[:best]), which
        if self.seq.finished:
            self.held = ""
            return self._emit(buf), None
        keep = min(len(buf), max(len(s) for s in stops) - 1)
        self.held = buf[len(buf) - keep :]
        return self._emit(buf[: len(buf) - keep]), None

    def flush(self) -> str:
        """The held-back text, handed out because the request ended without a stop string."""
        held, self.held = self.held, ""
        return self._emit(held)

    def _emit(self, text: str) -> str:
        if text:
            self.text_pieces.append(text)
        return text

    def output(self, delta_ids: Seq[int], delta_text: str, error: Exception | None = None) -> RequestOutput:
        seq = self.seq
        p = seq.num_prompt_tokens
        want_logprobs = seq.params.logprobs is not None
        if seq.finished:  # plain values for callers that keep the result; made once per request
            text = "".join(self.text_pieces)
            pieces: Seq[str] = (text,)
            prompt_ids: Seq[int] = seq.token_ids[:p]
            token_ids: Seq[int] = seq.token_ids[p:]
            logprobs: Seq[dict[int, float]] | None = list(self.logprobs) if want_logprobs else None
        else:
            text = None
            pieces = Prefix(self.text_pieces)
            prompt_ids = Prefix(seq.token_ids, 0, p)
            token_ids = Prefix(seq.token_ids, p)
            logprobs = Prefix(self.logprobs) if want_logprobs else None
        completion = CompletionOutput(
            0, pieces, token_ids, self.cumulative_logprob if want_logprobs else None, logprobs,
            seq.finish_reason, seq.stop_reason, delta_text, delta_ids, text,
        )
        return RequestOutput(seq.request_id, self.prompt, prompt_ids, [completion], seq.finished,
                             max(seq.num_cached_tokens, 0), self.metrics, error)


def joined(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """``later`` carrying ``earlier``'s deltas before its own, for a consumer that is handed
    ``later`` instead of both (its text, ids and logprobs so far already cover both).
    ``later`` is changed in place: only its maker, which has not handed it out, may call this."""
    a, b = earlier.outputs[0], later.outputs[0]
    b.delta_text = a.delta_text + b.delta_text
    b.delta_token_ids = [*a.delta_token_ids, *b.delta_token_ids]
    return later
