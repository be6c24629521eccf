"""A chat reply's reasoning kept apart from its answer, in the fields vLLM and llama-server use:
``reasoning_content`` beside ``content`` in the message and in each stream delta.

Which format the model's replies use is fixed when the app is made (``ServerState.reasoning``,
from the model or ``--reasoning-parser``); each reply gets its own parser, started where its
prompt leaves it (a template may open the reasoning block in the prompt). ``content`` then
holds only the answer, and tool calls are read from it alone. Token counts are the model's,
whatever side a token's text went to.
"""

from __future__ import annotations

from localllm.reasoning import ReasoningFormat, ReasoningParser, prompt_tail
from localllm.server.admission import ServerState


def reply_parsers(state: ServerState, prompt: list[int], n: int) -> list[ReasoningParser] | None:
    """One parser per choice of a chat request, or None when the model's replies hold no reasoning."""
    fmt = state.reasoning
    if fmt is None:
        return None
    tail = prompt_tail(state.engine.tokenizer, prompt)
    return [fmt.parser(tail) for _ in range(n)]


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
