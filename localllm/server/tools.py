"""Tool calls on ``/v1/chat/completions``: OpenAI's ``tools``, ``tool_choice`` and
``parallel_tool_calls`` in, the model's own tool-call syntax back out as ``tool_calls``.

The tools go to the model's chat template as HF passes them (a ``tools`` variable), so the
model sees them the way it was trained to. What it writes back depends on its family; the
template tells which (``tool_format``):

- Hermes style (Qwen2.5, Qwen3, Hermes): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
  one block per call;
- Llama 3.1/3.2 JSON: the reply is ``{"name": ..., "parameters": {...}}``, calls joined by ``;``;
- gpt-oss (harmony): a message ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>``
  per call, which ``localllm.harmony`` renders with the tools (no jinja template involved) and
  ``HarmonyCallParser`` reads from what ``server.reasoning_fields`` leaves in the answer.

``tool_choice: "auto"`` generates freely and parses; ``"required"`` or a named function
constrains decoding with a grammar (``call_grammar``) that writes exactly that syntax with each
function's parameters schema embedded, so the arguments always parse. ``ToolCallParser``
reads the reply incrementally, so the same code gives the whole message and the stream
(a delta with ``id`` and ``function.name``, then ``arguments`` fragments).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from localllm import harmony
from localllm.engine.guided import JSON_DEFAULTS
from localllm.reasoning import CHANNEL, MESSAGE, START, read_header
from localllm.server.protocol import APIError, _invalid, _kind

if TYPE_CHECKING:
    from localllm.tokenizer import Tokenizer

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """A family's tool-call syntax. ``start`` opens each call and ``end`` closes it (the
    parser looks for these; a forced call writes ``write_start``/``write_end``, the exact
    form the template uses); with no ``start`` the reply itself is the call (it begins with
    ``{``) and ``separator`` joins calls."""

    name: str
    start: str | None
    end: str | None
    write_start: str
    write_end: str
    args_key: str
    separator: str


HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>", "<tool_call>\n", "\n</tool_call>", "arguments", "\n")
LLAMA3_JSON = ToolFormat("llama3_json", None, None, "", "", "parameters", "; ")
# a call is a harmony message of its own, read by HarmonyCallParser and forced by
# harmony_call_grammar: the fields say only where a call starts and ends
HARMONY = ToolFormat("harmony", START, harmony.CALL, "", harmony.CALL, "arguments", "")


def tool_format(template: str | None) -> ToolFormat | None:
    """The syntax a chat template teaches its model, or None when it is not one we read."""
    if not template:
        return None
    if "<tool_call>" in template:
        return HERMES
    unescaped = template.replace('\\"', '"')  # the quotes may sit inside a double-quoted jinja string
    if '"parameters"' in unescaped and ("<|eot_id|>" in template or "<|python_tag|>" in template):
        return LLAMA3_JSON
    return None


@dataclass(slots=True)
class ToolCalling:
    """What a request's tools mean for this model. ``tools`` go to the template as sent;
    ``grammar`` (Lark) is set when the call is forced."""

    tools: list[dict[str, Any]]
    choice: str  # "auto", "required" or the forced function's name
    parallel: bool
    format: ToolFormat
    grammar: str | None

    def parser(self) -> ToolCallParser:
        if self.format is HARMONY:
            return HarmonyCallParser(self.parallel)
        return ToolCallParser(self.format, self.parallel)


# ---- the request ----

def _tool(i: int, t: Any) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(t, dict):
        raise _invalid(where, f"expected an object, got {_kind(t)}")
    if t.get("type", "function") != "function":
        raise APIError(400, f"'{where}.type': {t.get('type')!r} is not supported (function only)",
                       param=f"{where}.type", code="unsupported")
    fn = t.get("function")
    if not isinstance(fn, dict):
        raise _invalid(f"{where}.function", "required, an object with 'name' and 'parameters'")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise _invalid(f"{where}.function.name", "required: 1 to 64 letters, digits, '_', '.' or '-'")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise _invalid(f"{where}.function.description", f"expected a string, got {_kind(fn['description'])}")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise _invalid(f"{where}.function.parameters", f"expected a JSON schema object, got {_kind(params)}")
    return {"type": "function", "function": {k: v for k, v in fn.items() if v is not None}}


def _choice(value: Any, names: list[str]) -> str:
    if value is None:
        return "auto" if names else "none"
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise _invalid("tool_choice", f"{value!r}: expected 'none', 'auto', 'required' or "
                                          "{'type': 'function', 'function': {'name': ...}}")
        if value == "required" and not names:
            raise APIError(400, "'tool_choice': 'required' needs 'tools'", param="tool_choice", code="invalid_value")
        return value
    fn = value.get("function") if isinstance(value, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise _invalid("tool_choice", "expected a string or {'type': 'function', 'function': {'name': ...}}")
    if name not in names:
        known = ", ".join(names) if names else "none"
        raise APIError(400, f"'tool_choice': function {name!r} is not among the tools (tools: {known})",
                       param="tool_choice", code="invalid_value")
    return name


def parse_tools(body: dict[str, Any], tokenizer: Tokenizer) -> ToolCalling | None:
    """None when the reply is plain text: no tools, or ``tool_choice: "none"`` (the tools are
    then left out of the prompt too, so the model is not tempted)."""
    raw = body.get("tools")
    if raw is not None and not isinstance(raw, list):
        raise _invalid("tools", f"expected an array of tools, got {_kind(raw)}")
    tools = [_tool(i, t) for i, t in enumerate(raw or [])]
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise APIError(400, "'tools': two tools share a name", param="tools", code="invalid_value")
    choice = _choice(body.get("tool_choice"), names)
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise _invalid("parallel_tool_calls", f"expected a boolean, got {_kind(parallel)}")
    if choice == "none":
        return None
    if tokenizer.speaks_harmony:  # localllm.harmony writes the tools; no template needed
        grammar = None
        if choice != "auto":
            forced = [t for t in tools if choice == "required" or t["function"]["name"] == choice]
            grammar = harmony_call_grammar(forced)
        return ToolCalling(tools, choice, parallel, HARMONY, grammar)
    if not tokenizer.supports_tools:
        raise APIError(400, "'tools': this model's chat template has no tool section, so it cannot be told "
                            "about tools; use a model whose template takes them (Qwen2.5, Llama 3.1, ...)",
                       param="tools", code="unsupported")
    fmt = tool_format(tokenizer.chat_template)
    if fmt is None:
        raise APIError(400, "'tools': this model's tool-call syntax is not one localllm reads (Hermes "
                            "<tool_call> blocks or Llama 3.1 JSON)", param="tools", code="unsupported")
    grammar = None
    if choice != "auto":
        forced = [t for t in tools if choice == "required" or t["function"]["name"] == choice]
        grammar = call_grammar(fmt, forced, parallel=parallel and choice == "required")
    return ToolCalling(tools, choice, parallel, fmt, grammar)


def _arguments(value: Any, where: str) -> Any:
    """HF templates print a past call's arguments with ``tojson``: they want the object, not
    OpenAI's JSON string (vLLM converts the same way)."""
    if isinstance(value, dict):
        return value
    if not isinstance(value, str):
        raise _invalid(where, f"expected a JSON string, got {_kind(value)}")
    try:
        return json.loads(value)
    except ValueError:
        return value  # a broken call the model wrote earlier: shown as written


def tool_messages(raw: list[Any], parsed: list[dict[str, Any]]) -> None:
    """Adds to ``parsed`` (``protocol``'s messages, same order) what the template needs of a
    tool conversation: an assistant's ``tool_calls`` and a tool result's ``tool_call_id``."""
    for i, (m, out) in enumerate(zip(raw, parsed)):
        where = f"messages[{i}]"
        if out["role"] == "assistant" and m.get("tool_calls") is not None:
            calls = m["tool_calls"]
            if not isinstance(calls, list):
                raise _invalid(f"{where}.tool_calls", f"expected an array, got {_kind(calls)}")
            rendered = []
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise _invalid(f"{where}.tool_calls[{j}]", "expected {'id', 'type': 'function', "
                                                               "'function': {'name', 'arguments'}}")
                args = _arguments(fn.get("arguments", "{}"), f"{where}.tool_calls[{j}].function.arguments")
                rendered.append({"id": call.get("id"), "type": "function",
                                 "function": {"name": fn["name"], "arguments": args}})
            out["tool_calls"] = rendered
        elif out["role"] == "tool":
            call_id = m.get("tool_call_id")
            if call_id is not None and not isinstance(call_id, str):
                raise _invalid(f"{where}.tool_call_id", f"expected a string, got {_kind(call_id)}")
            out["tool_call_id"] = call_id or ""
            if isinstance(m.get("name"), str):
                out["name"] = m["name"]


# ---- forcing a call ----

def _call_schema(fmt: ToolFormat, tool: dict[str, Any]) -> dict[str, Any]:
    fn = tool["function"]
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, fmt.args_key: params},
            "required": ["name", fmt.args_key], "additionalProperties": False, "x-guidance": JSON_DEFAULTS}


def call_grammar(fmt: ToolFormat, tools: list[dict[str, Any]], parallel: bool) -> str:
    """Lark (llguidance's dialect) for one call of one of ``tools``, or several when
    ``parallel``, written in ``fmt``'s syntax with each function's parameters schema."""
    lines = [f"fn_{i}: %json {json.dumps(_call_schema(fmt, t))}" for i, t in enumerate(tools)]
    body = " | ".join(f"fn_{i}" for i in range(len(tools)))
    if fmt.write_start or fmt.write_end:
        body = f"{json.dumps(fmt.write_start)} ({body}) {json.dumps(fmt.write_end)}"
    rest = f' ({json.dumps(fmt.separator)} call)*' if parallel else ""
    return "\n".join([f"start: call{rest}", f"call: {body}", *lines]) + "\n"


def harmony_call_grammar(tools: list[dict[str, Any]]) -> str:
    """Lark for a gpt-oss reply that calls one of ``tools``: its reasoning first if the model
    writes any (an ``analysis`` message), then the call's message with the function's
    parameters schema. One call, whatever ``parallel_tool_calls`` says: ``<|call|>`` ends the
    reply, and the model calls again once it has the result. Harmony's markers are special
    tokens, which llguidance's Lark names bare (``<|call|>``)."""
    lines = ["start: thought? call",
             'thought: <|channel|> "analysis" <|message|> /(?s:.*)/ <|end|> <|start|> "assistant"',
             "call: " + " | ".join(f"c_{i}" for i in range(len(tools)))]
    for i, t in enumerate(tools):
        fn = t["function"]
        params = {**(fn.get("parameters") or {"type": "object", "properties": {}}), "x-guidance": JSON_DEFAULTS}
        header = json.dumps(f"commentary to=functions.{fn['name']} ")
        lines += [f'c_{i}: <|channel|> {header} <|constrain|> "json" <|message|> fn_{i} <|call|>',
                  f"fn_{i}: %json {json.dumps(params)}"]
    return "\n".join(lines) + "\n"


# ---- reading the reply ----

_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str = ""  # the JSON text the model wrote, as OpenAI sends it

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(slots=True)
class ParsedDelta:
    """What one piece of reply text added: content, and per call index its start (the call's
    id and name arrive once) and argument text."""

    content: str = ""
    calls: dict[int, dict[str, Any]] = field(default_factory=dict)

    def call(self, index: int) -> dict[str, Any]:
        return self.calls.setdefault(index, {"index": index})

    def to_openai(self) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if self.content:
            delta["content"] = self.content
        if self.calls:
            delta["tool_calls"] = [
                {"index": c["index"], **({"id": c["id"], "type": "function"} if "id" in c else {}),
                 "function": {**({"name": c["name"]} if "name" in c else {}), "arguments": c.get("arguments", "")}}
                for c in self.calls.values()
            ]
        return delta


class ToolCallParser:
    """Reads a reply as it streams. Invariant: content deltas concatenated plus the calls'
    text reproduce the reply (blank text between calls aside), and a call's argument
    fragments concatenated are its whole ``arguments``, so a stream and a whole message agree.

    States: ``text`` (content, watching for a call to open), ``plain`` (content to the end:
    a Llama reply that did not begin as a call), ``head`` (buffering up to the function's
    name), ``args`` (streaming the arguments value, tracking JSON nesting to see where it
    ends), ``after`` (skipping to the call's close), ``done`` (the one call allowed is in)."""

    def __init__(self, fmt: ToolFormat, parallel: bool = True) -> None:
        self.fmt = fmt
        self.parallel = parallel
        self.calls: list[ToolCall] = []
        self.content = ""
        self._buf = ""
        self._state = "text"
        self._at_start = True  # Llama JSON: only a reply that begins with "{" is a call
        self._depth = 0
        self._in_str = False
        self._esc = False

    def feed(self, text: str) -> ParsedDelta:
        self._buf += text
        out = ParsedDelta()
        while self._step(out, final=False):
            pass
        self.content += out.content
        return out

    def read(self, text: str, finished: bool) -> ParsedDelta:
        """``feed``, then ``finish`` when the reply has ended, as one delta."""
        out = self.feed(text)
        if finished:
            tail = self.finish()
            out.content += tail.content
            for index, part in tail.calls.items():
                call = out.call(index)
                call.update({k: v for k, v in part.items() if k != "arguments"})
                call["arguments"] = call.get("arguments", "") + part.get("arguments", "")
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        while self._step(out, final=True):
            pass
        if self._state == "head" and self._buf.strip():  # a call cut short, or not a call at all
            self._fallback(out)
        elif self._state == "text" and self._buf:
            out.content += self._buf
        self._buf = ""
        self.content += out.content
        return out

    # one transition; False when it needs more text
    def _step(self, out: ParsedDelta, final: bool) -> bool:
        fmt, buf = self.fmt, self._buf
        if self._state == "done":
            self._buf = ""
            return False
        if self._state == "text":
            if fmt.start is None:
                stripped = buf.lstrip()
                if not stripped:
                    return False
                if self._at_start and stripped[0] == "{" or not self._at_start and stripped[0] in "{;":
                    self._buf = stripped.lstrip(";")
                    self._state = "head"
                    return True
                self._state = "plain"
                return True
            at = buf.find(fmt.start)
            if at == -1:
                keep = 0 if final else _partial_suffix(buf, fmt.start)
                emit = buf[: len(buf) - keep]
                if self.calls and not emit.strip():  # blank text between or after calls is no content
                    if final:
                        self._buf = ""
                    return False
                out.content += emit
                self._buf = buf[len(buf) - keep :]
                return False
            if not (self.calls and not buf[:at].strip()):
                out.content += buf[:at]
            self._buf = buf[at + len(fmt.start) :]
            self._state = "head"
            return True
        if self._state == "plain":
            out.content += buf
            self._buf = ""
            return False
        if self._state == "head":
            m = _HEAD.match(buf)
            if m is None:
                closed = fmt.end is not None and fmt.end in buf
                if closed or (fmt.start is None and final):
                    self._fallback(out)
                    return True
                return False
            try:
                name = json.loads(f'"{m.group(1)}"')
            except ValueError:  # a broken escape in the name: let the whole-call path judge it
                self._fallback(out)
                return True
            self._start_call(out, name)
            self._buf = buf[m.end() :]
            self._state = "args"
            self._depth, self._in_str, self._esc = 0, False, False
            return True
        if self._state == "args":
            if not self.calls[-1].arguments:  # blanks before the value are no part of it
                buf = buf.lstrip()
                if not buf:
                    self._buf = ""
                    return False
            end = self._scan(buf)
            piece = buf if end is None else buf[:end]
            if piece:
                self.calls[-1].arguments += piece
                call = out.call(len(self.calls) - 1)
                call["arguments"] = call.get("arguments", "") + piece
            if end is None:
                self._buf = ""
                return False
            self._buf = buf[end:]
            self._state = "after"
            return True
        # after: skip the rest of this call
        if fmt.end is not None:
            at = buf.find(fmt.end)
            if at == -1:
                return False
            self._buf = buf[at + len(fmt.end) :]
        else:
            closing = buf.lstrip()
            if not closing:
                return False
            self._buf = closing[1:] if closing[0] == "}" else closing
        self._at_start = False
        self._state = "text" if self.parallel else "done"
        return True

    def _scan(self, buf: str) -> int | None:
        """Index just past the end of the arguments value, or None if it is still open. An
        object or array ends at its closing bracket; a bare value (a model's mistake) where
        the enclosing object goes on or closes."""
        for i, ch in enumerate(buf):
            if self._in_str:
                if self._esc:
                    self._esc = False
                elif ch == "\\":
                    self._esc = True
                elif ch == '"':
                    self._in_str = False
                    if self._depth == 0:
                        return i + 1
            elif ch == '"':
                self._in_str = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                if self._depth == 0:
                    return i
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
            elif self._depth == 0 and ch in ",\n":
                return i
        return None

    def _start_call(self, out: ParsedDelta, name: str) -> None:
        call = ToolCall(f"call_{uuid.uuid4().hex[:24]}", name)
        self.calls.append(call)
        out.call(len(self.calls) - 1).update(id=call.id, name=name)

    def _fallback(self, out: ParsedDelta) -> None:
        """A call whose head the streaming path did not recognise (keys in another order, a
        bare value): parsed whole once closed; text that is no call becomes content."""
        fmt, buf = self.fmt, self._buf
        body = buf[: buf.find(fmt.end)] if fmt.end is not None and fmt.end in buf else buf
        rest = buf[len(body) + len(fmt.end or ""):] if fmt.end is not None and fmt.end in buf else ""
        try:
            obj, _ = json.JSONDecoder().raw_decode(body.strip())
        except ValueError:
            obj = None
        if isinstance(obj, dict) and isinstance(obj.get("name"), str):
            args = obj.get(fmt.args_key, obj.get("arguments", obj.get("parameters", {})))
            self._start_call(out, obj["name"])
            text = json.dumps(args, ensure_ascii=False)
            self.calls[-1].arguments = text
            out.call(len(self.calls) - 1)["arguments"] = text
            self._buf = rest
            self._at_start = False
            self._state = "text" if self.parallel else "done"
        else:
            out.content += (fmt.start or "") + buf
            self._buf = ""
            self._state = "plain"


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that could be the start of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class HarmonyCallParser(ToolCallParser):
    """A gpt-oss reply's calls, read from the answer as ``server.reasoning_fields`` leaves it:
    answer text, and per call its harmony header (``<|start|>`` or ``<|channel|>`` up to
    ``<|message|>``, naming ``to=functions.NAME``), its JSON arguments and ``<|call|>``. The
    same invariant as ``ToolCallParser``: content deltas are the answer, a call's argument
    fragments join to its whole ``arguments``. A header that names no function is shown as
    written; arguments cut off by the reply's end stay the call's (the finish reason says
    ``length``)."""

    _HEADS = (START, CHANNEL)

    def __init__(self, parallel: bool = True) -> None:
        super().__init__(HARMONY, parallel)

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        while self._step(out, final=True):
            pass
        if self._state == "args" and self._buf:  # a partial "<|call|>" that never completed is argument text
            self._add_arguments(out, self._buf)
        elif self._state in ("text", "head") and self._buf:
            out.content += self._buf
        self._buf = ""
        self.content += out.content
        return out

    def _add_arguments(self, out: ParsedDelta, piece: str) -> None:
        self.calls[-1].arguments += piece
        call = out.call(len(self.calls) - 1)
        call["arguments"] = call.get("arguments", "") + piece

    def _step(self, out: ParsedDelta, final: bool) -> bool:
        buf = self._buf
        if self._state == "done":
            self._buf = ""
            return False
        if self._state == "text":
            at = min((i for m in self._HEADS if (i := buf.find(m)) >= 0), default=-1)
            if at < 0:  # hold what may be the start of a header
                keep = 0 if final else max(_partial_suffix(buf, m) for m in self._HEADS)
                emit, self._buf = buf[: len(buf) - keep], buf[len(buf) - keep:]
            else:
                emit, self._buf = buf[:at], buf[at:]
            if not (self.calls and not emit.strip()):  # blank text between or after calls is no content
                out.content += emit
            if at < 0:
                return False
            self._state = "head"
            return True
        if self._state == "head":
            at = buf.find(MESSAGE)
            if at < 0:
                return False
            end = at + len(MESSAGE)
            recipient = read_header(buf[:end]).recipient or ""
            if not recipient.startswith(harmony.FUNCTIONS):  # a message to no function: its text as written
                out.content += buf[:end]
                self._buf, self._state = buf[end:], "text"
                return True
            self._start_call(out, recipient.removeprefix(harmony.FUNCTIONS))
            self._buf, self._state = buf[end:], "args"
            return True
        # args: up to <|call|>
        at = buf.find(harmony.CALL)
        keep = 0 if at >= 0 else _partial_suffix(buf, harmony.CALL)
        piece = buf[:at] if at >= 0 else buf[: len(buf) - keep]
        if piece:
            self._add_arguments(out, piece)
        if at < 0:
            self._buf = buf[len(buf) - keep:]
            return False
        self._buf = buf[at + len(harmony.CALL):]
        self._state = "text" if self.parallel else "done"
        return True


def assistant_message(
    calling: ToolCalling | None, text: str, finish_reason: str | None,
) -> tuple[dict[str, Any], str | None]:
    """The whole reply as OpenAI's assistant message, and the finish reason to report."""
    if calling is None:
        return {"role": "assistant", "content": text}, finish_reason
    parser = calling.parser()
    parser.read(text, finished=True)
    if not parser.calls:
        return {"role": "assistant", "content": text}, finish_reason
    content = parser.content.strip() or None
    message = {"role": "assistant", "content": content, "tool_calls": [c.to_openai() for c in parser.calls]}
    return message, "tool_calls" if finish_reason == "stop" else finish_reason
