"""Reasoning kept apart from the answer: a reply's text split into ``reasoning`` and ``content``.

Thinking models write their reasoning into the reply itself, marked by their chat format:

- ``<think> ... </think>`` before the answer (Qwen3, QwQ, DeepSeek-R1 and its distills). Some
  templates open the block in the prompt (DeepSeek-R1's later template, Qwen3's thinking-only
  models), so the reply starts inside the reasoning with no opening tag of its own; Qwen3 with
  ``enable_thinking=False`` writes an empty, closed block into the prompt instead.
- gpt-oss's harmony messages: ``<|channel|>analysis<|message|> ... <|end|>`` is reasoning,
  ``<|start|>assistant<|channel|>final<|message|> ...`` the answer. Its markers are special
  tokens, so the reply must be detokenized with them kept (``ReasoningFormat.skip_special_tokens``).

Which format applies comes from the model (its chat template, else its architecture), as vLLM's
``--reasoning-parser`` picks one, and that flag overrides it with vLLM's names.

Invariant of every ``ReasoningParser``: the deltas of ``feed`` over any split of a reply into
chunks, then ``finish``, join to the same (reasoning, content) as feeding the reply whole: a
marker cut across chunks is held back until it is whole or cannot be one. Nothing is model-
specific beyond the markers; nothing here needs torch or a model.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

from localllm.errors import LocalLLMError

if TYPE_CHECKING:
    from collections.abc import Sequence

    from localllm.tokenizer import Tokenizer

# vLLM's parser names: ``qwen3`` and ``deepseek_r1`` read <think> blocks, ``openai_gptoss`` harmony.
THINK_PARSERS = ("qwen3", "deepseek_r1")
HARMONY_PARSER = "openai_gptoss"
PARSER_NAMES = (*THINK_PARSERS, HARMONY_PARSER)
NONE = "none"  # the override that turns separation off
AUTO = "auto"

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")
# A harmony header (role, channel, recipient, constraint) is a few tokens; a "header" that goes
# on longer than this without <|message|> is not one, and its text is treated as answer.
MAX_HEADER_CHARS = 256
# How much of the prompt's end decides the state a reply starts in (the generation prompt
# and, for a template that opens the reasoning itself, that opening).
PROMPT_TAIL_TOKENS = 24


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    """What one piece of a reply adds to each side."""

    reasoning: str = ""
    content: str = ""

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content)


class ReasoningParser(ABC):
    """One reply's splitter. ``feed`` each new piece of text, then ``finish`` once."""

    @abstractmethod
    def feed(self, text: str) -> ReasoningDelta: ...

    @abstractmethod
    def finish(self) -> ReasoningDelta:
        """Hands out what was held back (a partial marker that never completed)."""

    def read(self, text: str, finished: bool) -> ReasoningDelta:
        """``feed``, and on the reply's last piece ``finish`` too: what a stream delta adds to each side."""
        delta = self.feed(text)
        if not finished:
            return delta
        rest = self.finish()
        return ReasoningDelta(delta.reasoning + rest.reasoning, delta.content + rest.content)

    def split(self, text: str) -> tuple[str, str]:
        """The whole reply at once: (reasoning, content)."""
        a, b = self.feed(text), self.finish()
        return a.reasoning + b.reasoning, a.content + b.content


def _partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of ``text`` that is a proper start of one of ``markers``:
    the part to hold back because the next piece may complete a marker."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if marker.startswith(text[-n:]):
                best = n
                break
    return best


class _Out:
    __slots__ = ("reasoning", "content")

    def __init__(self) -> None:
        self.reasoning: list[str] = []
        self.content: list[str] = []

    def delta(self) -> ReasoningDelta:
        return ReasoningDelta("".join(self.reasoning), "".join(self.content))


class ThinkParser(ReasoningParser):
    """``<think> reasoning </think> answer``.

    Whole-reply semantics (what any chunking reproduces): a reply that starts inside reasoning
    (``opened``; a ``<think>`` it writes first anyway is dropped), or whose text after leading
    whitespace starts with ``<think>``, has as
    reasoning the text up to the first ``</think>`` (all of it when none comes: the reply ran
    out while thinking), stripped of surrounding whitespace, and as content the rest with its
    leading whitespace dropped. Any other reply is content, verbatim. One block per reply: tags
    after it are the answer's own text (an answer may talk about tags)."""

    __slots__ = ("_state", "_held")
    _PRE, _OPENED, _THINK_START, _THINK, _ANSWER_START, _ANSWER = range(6)

    def __init__(self, opened: bool = False) -> None:
        self._state = self._OPENED if opened else self._PRE
        self._held = ""

    def feed(self, text: str) -> ReasoningDelta:
        out = _Out()
        buf, self._held = self._held + text, ""
        while True:
            if self._state == self._PRE:
                rest = buf.lstrip()
                if rest.startswith(THINK_OPEN):
                    buf, self._state = rest[len(THINK_OPEN):], self._THINK_START
                elif THINK_OPEN.startswith(rest):  # "" or a partial tag: undecided yet
                    self._held = buf
                    break
                else:
                    self._state = self._ANSWER
            elif self._state == self._OPENED:  # inside already; a "<think>" of its own is dropped
                rest = buf.lstrip()
                if rest.startswith(THINK_OPEN):
                    buf, self._state = rest[len(THINK_OPEN):], self._THINK_START
                elif THINK_OPEN.startswith(rest):
                    self._held = buf
                    break
                else:
                    self._state = self._THINK_START
            elif self._state == self._THINK_START:
                buf = buf.lstrip()
                if not buf:
                    break
                self._state = self._THINK
            elif self._state == self._THINK:
                at = buf.find(THINK_CLOSE)
                if at >= 0:
                    out.reasoning.append(buf[:at].rstrip())
                    buf, self._state = buf[at + len(THINK_CLOSE):], self._ANSWER_START
                    continue
                # hold a possible partial </think>, and trailing whitespace, which is dropped if
                # the block ends right after it
                keep = _partial_suffix(buf, (THINK_CLOSE,))
                body = buf[: len(buf) - keep]
                said = body.rstrip()
                out.reasoning.append(said)
                self._held = buf[len(said):]
                break
            elif self._state == self._ANSWER_START:
                buf = buf.lstrip()
                if not buf:
                    break
                self._state = self._ANSWER
            else:
                out.content.append(buf)
                break
        return out.delta()

    def finish(self) -> ReasoningDelta:
        held, self._held = self._held, ""
        if self._state == self._PRE:
            return ReasoningDelta(content=held)
        if self._state == self._OPENED:
            return ReasoningDelta(reasoning=held.strip())
        if self._state == self._THINK:
            return ReasoningDelta(reasoning=held.rstrip())
        return ReasoningDelta()


class HarmonyParser(ReasoningParser):
    """gpt-oss's harmony messages, read from text that keeps the special tokens.

    A reply is a run of messages: a header (``<|start|>`` role, ``<|channel|>`` name, maybe a
    recipient and ``<|constrain|>``) up to ``<|message|>``, then a body up to ``<|end|>``,
    ``<|return|>`` or ``<|call|>`` (or a new ``<|start|>``, or the reply's end). Bodies on the
    ``analysis`` channel are reasoning; every other body (``final``, ``commentary``, a message
    with no channel) is content. Text outside any message (a model that skips the format) is
    content. A header cut off by the reply's end is structure, not text, and is dropped.
    Between messages, and after the role the prompt wrote, a header starts with one of its
    markers (``<|start|>``, ``<|channel|>``, ``<|message|>``, ``<|constrain|>``)."""

    __slots__ = ("_state", "_held", "_to_reasoning")
    _BETWEEN, _HEADER, _BODY = range(3)
    _BODY_ENDS = (*ENDS, START)
    # what a header starts with (the role comes after <|start|>; a prompt may have written it)
    _HEAD_STARTS = (START, CHANNEL, MESSAGE, CONSTRAIN)

    def __init__(self, prompt_tail: str = "") -> None:
        self._state = self._BETWEEN
        self._held = ""
        self._to_reasoning = False
        # The prompt ends inside the assistant's turn: "<|start|>assistant", maybe with a header
        # or a whole message a template wrote after it. Reading what follows the role leaves the
        # parser where the reply begins.
        at = prompt_tail.rfind(START)
        if at >= 0:
            seg = prompt_tail[at + len(START):]
            role_end = min((i for m in self._HEAD_STARTS if (i := seg.find(m)) >= 0), default=len(seg))
            self.feed(seg[role_end:])

    def feed(self, text: str) -> ReasoningDelta:
        out = _Out()
        buf, self._held = self._held + text, ""
        while buf:
            if self._state == self._BETWEEN:
                if buf.startswith(self._HEAD_STARTS):
                    self._state = self._HEADER
                elif any(m.startswith(buf) for m in self._HEAD_STARTS):
                    self._held = buf
                    break
                else:  # text outside the format: the answer
                    self._state, self._to_reasoning = self._BODY, False
            elif self._state == self._HEADER:
                at = buf.find(MESSAGE)
                if 0 <= at < MAX_HEADER_CHARS:
                    self._to_reasoning = _channel(buf[:at]) == "analysis"
                    buf, self._state = buf[at + len(MESSAGE):], self._BODY
                elif at >= 0 or len(buf) >= MAX_HEADER_CHARS + len(MESSAGE):
                    self._state, self._to_reasoning = self._BODY, False  # not a header after all
                    out.content.append(buf[:MAX_HEADER_CHARS])
                    buf = buf[MAX_HEADER_CHARS:]
                else:
                    self._held = buf
                    break
            else:
                side = out.reasoning if self._to_reasoning else out.content
                ends = [(i, m) for m in self._BODY_ENDS if (i := buf.find(m)) >= 0]
                if ends:
                    at, marker = min(ends)
                    side.append(buf[:at])
                    if marker == START:
                        buf, self._state = buf[at:], self._HEADER
                    else:
                        buf, self._state = buf[at + len(marker):], self._BETWEEN
                    continue
                keep = _partial_suffix(buf, self._BODY_ENDS)
                side.append(buf[: len(buf) - keep])
                self._held = buf[len(buf) - keep:]
                break
        return out.delta()

    def finish(self) -> ReasoningDelta:
        held, self._held = self._held, ""
        if self._state == self._BODY:
            return ReasoningDelta(held, "") if self._to_reasoning else ReasoningDelta("", held)
        # a header, or a partial "<|start|>" / "<|channel|>", that the reply ended on: no message
        return ReasoningDelta()


def _channel(header: str) -> str | None:
    """The channel a harmony header names ("analysis", "final", "commentary"), or None."""
    at = header.find(CHANNEL)
    if at < 0:
        return None
    name = header[at + len(CHANNEL):]
    for stop in (" ", "<|"):
        name = name.split(stop, 1)[0]
    return name.strip()


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    """How one model marks its reasoning: ``name`` is vLLM's parser name. ``skip_special_tokens``
    is what the reply must be detokenized with for the markers to reach the parser (False when
    they are special tokens: harmony's always, <think> in a vocabulary that marks it special)."""

    name: str
    skip_special_tokens: bool = True

    def parser(self, prompt_tail: str = "") -> ReasoningParser:
        """A parser for one reply whose prompt ends with ``prompt_tail`` (rendered with its
        special tokens): where the prompt leaves the reply, inside reasoning or not."""
        if self.name == HARMONY_PARSER:
            return HarmonyParser(prompt_tail)
        opened_at, closed_at = prompt_tail.rfind(THINK_OPEN), prompt_tail.rfind(THINK_CLOSE)
        if self.name == "deepseek_r1":
            # R1 was trained to start inside its reasoning, and may leave out the opening tag
            # (older templates do not write one): reasoning until </think> unless the prompt closed it
            return ThinkParser(opened=closed_at <= opened_at)
        return ThinkParser(opened=opened_at > closed_at)


def check_parser_name(name: str) -> str:
    """``name`` if it is a parser this module has (or ``auto``/``none``); else one clear line."""
    if name in (*PARSER_NAMES, NONE, AUTO):
        return name
    raise LocalLLMError(f"unknown reasoning parser {name!r}; use one of {', '.join((AUTO, *PARSER_NAMES, NONE))}")


def select_format(
    chat_template: str | None, architecture: str | None = None, override: str | None = None,
    is_special: frozenset[str] = frozenset(),
) -> ReasoningFormat | None:
    """The reasoning format of a model, or None when its replies hold no reasoning to split.

    ``override`` (``--reasoning-parser``) wins: a parser name, or ``none``. Otherwise a chat
    template that speaks harmony (``<|channel|>`` and ``<|message|>``) or writes ``</think>``
    decides, then the architecture (gpt-oss). ``is_special``: the markers the vocabulary holds
    as special tokens (dropped when detokenizing unless asked to keep them)."""
    name = check_parser_name(override) if override else AUTO
    if name == NONE:
        return None
    if name == AUTO:
        template = chat_template or ""
        arch = (architecture or "").lower().replace("_", "-")
        if CHANNEL in template and MESSAGE in template or arch in ("gpt-oss", "gptossforcausallm"):
            name = HARMONY_PARSER
        elif THINK_CLOSE in template:
            name = "qwen3"
        else:
            return None
    if name == HARMONY_PARSER:
        return ReasoningFormat(name, skip_special_tokens=False)
    return ReasoningFormat(name, skip_special_tokens=not ({THINK_OPEN, THINK_CLOSE} & is_special))


def format_for(tokenizer: Tokenizer, architecture: str | None = None, override: str | None = None,
               ) -> ReasoningFormat | None:
    """``select_format`` for a loaded model's tokenizer."""
    special = frozenset(m for m in (THINK_OPEN, THINK_CLOSE) if tokenizer.is_special_token(m))
    return select_format(tokenizer.chat_template, architecture, override, special)


def prompt_tail(tokenizer: Tokenizer, prompt_ids: Sequence[int]) -> str:
    """The end of a prompt as text with its special tokens, for ``ReasoningFormat.parser``:
    its last ``PROMPT_TAIL_TOKENS``, reaching back to the last harmony ``<|start|>`` where the
    vocabulary has one, since a continued reply's prompt can end deep inside an open message
    (a long analysis) and the parser must read that message's header to know its channel."""
    begin = max(0, len(prompt_ids) - PROMPT_TAIL_TOKENS)
    start_id = tokenizer.special_token_id(START)
    if start_id is not None and start_id not in prompt_ids[begin:]:
        begin = next((i for i in range(begin - 1, -1, -1) if prompt_ids[i] == start_id), begin)
    return tokenizer.decode(prompt_ids[begin:], skip_special_tokens=False)
