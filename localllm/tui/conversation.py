"""What one chat holds, apart from how it is shown: its turns, the reply being streamed and
its figures, and what a tab needs from the app that hosts it.

Textual-free: the pane (``chat``) renders these; the history stores them. A ``Turn`` mirrors
one history row of the branch on screen; a ``Reply`` is written only by the pane's generation
worker and the pane's timers, all on the app's event loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from localllm.errors import LocalLLMError
from localllm.history import History, StoredMessage
from localllm.reasoning import ReasoningFormat, ReasoningParser, prompt_tail

if TYPE_CHECKING:
    from localllm.engine.engine import RequestOutput
    from localllm.tokenizer import Tokenizer
    from localllm.tui.backend import ChatEngine
    from localllm.tui.widgets import MessageView

CONTINUABLE = ("abort", "interrupted", "length")  # finish reasons "Go on" continues from


class ChatHost(Protocol):
    """What a tab needs from the app that holds the engine and the history."""

    @property
    def history(self) -> History: ...

    @property
    def engine(self) -> ChatEngine | None: ...

    @property
    def engine_loading(self) -> bool: ...

    @property
    def model_name(self) -> str: ...

    def base_params(self) -> dict[str, Any]:
        """Sampling settings a tab runs with before its own: DEFAULT_PARAMS, the model's, the config's."""

    async def wait_for_engine(self) -> ChatEngine:
        """The engine once loaded; raises LocalLLMError (for the user) if there is none."""


@dataclass(slots=True)
class Turn:
    """A message as the pane holds it; ``message_id`` is its history row once written."""

    role: str
    content: str
    message_id: int | None = None
    finish_reason: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    parent_id: int | None = None
    branch: tuple[int, int] = (0, 1)  # (index, count) among the alternatives at this point
    reasoning: str = ""  # a thinking model's reasoning: shown folded, apart from ``content`` (the answer)

    @classmethod
    def stored(cls, m: StoredMessage) -> Turn:
        return cls(m.role, m.content, m.id, m.finish_reason, m.meta, m.parent_id, (m.sibling_index, m.num_siblings),
                   m.reasoning)


@dataclass(slots=True)
class Reply:
    """The reply being streamed: text so far, text not yet painted, and its figures.
    ``prefix`` is the text an interrupted reply had before it was continued.

    With a ``thinking`` format the model's text is split as it streams: ``text`` is the answer
    alone and ``reasoning`` what the model thought before it; the parser starts where the
    prompt (its last tokens, from the first output) leaves the reply."""

    view: MessageView
    turn: Turn
    request_id: str
    prefix: str = ""
    prefix_tokens: int = 0
    text: str = ""
    saved: str = ""  # what the history holds
    pending: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    num_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    tok_s: float = 0.0
    first_token_time: float | None = None
    settled: bool = False  # committed to history; Esc during the final render must not commit twice
    thinking: ReasoningFormat | None = None
    tokenizer: Tokenizer | None = None  # for where the prompt leaves the reply (None: at its start)
    reasoning: str = ""
    saved_reasoning: str = ""  # what the history holds
    reasoning_changed: bool = False  # reasoning not yet painted
    parser: ReasoningParser | None = None
    answer: str = ""  # the answer this request produced (after ``prefix``)

    def add(self, out: RequestOutput) -> None:
        completion = out.outputs[0]
        delta = completion.delta_text
        if self.thinking is not None:
            if self.parser is None:
                tail = prompt_tail(self.tokenizer, out.prompt_token_ids) if self.tokenizer is not None else ""
                self.parser = self.thinking.parser(tail)
            split = self.parser.read(delta, out.finished)
            if split.reasoning:
                self.reasoning += split.reasoning
                self.reasoning_changed = True
            delta = split.content
            self.answer += delta
        else:
            self.answer = completion.text
        if delta:
            self.pending.append(delta)
        self.text = self.prefix + self.answer
        self.num_tokens = self.prefix_tokens + len(completion.token_ids)
        self.prompt_tokens = len(out.prompt_token_ids)
        self.cached_tokens = out.num_cached_tokens
        m = out.metrics
        first, last = m.first_token_time, m.last_token_time
        n = len(completion.token_ids)
        if first is not None and last is not None and last > first and n > 1:
            self.tok_s = (n - 1) / (last - first)
        if out.finished:
            self.finish_reason = completion.finish_reason or "stop"

    def meta(self, sent_after: int | None, limit: int | None) -> dict[str, Any]:
        meta: dict[str, Any] = {"tok_s": round(self.tok_s, 2), "cached_tokens": self.cached_tokens,
                                "tokens": self.num_tokens}
        if self.prompt_tokens:
            # The exact context at the end of this reply, valid while the chat drops the
            # same turns.
            meta["prompt_tokens"] = self.prompt_tokens - self.prefix_tokens
            meta["sent_after"] = sent_after
        else:  # a server that sent no usage: its stream was counted in chunks
            meta["estimated"] = True
        if self.finish_reason == "length" and limit and self.prompt_tokens + self.num_tokens - self.prefix_tokens >= limit:
            meta["context_limit"] = True
        return meta


def describe(e: BaseException) -> str:
    # LocalLLMError messages are written for users; anything else needs its type to make sense.
    return str(e) if isinstance(e, LocalLLMError) else f"{type(e).__name__}: {e}"
