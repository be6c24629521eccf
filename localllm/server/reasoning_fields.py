"""A chat reply's reasoning kept apart from its answer, in the fields vLLM and llama-server use:
``reasoning_content`` beside ``content`` in the message and in each stream delta.

Which format the model's replies use is fixed when the app is made (``ServerState.reasoning``,
from the model or ``--reasoning-parser``); each reply gets its own parser, started where its
prompt leaves it (a template may open the reasoning block in the prompt). ``content`` then
holds only the answer, and tool calls are read from it alone. Token counts are the model's,
whatever side a token's text went to.

A harmony (gpt-oss) reply's tool calls are messages of their own (``to=functions.NAME`` in
the header, before or after the channel); ``HarmonyCallsKept`` leaves each in ``content`` as
one harmony message, header, arguments and ``<|call|>``, the way a Hermes model's
``<tool_call>`` block stays in its answer, for ``localllm.server.tools`` to read into
``tool_calls`` (a call to no function, or one with no tools asked for, is shown as written).
"""

from __future__ import annotations

from localllm.harmony import CALL
from localllm.reasoning import (
    HARMONY_PARSER,
    HarmonyParser,
    HarmonyPiece,
    ReasoningDelta,
    ReasoningFormat,
    ReasoningParser,
    prompt_tail,
)
from localllm.server.admission import ServerState


class HarmonyCallsKept(ReasoningParser):
    """``HarmonyParser``'s split (analysis bodies are reasoning, other bodies the answer), but
    a message addressed to a tool goes to ``content`` whole: its header as a message's start
    (``<|start|>assistant`` put back when the reply's header went on from the prompt's, as in
    ``" to=functions.f<|channel|>..."``), its body, and ``<|call|>`` (also when the reply ends
    inside it: the stop token is not text). Recipient before or after the channel alike.

    Everything here is read off ``HarmonyParser.messages``: message boundaries, headers and
    recipients are HarmonyParser's own, never a second reading of the format."""

    __slots__ = ("_inner",)

    def __init__(self, tail: str = "") -> None:
        self._inner = HarmonyParser(tail)

    def feed(self, text: str) -> ReasoningDelta:
        return _kept(self._inner.messages(text))

    def finish(self) -> ReasoningDelta:
        return _kept(self._inner.finish_messages())


def _kept(pieces: list[HarmonyPiece]) -> ReasoningDelta:
    reasoning: list[str] = []
    content: list[str] = []
    for p in pieces:
        if p.header.is_call:
            content += [p.header.opening() if p.first else "", p.text, CALL if p.end is not None else ""]
        else:
            (reasoning if p.header.is_reasoning else content).append(p.text)
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
