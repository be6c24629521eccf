"""gpt-oss's harmony chat format: a conversation rendered as the prompt text the model was
trained on, as OpenAI's ``openai-harmony`` renderer writes it for a completion (what vLLM
sends gpt-oss; the test checks it token for token against that package).

A prompt is a run of messages ``<|start|>{role}<|message|>{text}<|end|>``: first the system
message the renderer writes itself (model identity, knowledge cutoff, today's date, reasoning
effort and the valid channels), then the caller's system or developer text as the developer's
``# Instructions``, the user's turns, and earlier answers as assistant messages on the
``final`` channel; with a generation prompt it ends ``<|start|>assistant``, where the model
writes its header.

Tools (OpenAI's ``tools``) are written as harmony writes them: a TypeScript-like ``namespace
functions`` in the developer message (after the instructions), and a line in the system
message sending calls to the ``commentary`` channel. An assistant's ``tool_calls`` are messages
``<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>ARGS<|call|>`` and a
tool result ``<|start|>functions.NAME to=assistant<|channel|>commentary<|message|>TEXT<|end|>``.
Reasoning (``reasoning_content``) is written back as an ``analysis`` message unless the
conversation's last assistant message is a final answer (openai-harmony drops the analysis
then): a turn still calling tools keeps its chain of thought.

The model's own template (jinja, shipped in the GGUF and the HF folder) renders the same
messages but for two byte runs: a blank line after the developer's instructions, and a tool
result written as a JSON string (``tojson``) where openai-harmony writes its text. Replies are
split into reasoning and answer by ``localllm.reasoning.HarmonyParser``, which keeps a message
addressed to a tool (recipient before or after the channel) out of both; the server reads
those calls into ``tool_calls`` (``localllm.server.tools``).
"""

from __future__ import annotations

import json
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
CALL = "<|call|>"  # ends an assistant message addressed to a tool: the reply stops there
# a function call's recipient ("to=functions.get_weather", before or after the channel;
# localllm.reasoning.read_header reads it)
FUNCTIONS = "functions."


ROLES = ("system", "developer", "user", "assistant", "tool")
TOOLS_CHANNEL = "Calls to these tools must go to the commentary channel: 'functions'."


def renders(messages: Sequence[Mapping[str, Any]]) -> bool:
    """Whether ``render`` takes this conversation: every message has a role harmony has a place
    for (tools and tool turns included)."""
    return all(m.get("role") in ROLES for m in messages)


def _text(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")


def _message(role: str, text: str, channel: str | None = None, end: str = "<|end|>") -> str:
    header = role if channel is None else f"{role}<|channel|>{channel}"
    return f"<|start|>{header}<|message|>{text}{end}"


# ---- tools as harmony's TypeScript namespace ----

_SCALARS = {"string": "string", "number": "number", "integer": "number", "boolean": "boolean", "null": "null"}


def _json(value: object) -> str:
    """JSON as openai-harmony (serde_json) writes it: compact, non-ASCII as is."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _ts_type(schema: object, pad: str, inner: str | None = None) -> str:
    """A JSON schema as the TypeScript type harmony writes, for a property at indent ``pad``
    (an object's fields at ``inner``: four spaces deeper, three for a ``oneOf`` variant).
    What it cannot express (``anyOf``, ``$ref``, an untyped ``enum``, a bare ``null``) is
    ``any``, as openai-harmony writes it; a non-string ``enum`` is its type; ``oneOf`` is a
    union on lines of its own, each variant's description after it."""
    if not isinstance(schema, Mapping):
        return "any"
    if isinstance(schema.get("oneOf"), list):
        variants = [(_ts_type(v, pad, pad + "   "),
                     f" // {v['description']}" if isinstance(v, Mapping) and v.get("description") else "")
                    for v in schema["oneOf"]]
        return "".join(f"\n{pad} | {kind}{note}" for kind, note in variants) + f"\n{pad}"
    kind = schema.get("type")
    if isinstance(kind, list):
        return " | ".join(_SCALARS.get(k, "any") for k in kind)
    if "enum" in schema and kind in (None, "string"):  # only a string enum is spelled out
        values = schema["enum"]
        if kind is None or not isinstance(values, list):
            return "any"
        return " | ".join(_json(v) for v in values)
    if kind == "array":
        return f"{_ts_type(schema['items'], pad, inner)}[]" if "items" in schema else "Array<any>"
    if kind == "object":
        inner = pad + "    " if inner is None else inner
        note = f"{inner}// {schema['description']}\n" if schema.get("description") else ""
        return f"{note}{{\n{_properties(schema, inner)}{inner}}}"
    if kind == "null":
        return "any"
    return _SCALARS.get(kind, "any") if isinstance(kind, str) else "any"


def _properties(schema: Mapping[str, Any], pad: str) -> str:
    """An object's properties, one a line: its description as a comment above, ``?`` when not
    required, its default as a comment after."""
    required = set(schema.get("required") or ())
    lines = []
    for name, prop in (schema.get("properties") or {}).items():
        prop = prop if isinstance(prop, Mapping) else {}
        note = f"{pad}// {prop['description']}\n" if prop.get("description") else ""
        kind = _ts_type(prop, pad)
        head = f"{pad}{name}{'' if name in required else '?'}:"
        line = f"{head}{kind}," if kind.startswith("\n") else f"{head} {kind},"
        if "default" in prop:
            default = prop["default"]
            shown = default if "enum" in prop and isinstance(default, str) else _json(default)
            line += f" // default: {shown}"
        lines.append(f"{note}{line}\n")
    return "".join(lines)


def _signature(params: object) -> str:
    if params is None:
        return "() => any"
    if isinstance(params, Mapping) and params.get("type", "object") == "object":
        note = f"// {params['description']}\n" if params.get("description") else ""
        return f"(_: {note}{{\n{_properties(params, '')}}}) => any"
    return f"(_: {_ts_type(params, '')}) => any"


def tools_section(tools: Sequence[Mapping[str, Any]]) -> str:
    """The developer message's ``# Tools`` section for OpenAI function tools."""
    out = ["# Tools\n\n## functions\n\nnamespace functions {\n\n"]
    for tool in tools:
        fn = tool.get("function", tool)
        if fn.get("description"):
            out.append("".join(f"// {line}\n" for line in str(fn["description"]).split("\n")))
        out.append(f"type {fn['name']} = {_signature(fn.get('parameters'))};\n\n")
    out.append("} // namespace functions")
    return "".join(out)


# ---- the conversation ----

def _arguments(value: object) -> str:
    """A call's arguments as the message body: OpenAI's JSON text as sent; an object (what
    localllm.server.tools parses it into for jinja templates) as compact JSON, the way gpt-oss
    writes its arguments, so the usual echoed call renders as the model wrote it."""
    return value if isinstance(value, str) else _json(value)


def _tool_name(message: Mapping[str, Any], calls: Mapping[str, str]) -> str:
    name = message.get("name") or calls.get(str(message.get("tool_call_id") or ""))
    if not name:
        raise LocalLLMError("a tool message needs the 'tool_call_id' of an earlier assistant tool call "
                            "(or a 'name'): harmony writes which function answered")
    return str(name)


def render(
    messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
    kwargs: Mapping[str, object] | None = None, today: date | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None, continue_final: bool = False,
) -> str:
    """The prompt text of ``messages`` (OpenAI's roles: system, developer, user, assistant,
    tool) with OpenAI's function ``tools``. ``kwargs``: the template variables gpt-oss's
    template reads, ``reasoning_effort`` (low, medium, high; medium by default) and
    ``model_identity``. An assistant message is its reasoning (kept only while no final
    answer ends the conversation's assistant messages), its content on the ``final`` channel
    (``commentary`` when it comes with ``tool_calls``) and its calls; the last one closed by
    ``<|end|>`` too when no generation prompt follows (as openai-harmony's
    ``render_conversation`` writes it). ``continue_final``: the last message is an assistant
    reply cut short, written open (no end token) for the model to go on with: its answer on
    the ``final`` channel, or its reasoning on ``analysis`` when it has no answer yet."""
    kw = dict(kwargs or {})
    effort = str(kw.get("reasoning_effort") or "medium").lower()
    if effort not in EFFORTS:
        raise LocalLLMError(f"reasoning_effort {effort!r} is not one gpt-oss knows; use low, medium or high")
    for m in messages:
        if m.get("role") not in ROLES:
            raise LocalLLMError(f"chat role {m.get('role')!r} has no place in gpt-oss's harmony format "
                                "(system, developer, user, assistant, tool)")
    identity = str(kw.get("model_identity") or MODEL_IDENTITY)
    day = (today or date.today()).isoformat()
    system = (f"{identity}\nKnowledge cutoff: {KNOWLEDGE_CUTOFF}\nCurrent date: {day}\n\n"
              f"Reasoning: {effort}\n\n{CHANNELS}")
    if tools:
        system += f"\n{TOOLS_CHANNEL}"
    parts = [_message("system", system)]
    section = tools_section(tools) if tools else None
    if section is not None and not any(m["role"] in ("system", "developer") for m in messages):
        parts.append(_message("developer", section))
    # openai-harmony drops every analysis message once the last assistant message is a final
    # answer; a reply being continued is the turn in progress, after the prompt it was given
    done = messages[:-1] if continue_final else messages
    last = next((m for m in reversed(done) if m["role"] == "assistant"), None)
    keep_reasoning = last is not None and bool(last.get("tool_calls"))
    calls: dict[str, str] = {}
    for i, m in enumerate(messages):
        role, text = m["role"], _text(m)
        if role in ("system", "developer"):
            body = f"# Instructions\n\n{text}"
            if section is not None:
                body, section = f"{body}\n\n{section}", None
            parts.append(_message("developer", body))
        elif role == "user":
            parts.append(_message("user", text))
        elif role == "tool":
            parts.append(f"<|start|>functions.{_tool_name(m, calls)} to=assistant<|channel|>commentary"
                         f"<|message|>{text}<|end|>")
        else:
            reasoning = m.get("reasoning_content")
            if continue_final and i == len(messages) - 1:
                if text or not reasoning:
                    if reasoning:
                        parts.append(_message("assistant", reasoning, "analysis"))
                    parts.append(_message("assistant", text, "final", end=""))
                else:
                    parts.append(_message("assistant", reasoning, "analysis", end=""))
                return "".join(parts)
            if reasoning and keep_reasoning:
                parts.append(_message("assistant", reasoning, "analysis"))
            tool_calls = m.get("tool_calls") or []
            if not tool_calls:
                parts.append(_message("assistant", text, "final"))
                continue
            if text:  # a preamble the model wrote before its calls
                parts.append(_message("assistant", text, "commentary"))
            for call in tool_calls:
                fn = call["function"]
                calls[str(call.get("id") or "")] = fn["name"]
                parts.append(f"<|start|>assistant to=functions.{fn['name']}<|channel|>commentary json"
                             f"<|message|>{_arguments(fn.get('arguments', '{}'))}<|call|>")
    if add_generation_prompt:
        parts.append("<|start|>assistant")
    return "".join(parts)
