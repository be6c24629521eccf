"""gpt-oss's harmony chat format: a conversation rendered as the prompt text the model was
trained on, as OpenAI's ``openai-harmony`` renderer writes it for a completion (what vLLM
sends gpt-oss; the test checks it token for token against that package).

A prompt is a run of messages ``<|start|>{role}<|message|>{text}<|end|>``: first the system
message the renderer writes itself (model identity, knowledge cutoff, today's date, reasoning
effort and the valid channels), then the caller's system or developer text as the developer's
``# Instructions``, the user's turns, and earlier answers as assistant messages on the
``final`` channel; with a generation prompt it ends ``<|start|>assistant``, where the model
writes its header. Earlier turns' reasoning is never written back (the ``analysis`` channel is
dropped once a final answer follows it, which in a chat it always has).

The model's own template (jinja, shipped in the GGUF and the HF folder) renders the same
messages but for one byte run: it ends the developer's instructions with a blank line that
openai-harmony does not write. Tool definitions and tool calls are rendered by that template
(``renders`` says which conversations this module takes); replies are split into reasoning
and answer by ``localllm.reasoning.HarmonyParser``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import date
from typing import Any

from localllm.errors import LocalLLMError

MODEL_IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
KNOWLEDGE_CUTOFF = "2024-06"
EFFORTS = ("low", "medium", "high")
CHANNELS = "# Valid channels: analysis, commentary, final. Channel must be included for every message."
# the tokens harmony is written with; a vocabulary that holds them all speaks it
TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>")


def renders(messages: Sequence[Mapping[str, Any]], tools: object) -> bool:
    """Whether ``render`` takes this conversation: no tools and no tool turns (the model's
    template writes those)."""
    return not tools and all(m.get("role") != "tool" and not m.get("tool_calls") for m in messages)


def _text(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")


def _message(role: str, text: str, channel: str | None = None) -> str:
    header = role if channel is None else f"{role}<|channel|>{channel}"
    return f"<|start|>{header}<|message|>{text}<|end|>"


def render(
    messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
    kwargs: Mapping[str, object] | None = None, today: date | None = None,
) -> str:
    """The prompt text of ``messages`` (OpenAI's roles: system, developer, user, assistant).
    ``kwargs``: the template variables gpt-oss's template reads, ``reasoning_effort`` (low,
    medium, high; medium by default) and ``model_identity``. An assistant message is its
    answer (``content``) alone, also the last one when no generation prompt follows (as
    openai-harmony's ``render_conversation`` writes it, closed by ``<|end|>``)."""
    kw = dict(kwargs or {})
    effort = str(kw.get("reasoning_effort") or "medium").lower()
    if effort not in EFFORTS:
        raise LocalLLMError(f"reasoning_effort {effort!r} is not one gpt-oss knows; use low, medium or high")
    identity = str(kw.get("model_identity") or MODEL_IDENTITY)
    day = (today or date.today()).isoformat()
    system = (f"{identity}\nKnowledge cutoff: {KNOWLEDGE_CUTOFF}\nCurrent date: {day}\n\n"
              f"Reasoning: {effort}\n\n{CHANNELS}")
    parts = [_message("system", system)]
    for m in messages:
        role, text = m.get("role"), _text(m)
        if role in ("system", "developer"):
            parts.append(_message("developer", f"# Instructions\n\n{text}"))
        elif role == "user":
            parts.append(_message("user", text))
        elif role == "assistant":  # its reasoning is dropped: a final answer follows it
            parts.append(_message("assistant", text, "final"))
        else:
            raise LocalLLMError(f"chat role {role!r} has no place in gpt-oss's harmony format "
                                "(system, developer, user, assistant)")
    if add_generation_prompt:
        parts.append("<|start|>assistant")
    return "".join(parts)
