"""A chat reply's reasoning kept apart from its answer, in the fields vLLM and llama-server use:
``reasoning_content`` beside ``content`` in the message and in each stream delta.

Which format the model's replies use is fixed when the app is made (``ServerState.reasoning``,
from the model or ``--reasoning-parser``); each reply gets its own parser, started where its
prompt leaves it (a template may open the reasoning block in the prompt). ``content`` then
holds only the answer, and tool calls are read from it alone. Token counts are the model's,
whatever side a token's text went to.

A harmony (gpt-oss) reply's tool calls are messages of their own (``to=functions.NAME`` in
the header); ``HarmonyCallsKept`` leaves each in ``content`` as harmony text, header, arguments
and ``<|call|>``, the way a Hermes model's ``<tool_call>`` block stays in its answer, for
``localllm.server.tools`` to read (or, with no tools asked for, to show as written).
"""

from __future__ import annotations

from localllm.harmony import CALL, RECIPIENT
from localllm.reasoning import (
    HARMONY_PARSER,
    START,
    HarmonyParser,
    ReasoningDelta,
    ReasoningFormat,
    ReasoningParser,
    prompt_tail,
)
from localllm.server.admission import ServerState

_RECIPIENT_LEAD = " to="  # the reply's header going on after the prompt's "<|start|>assistant"


class HarmonyCallsKept(ReasoningParser):
    """``HarmonyParser``'s split (analysis bodies are reasoning, other bodies the answer), but
    a message addressed to a function goes to ``content`` whole: its header as written, its
    body, and ``<|call|>`` (also when the reply ends inside it: the stop token is not text).

    The inner parser is fed one character at a time and its state read after each: where it
    enters and leaves a message body is where a call's header ends and its body does, so the
    message boundaries are HarmonyParser's own, never a second reading of the format."""

    __slots__ = ("_inner", "_header", "_call", "_lead")

    def __init__(self, tail: str = "") -> None:
        self._inner = HarmonyParser(tail)
        self._header = ""  # the header read so far (text fed while the inner parser was outside a body)
        self._call = False  # inside a function call's body
        at = tail.rfind(START)
        # the prompt ends on the role: the model may go on with " to=functions.NAME<|channel|>..."
        self._lead: str | None = "" if at >= 0 and tail[at:] == f"{START}assistant" else None

    def feed(self, text: str) -> ReasoningDelta:
        if self._lead is not None:
            self._lead += text
            if _RECIPIENT_LEAD.startswith(self._lead):
                return ReasoningDelta()  # undecided yet
            text, self._lead = self._lead, None
            if text.startswith(_RECIPIENT_LEAD):  # HarmonyParser reads a header from its <|start|>
                text = f"{START}assistant{text}"
        reasoning: list[str] = []
        content: list[str] = []
        for ch in text:
            self._step(ch, reasoning, content)
        return ReasoningDelta("".join(reasoning), "".join(content))

    def _step(self, ch: str, reasoning: list[str], content: list[str]) -> None:
        inner = self._inner
        body = HarmonyParser._BODY
        before = inner._state
        d = inner.feed(ch)
        after = inner._state
        if before != body:
            self._header += ch
            if after == body:  # a header ended (or text outside any message began)
                header, self._header = self._header, ""
                self._call = RECIPIENT.search(header) is not None
                if self._call:
                    content.append(header)
        if self._call:
            content.append(d.reasoning + d.content)
        else:
            reasoning.append(d.reasoning)
            content.append(d.content)
        if before == body and after != body:  # the body ended; a <|start|> begins the next header
            self._header = START if after == HarmonyParser._HEADER else ""
            if self._call:
                content.append(CALL)
                self._call = False

    def finish(self) -> ReasoningDelta:
        reasoning: list[str] = []
        content: list[str] = []
        if self._lead is not None:  # a reply that ended while it could still be " to="
            text, self._lead = self._lead, None
            for ch in text:
                self._step(ch, reasoning, content)
        d = self._inner.finish()
        if self._call:
            content += [d.reasoning + d.content, CALL]
            self._call = False
        else:
            reasoning.append(d.reasoning)
            content.append(d.content)
        return ReasoningDelta("".join(reasoning), "".join(content))


def _parser(fmt: ReasoningFormat, tail: str) -> ReasoningParser:
    return HarmonyCallsKept(tail) if fmt.name == HARMONY_PARSER else fmt.parser(tail)


def reply_parsers(state: ServerState, prompt: list[int], n: int) -> list[ReasoningParser] | None:
    """One parser per choice of a chat request, or None when the model's replies hold no reasoning."""
    fmt = state.reasoning
    if fmt is None:
        return None
    tail = prompt_tail(state.engine.tokenizer, prompt)
    return [_parser(fmt, tail) for _ in range(n)]


def split_reply(state: ServerState, prompt: list[int], text: str) -> tuple[str | None, str]:
    """A whole reply as (reasoning or None when there is none, answer)."""
    parsers = reply_parsers(state, prompt, 1)
    if parsers is None:
        return None, text
    reasoning, content = parsers[0].split(text)
    return reasoning or None, content


def needs_special_tokens(fmt: ReasoningFormat | None) -> bool:
    """Whether replies must be detokenized with special tokens kept for the markers to show."""
    return fmt is not None and not fmt.skip_special_tokens
