"""Request validation for the OpenAI-compatible server, and the errors it answers with.

Every field is checked by hand (type, then range) so that a bad request gets a one-line
OpenAI-style error naming the field, never a traceback: 400 for a body that is not JSON or
asks for something unsupported, 422 for a wrong type, a missing field or an out-of-range value.
Unknown fields are ignored, as vLLM and llama-server do, because clients send many.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from localllm.engine.sequence import MAX_LOGPROBS as MAX_TOP_LOGPROBS
from localllm.engine.sequence import SEED_MAX, SEED_MIN
from localllm.tokenizer import TEMPLATE_VARIABLES, lone_surrogate

MAX_N = 32  # choices per request: each is a full sequence in the engine
MAX_STOP = 16
_NO_DEFAULTS: Mapping[str, float | int] = MappingProxyType({})  # a model that sets no sampling defaults


class APIError(Exception):
    """An HTTP error with an OpenAI-shaped JSON body."""

    def __init__(
        self, status: int, message: str, *, type_: str = "invalid_request_error",
        param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _invalid(param: str, message: str) -> APIError:
    return APIError(422, f"'{param}': {message}", param=param, code="invalid_value")


def _kind(value: Any) -> str:
    """JSON's name for a value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


# ---- typed field readers: a missing key or null gives the default ----

def _bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _invalid(name, f"expected a boolean, got {_kind(value)}")
    return value


def _int(
    body: dict[str, Any], name: str, default: int | None, lo: int | None = None, hi: int | None = None,
) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    # bool is an int subclass in Python but not in JSON; 3.0 is accepted as 3, as JSON has one number type
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _invalid(name, f"expected an integer, got {_kind(value)}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise _invalid(name, f"{value} is out of range [{'' if lo is None else lo}, {'' if hi is None else hi}]")
    return value


def _float(
    body: dict[str, Any], name: str, default: float, lo: float | None = None, hi: float | None = None,
    lo_open: bool = False,
) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _invalid(name, f"expected a number, got {_kind(value)}")
    try:
        value = float(value)
    except OverflowError:  # JSON integers have no size limit; a 400-digit one is no float
        raise _invalid(name, "must be a finite number, got an integer beyond the float range") from None
    if not math.isfinite(value):
        raise _invalid(name, "must be a finite number")
    too_low = lo is not None and (value <= lo if lo_open else value < lo)
    if too_low or (hi is not None and value > hi):
        left = "(" if lo_open else "["
        raise _invalid(name, f"{value:g} is out of range {left}{'' if lo is None else f'{lo:g}'}, "
                             f"{'' if hi is None else f'{hi:g}'}]")
    return value


def _str(body: dict[str, Any], name: str, default: str | None) -> str | None:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, str):
        raise _invalid(name, f"expected a string, got {_kind(value)}")
    return value


def _stop(body: dict[str, Any]) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise _invalid("stop", f"expected a string or an array of strings, got {_kind(value)}")
    if len(value) > MAX_STOP:
        raise _invalid("stop", f"at most {MAX_STOP} stop strings")
    return list(value)


def _token_ids(value: Any, name: str) -> list[int] | None:
    """A list of non-negative ints, or None when ``value`` is not shaped like one."""
    if not isinstance(value, list) or not value:
        return None
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return None
    if any(t < 0 for t in value):
        raise _invalid(name, "token ids must be >= 0")
    return value


# ---- requests ----

@dataclass(slots=True)
class GenerationRequest:
    """What the chat and completions endpoints share. ``sampling`` holds ``SamplingParams``
    keyword arguments (n excluded: the server fans choices out itself)."""

    model: str | None
    stream: bool
    include_usage: bool
    n: int
    max_tokens: int | None
    sampling: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class ChatRequest(GenerationRequest):
    messages: list[dict[str, Any]] = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0
    # further chat template variables (vLLM's chat_template_kwargs: enable_thinking, ...)
    template_kwargs: dict[str, object] = field(default_factory=dict)


@dataclass(slots=True)
class CompletionRequest(GenerationRequest):
    # each prompt is text or token ids; a batch of prompts gets len(prompts) * n choices
    prompts: list[str | list[int]] = field(default_factory=list)
    logprobs: int | None = None


def _require_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {_kind(body)}")
    _refuse_lone_surrogates(body)
    return body


def _refuse_lone_surrogates(body: dict[str, Any]) -> None:
    """JSON may escape half a surrogate pair ("\\ud800"); such a string has no UTF-8 form, so
    neither the tokenizer nor a JSON reply can carry it. Refused wherever it sits, keys included,
    before any field is read. Iterative: json.loads nests deeper than Python recurses."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                where = f"{path}.{key}" if path else str(key)
                if lone_surrogate(key) is not None:
                    raise APIError(400, f"a key in '{path or 'the body'}' holds a lone surrogate, which is not "
                                        "valid Unicode; send UTF-8 text", param=path or None, code="invalid_value")
                stack.append((where, item))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(value))
        elif isinstance(value, str) and (at := lone_surrogate(value)) is not None:
            raise APIError(400, f"'{path}': holds a lone surrogate (U+{ord(value[at]):04X}) at character {at}, "
                                "which is not valid Unicode; send UTF-8 text", param=path, code="invalid_value")


def _common(
    body: dict[str, Any], default_max_tokens: int | None, defaults: Mapping[str, float | int],
) -> dict[str, Any]:
    """``defaults``: the model's sampling defaults, used for the fields the body omits; OpenAI's
    own defaults fill the rest."""
    max_tokens = _int(body, "max_tokens", default_max_tokens, lo=1)
    # max_completion_tokens is the newer name for the same thing; it wins when both are sent
    max_tokens = _int(body, "max_completion_tokens", max_tokens, lo=1)
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise _invalid("stream_options", f"expected an object, got {_kind(options)}")
        include_usage = _bool(options, "include_usage", False)
    stop_token_ids = body.get("stop_token_ids")
    if stop_token_ids is not None and stop_token_ids != [] and _token_ids(stop_token_ids, "stop_token_ids") is None:
        raise _invalid("stop_token_ids", "expected an array of integers")
    if body.get("logit_bias"):  # applying it is not implemented; ignoring it would change the answer
        raise APIError(400, "'logit_bias' is not supported", param="logit_bias", code="unsupported")
    best_of = _int(body, "best_of", None, lo=1)
    n = _int(body, "n", 1, lo=1, hi=MAX_N)
    assert n is not None
    if best_of is not None and best_of != n:
        raise APIError(400, "'best_of' other than n is not supported", param="best_of", code="unsupported")
    sampling = {
        "temperature": _float(body, "temperature", float(defaults.get("temperature", 1.0)), lo=0.0, hi=2.0),
        "top_p": _float(body, "top_p", float(defaults.get("top_p", 1.0)), lo=0.0, hi=1.0, lo_open=True),
        "top_k": _int(body, "top_k", int(defaults.get("top_k", -1)), lo=-1),
        "min_p": _float(body, "min_p", float(defaults.get("min_p", 0.0)), lo=0.0, hi=1.0),
        "repetition_penalty": _float(body, "repetition_penalty", float(defaults.get("repetition_penalty", 1.0)),
                                     lo=0.0, hi=10.0, lo_open=True),
        "presence_penalty": _float(body, "presence_penalty", 0.0, lo=-2.0, hi=2.0),
        "frequency_penalty": _float(body, "frequency_penalty", 0.0, lo=-2.0, hi=2.0),
        "seed": _int(body, "seed", None, lo=SEED_MIN, hi=SEED_MAX),
        "stop": _stop(body),
        "stop_token_ids": list(stop_token_ids or []),
        "ignore_eos": _bool(body, "ignore_eos", False),
        "max_tokens": max_tokens,
    }
    _str(body, "user", None)
    return {"model": _str(body, "model", None), "stream": stream, "include_usage": include_usage, "n": n,
            "max_tokens": max_tokens, "sampling": sampling}


_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def _message(i: int, m: Any) -> dict[str, str]:
    """role and content; an assistant turn's earlier reasoning (``reasoning_content``, or vLLM's
    newer ``reasoning``) goes along, for the template to keep or drop."""
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise _invalid(where, f"expected an object, got {_kind(m)}")
    role = m.get("role")
    if not isinstance(role, str):
        raise _invalid(f"{where}.role", "required, a string")
    if role not in _ROLES:
        raise APIError(400, f"'{where}.role': {role!r} is not supported (use system, user, assistant or tool)",
                       param=f"{where}.role", code="unsupported")
    content = m.get("content")
    if content is None and role == "assistant":
        content = ""
    if isinstance(content, list):  # content parts: only text can reach a text-only model
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise _invalid(f"{where}.content[{j}]", "expected a content part object with a 'type'")
            if part["type"] != "text":
                raise APIError(400, f"'{where}.content[{j}]': content type {part['type']!r} is not supported "
                                    "(text only)", param=f"{where}.content", code="unsupported")
            if not isinstance(part.get("text"), str):
                raise _invalid(f"{where}.content[{j}].text", "required, a string")
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise _invalid(f"{where}.content", f"expected a string or an array of content parts, got {_kind(content)}")
    message = {"role": _ROLES[role], "content": content}
    for key in ("reasoning_content", "reasoning"):
        reasoning = m.get(key)
        if reasoning is None or role != "assistant":
            continue
        if not isinstance(reasoning, str):
            raise _invalid(f"{where}.{key}", f"expected a string, got {_kind(reasoning)}")
        message["reasoning_content"] = reasoning
    return message


_REASONING_EFFORTS = ("low", "medium", "high")


def _template_kwargs(body: dict[str, Any]) -> dict[str, object]:
    """vLLM's ``chat_template_kwargs`` (any JSON object), plus OpenAI's ``reasoning_effort``,
    which reaches the template under that name (gpt-oss's reads it) unless the object sets it."""
    raw = body.get("chat_template_kwargs")
    if raw is None:
        kwargs: dict[str, object] = {}
    elif not isinstance(raw, dict):
        raise _invalid("chat_template_kwargs", f"expected an object, got {_kind(raw)}")
    else:
        kwargs = dict(raw)
    reserved = sorted(set(kwargs) & TEMPLATE_VARIABLES)
    if reserved:
        raise APIError(400, f"'chat_template_kwargs': {reserved[0]!r} is set by the server itself; leave it out",
                       param="chat_template_kwargs", code="invalid_value")
    effort = _str(body, "reasoning_effort", None)
    if effort is not None:
        if effort not in _REASONING_EFFORTS:
            raise _invalid("reasoning_effort", f"{effort!r} is not one of {', '.join(_REASONING_EFFORTS)}")
        kwargs.setdefault("reasoning_effort", effort)
    return kwargs


def parse_chat(body: Any, defaults: Mapping[str, float | int] = _NO_DEFAULTS) -> ChatRequest:
    body = _require_object(body)
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise _invalid("messages", "required, an array of messages" if messages is None
                       else f"expected an array, got {_kind(messages)}")
    if not messages:
        raise _invalid("messages", "must hold at least one message")
    parsed = [_message(i, m) for i, m in enumerate(messages)]
    # tools and response_format: server/tools.py and server/structured.py
    logprobs = _bool(body, "logprobs", False)
    top_logprobs = _int(body, "top_logprobs", 0, lo=0, hi=MAX_TOP_LOGPROBS)
    assert top_logprobs is not None
    if top_logprobs and not logprobs:
        raise _invalid("top_logprobs", "needs 'logprobs': true")
    common = _common(body, None, defaults)  # max_tokens None: until eos or the context ends
    if logprobs:
        common["sampling"]["logprobs"] = top_logprobs
    return ChatRequest(**common, messages=parsed, logprobs=logprobs, top_logprobs=top_logprobs,
                       template_kwargs=_template_kwargs(body))


def parse_completion(body: Any, defaults: Mapping[str, float | int] = _NO_DEFAULTS) -> CompletionRequest:
    body = _require_object(body)
    prompt = body.get("prompt")
    prompts: list[str | list[int]]
    if isinstance(prompt, str):
        prompts = [prompt]
    elif (ids := _token_ids(prompt, "prompt")) is not None:
        prompts = [ids]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        batch = [_token_ids(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
        if any(b is None for b in batch):
            raise _invalid("prompt", "a batch of token-id prompts must be non-empty arrays of integers")
        prompts = [b for b in batch if b is not None]
    elif prompt is None:
        raise _invalid("prompt", "required: a string, an array of strings, or token ids")
    else:
        raise _invalid("prompt", "expected a string, an array of strings, an array of token ids, "
                                 f"or an array of those; got {_kind(prompt)}")
    if _bool(body, "echo", False):
        raise APIError(400, "'echo' is not supported", param="echo", code="unsupported")
    if _str(body, "suffix", None):
        raise APIError(400, "'suffix' is not supported", param="suffix", code="unsupported")
    logprobs = _int(body, "logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
    common = _common(body, 16, defaults)  # max_tokens 16: OpenAI's completions default
    if len(prompts) * common["n"] > MAX_N:
        raise _invalid("prompt", f"a batch of {len(prompts)} prompts x n={common['n']} exceeds {MAX_N} choices")
    if logprobs is not None:
        common["sampling"]["logprobs"] = logprobs
    return CompletionRequest(**common, prompts=prompts, logprobs=logprobs)


def context_length_error(limit: int, prompt_tokens: int, max_tokens: int | None, param: str) -> APIError:
    """OpenAI's wording, which clients (and people) recognise."""
    what = "messages" if param == "messages" else "prompt"
    if max_tokens is None or prompt_tokens >= limit:
        message = (f"This model's maximum context length is {limit} tokens. However, your {what} resulted in "
                   f"{prompt_tokens} tokens. Please reduce the length of the {what}.")
    else:
        message = (f"This model's maximum context length is {limit} tokens. However, you requested "
                   f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the {what}, {max_tokens} in the "
                   f"completion). Please reduce the length of the {what} or completion.")
    return APIError(400, message, param=param, code="context_length_exceeded")
