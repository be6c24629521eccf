"""Reasoning kept apart from the answer: a reply's text split into ``reasoning`` and ``content``.

Thinking models write their reasoning into the reply itself, marked by their chat format:

- ``<think> ... </think>`` before the answer (Qwen3, QwQ, DeepSeek-R1 and its distills). Some
  templates open the block in the prompt (DeepSeek-R1's later template, Qwen3's thinking-only
  models), so the reply starts inside the reasoning with no opening tag of its own; Qwen3 with
  ``enable_thinking=False`` writes an empty, closed block into the prompt instead.
- gpt-oss's harmony messages: ``<|channel|>analysis<|message|> ... <|end|>`` is reasoning,
  ``<|start|>assistant<|channel|>final<|message|> ...`` the answer, and a message addressed to a
  tool (``to=functions.NAME`` in its header) neither: ``HarmonyParser.calls``. Its markers are
  special tokens, so the reply must be detokenized with them kept (``ReasoningFormat.skip_special_tokens``).

Which format applies comes from the model (its chat template, else its architecture), as vLLM's
``--reasoning-parser`` picks one, and that flag overrides it with vLLM's names.

Invariant of every ``ReasoningParser``: the deltas of ``feed`` over any split of a reply into
chunks, then ``finish``, join to the same (reasoning, content) as feeding the reply whole: a
marker cut across chunks is held back until it is whole or cannot be one. Nothing is model-
specific beyond the markers; nothing here needs torch or a model.
"""

from __future__ import annotations

import re
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


@dataclass(frozen=True, slots=True)
class HarmonyHeader:
    """One harmony message's header, read up to its ``<|message|>``.

    ``text`` is the header as written, from its first marker (``<|start|>``, ``<|channel|>``,
    ``<|constrain|>``, ``<|message|>``) or, right after a role the prompt wrote, from the
    reply's `` to=``, through ``<|message|>``; empty for text outside any message (a model that
    skips the format). ``role``: the one after ``<|start|>``, or the prompt's when the header
    goes on from it, else None. ``recipient``: the ``to=`` target wherever the header names it
    (before or after the channel: harmony allows both), e.g. ``functions.get_weather``.
    ``content_type``: what else the header says after the role and channel (``json`` from
    ``commentary json`` or ``<|constrain|>json``)."""

    text: str = ""
    role: str | None = None
    channel: str | None = None
    recipient: str | None = None
    content_type: str | None = None

    @property
    def is_call(self) -> bool:
        """Addressed to a tool (``functions.NAME``, a built-in ``browser.search``, ``python``):
        neither reasoning nor answer, whatever its channel. A tool's own reply is addressed
        ``to=assistant``."""
        return self.recipient is not None and self.recipient != "assistant"

    @property
    def is_reasoning(self) -> bool:
        """An ``analysis`` body that calls nothing: the chain of thought."""
        return self.channel == "analysis" and not self.is_call

    def opening(self) -> str:
        """The header as the start of a whole message: ``<|start|>ROLE`` put back in front
        when the reply's header went on from the role its prompt wrote."""
        if self.text.startswith(START) or self.role is None:
            return self.text
        return f"{START}{self.role}{self.text}"


OUTSIDE = HarmonyHeader()  # the "header" of text outside any message


@dataclass(frozen=True, slots=True)
class HarmonyPiece:
    """A piece of one message's body, with that message's header. ``first``: the first piece
    of the message this parser hands out (its header is whole; the text may be empty). ``end``
    is set on the message's last piece: the marker that closed it (``<|end|>``,
    ``<|return|>``, ``<|call|>``; ``<|start|>`` when the next message began without one;
    ``""`` when the reply ended inside it); None while it goes on."""

    header: HarmonyHeader
    text: str = ""
    first: bool = False
    end: str | None = None


@dataclass(frozen=True, slots=True)
class HarmonyCall:
    """A message the reply addressed to a tool: its recipient (``functions.get_weather``), its
    body as written (JSON arguments for a function) and its header's content type."""

    recipient: str
    arguments: str
    content_type: str | None = None


_ROLE = re.compile(r"[^\s<]*")  # a role (or channel name) runs to a space or the next marker
# after the role the prompt wrote, the reply may go on with the recipient:
# "<|start|>assistant" + " to=functions.get_weather<|channel|>commentary json<|message|>..."
RECIPIENT_LEAD = " to="


def read_header(text: str, role: str | None = None) -> HarmonyHeader:
    """The fields of a header written as ``text`` (through ``<|message|>``); ``role``: the
    one the prompt wrote when the header goes on from it (a ``<|start|>`` in ``text`` names its own)."""
    rest = text[: -len(MESSAGE)] if text.endswith(MESSAGE) else text
    if rest.startswith(START):
        role = _word(rest, len(START))
        rest = rest[len(START) + len(role):]
    channel = None
    at = rest.find(CHANNEL)
    if at >= 0:
        channel = _word(rest, at + len(CHANNEL))
        rest = f"{rest[:at]} {rest[at + len(CHANNEL) + len(channel):]}"
    words = rest.replace(CONSTRAIN, " ").split()
    recipient = next((w[len("to="):] for w in words if w.startswith("to=")), None)
    kind = " ".join(w for w in words if not w.startswith("to="))
    return HarmonyHeader(text, role or None, channel or None, recipient or None, kind or None)


def _word(text: str, at: int) -> str:
    m = _ROLE.match(text, at)
    return m.group() if m else ""


class HarmonyParser(ReasoningParser):
    """gpt-oss's harmony messages, read from text that keeps the special tokens.

    A reply is a run of messages: a header (``<|start|>`` role, ``<|channel|>`` name, maybe a
    recipient and ``<|constrain|>``) up to ``<|message|>``, then a body up to ``<|end|>``,
    ``<|return|>`` or ``<|call|>`` (or a new ``<|start|>``, or the reply's end). Text outside
    any message (a model that skips the format) is a message of its own with an empty header
    (``OUTSIDE``). A header cut off by the reply's end is structure, not text, and is dropped;
    one that runs past ``MAX_HEADER_CHARS`` without ``<|message|>`` was no header, and is
    text outside. Between messages a header starts with one of its markers (``<|start|>``,
    ``<|channel|>``, ``<|message|>``, ``<|constrain|>``); right after the role the prompt
    wrote, also with the recipient (`` to=``).

    Two readings of the same stream: ``messages``/``finish_messages`` hand out each message's
    body in pieces with its header (``HarmonyPiece``); ``feed``/``finish`` fold them into
    reasoning (``analysis`` bodies) and content (every other body, and text outside), while a
    message addressed to a tool (``HarmonyHeader.is_call``) goes to neither: it is read into
    ``calls``. Invariant of both: over any split of a reply into chunks, the pieces of each
    message join to the same body with the same header and end, and so the deltas and
    ``calls`` are those of the reply fed whole. Use one reading per parser."""

    __slots__ = ("_state", "_held", "_role", "_head_role", "_header", "_shown", "_calls")
    _BETWEEN, _AFTER_ROLE, _HEADER, _BODY = range(4)
    _BODY_ENDS = (*ENDS, START)
    # what a header starts with (the role comes after <|start|>; a prompt may have written it)
    _HEAD_STARTS = (START, CHANNEL, MESSAGE, CONSTRAIN)

    def __init__(self, prompt_tail: str = "") -> None:
        self._state = self._BETWEEN
        self._held = ""
        self._role: str | None = None  # the role the prompt wrote for the reply
        self._head_role: str | None = None  # the role of the header being read, when not its own
        self._header = OUTSIDE  # the message whose body is being read
        self._shown = False  # whether a piece of that message has been handed out
        self._calls: list[tuple[HarmonyHeader, list[str]]] = []
        # The prompt ends inside the assistant's turn: "<|start|>assistant", maybe with a header
        # or a whole message a template wrote after it. Reading what follows the role leaves the
        # parser where the reply begins.
        at = prompt_tail.rfind(START)
        if at >= 0:
            seg = prompt_tail[at + len(START):]
            role = _word(seg, 0)
            self._role, self._state = role or None, self._AFTER_ROLE
            self._read(seg[len(role):], [])  # the prompt's own text: nobody's delta
            self._shown = False

    # ---- the messages, piece by piece ----

    def messages(self, text: str) -> list[HarmonyPiece]:
        """The pieces of message bodies that ``text``, the reply's next chunk, completes
        (a marker cut across chunks is held back until it is whole or cannot be one)."""
        out: list[HarmonyPiece] = []
        self._read(text, out)
        return out

    def finish_messages(self) -> list[HarmonyPiece]:
        """The reply's end: the last message's last piece (``end=""``), with what was held back."""
        out: list[HarmonyPiece] = []
        held, self._held = self._held, ""
        if self._state == self._AFTER_ROLE and held and RECIPIENT_LEAD.startswith(held):
            self._open(OUTSIDE)  # " to" that never became a recipient: text
        if self._state == self._BODY:
            self._emit(out, held, "")
        # otherwise a header, or a partial "<|start|>" / "<|channel|>", that the reply ended on: no message
        self._state = self._BETWEEN
        return out

    def _open(self, header: HarmonyHeader) -> None:
        self._header, self._shown, self._state = header, False, self._BODY

    def _emit(self, out: list[HarmonyPiece], text: str, end: str | None = None) -> None:
        if text or end is not None or not self._shown:
            out.append(HarmonyPiece(self._header, text, not self._shown, end))
            self._shown = True

    def _read(self, text: str, out: list[HarmonyPiece]) -> None:
        buf, self._held = self._held + text, ""
        while buf:
            if self._state in (self._BETWEEN, self._AFTER_ROLE):
                starts = self._HEAD_STARTS + ((RECIPIENT_LEAD,) if self._state == self._AFTER_ROLE else ())
                if buf.startswith(starts):
                    self._head_role = self._role if self._state == self._AFTER_ROLE else None
                    self._state = self._HEADER
                elif any(m.startswith(buf) for m in starts):
                    self._held = buf
                    break
                else:  # text outside the format
                    self._open(OUTSIDE)
            elif self._state == self._HEADER:
                at = buf.find(MESSAGE)
                if 0 <= at < MAX_HEADER_CHARS:
                    end = at + len(MESSAGE)
                    self._open(read_header(buf[:end], self._head_role))
                    self._emit(out, "")  # the header is whole: a reader may act on it now
                    buf = buf[end:]
                elif at >= 0 or len(buf) >= MAX_HEADER_CHARS + len(MESSAGE):
                    self._open(OUTSIDE)  # not a header after all
                    self._emit(out, buf[:MAX_HEADER_CHARS])
                    buf = buf[MAX_HEADER_CHARS:]
                else:
                    self._held = buf
                    break
            else:
                ends = [(i, m) for m in self._BODY_ENDS if (i := buf.find(m)) >= 0]
                if ends:
                    at, marker = min(ends)
                    self._emit(out, buf[:at], marker)
                    if marker == START:  # the next header begins with it
                        buf, self._state, self._head_role = buf[at:], self._HEADER, None
                    else:
                        buf, self._state = buf[at + len(marker):], self._BETWEEN
                    continue
                keep = _partial_suffix(buf, self._BODY_ENDS)
                self._emit(out, buf[: len(buf) - keep])
                self._held = buf[len(buf) - keep:]
                break

    # ---- reasoning, answer and calls ----

    @property
    def calls(self) -> list[HarmonyCall]:
        """The messages read so far that were addressed to a tool, in order (the last one's
        arguments may still be growing)."""
        return [HarmonyCall(h.recipient or "", "".join(body), h.content_type) for h, body in self._calls]

    def feed(self, text: str) -> ReasoningDelta:
        return self._fold(self.messages(text))

    def finish(self) -> ReasoningDelta:
        return self._fold(self.finish_messages())

    def _fold(self, pieces: list[HarmonyPiece]) -> ReasoningDelta:
        out = _Out()
        for p in pieces:
            if p.header.is_call:
                if p.first:
                    self._calls.append((p.header, []))
                self._calls[-1][1].append(p.text)
            else:
                (out.reasoning if p.header.is_reasoning else out.content).append(p.text)
        return out.delta()


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
