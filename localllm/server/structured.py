"""How a request asks for structured output: OpenAI's ``response_format`` (``json_object``,
``json_schema``) and vLLM's ``guided_json``, ``guided_regex``, ``guided_choice`` and
``guided_grammar``, read into ``SamplingParams``' guided fields (see ``engine/guided.py``).
Both endpoints take them. A shape error is a 422 naming the field; asking for two at once,
or for a kind that does not exist, is a 400."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from localllm.server.protocol import APIError, _invalid, _kind

_VLLM_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


@dataclass(slots=True)
class GuidedRequest:
    """``sampling``: SamplingParams keyword arguments; ``param``: the request field that asked
    for the grammar, named in the 400 when the grammar engine cannot compile it."""

    sampling: dict[str, Any] = field(default_factory=dict)
    param: str | None = None


def _schema(value: Any, name: str) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise _invalid(name, f"not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise _invalid(name, f"expected a JSON schema object, got {_kind(value)}")
    return value


def _response_format(fmt: Any) -> dict[str, Any] | None:
    if not isinstance(fmt, dict):
        raise _invalid("response_format", f"expected an object, got {_kind(fmt)}")
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise _invalid("response_format.json_schema", "required with type 'json_schema': an object with "
                                                          "'name' and 'schema'")
        schema = spec.get("schema")
        return {"type": "object"} if schema is None else _schema(schema, "response_format.json_schema.schema")
    raise APIError(400, f"'response_format': type {kind!r} is not supported (text, json_object or json_schema)",
                   param="response_format", code="unsupported")


def _grammar(text: Any) -> str:
    """vLLM's guided_grammar is GBNF/EBNF; Lark is accepted too. Both become llguidance's Lark."""
    if not isinstance(text, str) or not text.strip():
        raise _invalid("guided_grammar", "expected a non-empty grammar string")
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return any_to_lark(text)
    except Exception as e:  # noqa: BLE001 - the converter raises plain exceptions for bad grammars
        raise APIError(400, f"'guided_grammar': the grammar cannot be read: {e}", param="guided_grammar",
                       code="invalid_value") from None


def parse_guided(body: dict[str, Any]) -> GuidedRequest:
    asked: list[tuple[str, str, Any]] = []  # (request field, SamplingParams field, value)
    fmt = body.get("response_format")
    if fmt is not None:
        schema = _response_format(fmt)
        if schema is not None:
            asked.append(("response_format", "guided_json", schema))
    for name in _VLLM_FIELDS:
        value = body.get(name)
        if value is None:
            continue
        if name == "guided_json":
            value = _schema(value, name)
        elif name == "guided_regex":
            if not isinstance(value, str) or not value:
                raise _invalid(name, "expected a non-empty regex string")
        elif name == "guided_choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
                raise _invalid(name, "expected a non-empty array of non-empty strings")
        else:
            value = _grammar(value)
        asked.append((name, name, value))
    if len(asked) > 1:
        names = " and ".join(f"'{a[0]}'" for a in asked)
        raise APIError(400, f"{names} each constrain the output; send one", param=asked[1][0], code="invalid_value")
    if not asked:
        return GuidedRequest()
    param, key, value = asked[0]
    return GuidedRequest({key: value}, param)
