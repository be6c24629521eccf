"""Tool calls through the official ``openai`` client against ``localllm serve``: a random
Qwen2-style model (embedding padded past its tokenizer) with the real Qwen2.5 chat template,
so the tools, the assistant's calls and the tool results all go through that template; calls
forced with ``tool_choice`` come back as ``tool_calls`` whose arguments parse and validate, in
whole and in stream. Then the parser on its own, and the 400s."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from localllm.engine.async_engine import AsyncEngine
from localllm.engine.engine import EngineConfig, LLMEngine
from localllm.server.app import create_app
from localllm.server.serving import start_server_thread
from localllm.server.tools import HERMES, LLAMA3_JSON, ToolCallParser, call_grammar, tool_format
from tests.models.test_random_models import VOCAB, write_random_model
from tests.server.conftest import Served

QWEN25_TEMPLATE = (Path(__file__).parent / "data" / "qwen2.5_chat_template.jinja").read_text()
WEATHER = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Oslo", "Lima"]},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
}, "required": ["city", "unit", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Time in a zone", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What's the weather in Paris for the next 3 days?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def qwen(default_checkpoint, tmp_path_factory) -> Iterator[Served]:
    from localllm.models.export import save_hf_folder

    tok = tmp_path_factory.mktemp("tok")
    default_checkpoint.tokenizer.backend.save(str(tok / "tokenizer.json"))
    save_hf_folder(default_checkpoint, tok, tensors=iter([]))
    path = write_random_model(tmp_path_factory.mktemp("m") / "qwen", "Qwen2ForCausalLM", tok, vocab=VOCAB + 64)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": QWEN25_TEMPLATE}))
    engine = AsyncEngine(LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", max_model_len=512,
                                                chats=2)))
    server = start_server_thread(create_app(engine))
    try:
        yield Served(engine, server.url, server.url)
    finally:
        server.stop()
        engine.shutdown()


@pytest.fixture
def client(qwen: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=qwen.base, api_key="unused", max_retries=0, timeout=300)


def _check_call(call: Any) -> dict[str, Any]:
    assert call.type == "function" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


def test_named_tool_call_round_trip(qwen: Served, client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="any", messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                       temperature=0, max_tokens=120)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    args = _check_call(call)

    # the call and its result go back through the template
    result = json.dumps({"forecast": ["sun", "rain", "sun"]})
    history = [*ASK, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": result}]
    r2 = client.chat.completions.create(model="any", messages=history, tools=TOOLS, temperature=0, max_tokens=8)
    tokenizer = qwen.engine.tokenizer
    expected = tokenizer.apply_chat_template(
        [*ASK, {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": args}}]},
         {"role": "tool", "content": result}], tools=TOOLS)
    assert f'<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(args)}}}\n</tool_call>' in expected
    assert f"<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>" in expected
    assert '"name": "get_time"' in expected  # the tools are in the system prompt
    assert r2.usage.prompt_tokens == len(tokenizer.backend.encode(expected, add_special_tokens=False).ids)


def test_streamed_deltas_reassemble_to_the_same_call(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model="any", messages=ASK, tools=TOOLS, tool_choice=NAMED, temperature=0,
                              max_tokens=120)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls[0]
    calls: dict[int, dict[str, Any]] = {}
    fragments = 0
    finish = None
    for chunk in client.chat.completions.create(**kw, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        assert not delta.content
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id is not None:
                assert entry["id"] is None, "a call's id is sent once"
                entry["id"], entry["name"] = tc.id, tc.function.name
            if tc.function and tc.function.arguments:
                entry["arguments"] += tc.function.arguments
                fragments += 1
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert list(calls) == [0]
    assert calls[0]["id"].startswith("call_") and calls[0]["name"] == whole.function.name
    assert calls[0]["arguments"] == whole.function.arguments
    assert fragments > 1, "the arguments arrived in one piece, not streamed"


def test_required_picks_among_the_tools(client: openai.OpenAI) -> None:
    seen = set()
    for seed in range(4):
        r = client.chat.completions.create(model="any", messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=120)
        assert r.choices[0].finish_reason == "tool_calls"
        [call] = r.choices[0].message.tool_calls
        _check_call(call)
        seen.add(call.function.name)
    assert seen <= set(SCHEMAS)


def test_auto_with_a_model_that_does_not_call(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="any", messages=ASK, tools=TOOLS, temperature=0, max_tokens=6)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content


@pytest.mark.parametrize("body,param,fragment", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "send_email"}}},
     "tool_choice", "'send_email' is not among the tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "not supported"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "send one"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "wat"}}}}}], "tool_choice": "required"},
     "tools", "cannot be compiled"),
])
def test_bad_tool_requests_are_400(qwen: Served, body: dict, param: str, fragment: str) -> None:
    r = httpx.post(f"{qwen.base}/chat/completions", json={"messages": ASK, "max_tokens": 5, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and fragment in error["message"], error


def test_tools_on_a_model_without_a_tool_section_are_400(served: Served) -> None:
    r = httpx.post(f"{served.base}/chat/completions", timeout=60,
                   json={"messages": ASK, "max_tokens": 5, "tools": TOOLS})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    assert "no tool section" in r.json()["error"]["message"]
    # tool_choice "none" leaves the tools out, so any model takes it
    r = httpx.post(f"{served.base}/chat/completions", timeout=60,
                   json={"messages": ASK, "max_tokens": 3, "tools": TOOLS, "tool_choice": "none"})
    assert r.status_code == 200 and r.json()["choices"][0]["message"].get("tool_calls") is None


# ---- the parser and the grammar on their own ----

def _reassemble(parser: ToolCallParser, text: str, rng: random.Random) -> tuple[str, list[tuple[str, str, str]]]:
    content, calls = "", {}
    pieces, i = [], 0
    while i < len(text):
        n = rng.randint(1, 7)
        pieces.append(text[i : i + n])
        i += n
    for k, piece in enumerate(pieces):
        delta = parser.read(piece, finished=k == len(pieces) - 1)
        content += delta.content
        for index, c in delta.calls.items():
            entry = calls.setdefault(index, ["", "", ""])
            if "id" in c:
                entry[0], entry[1] = c["id"], c["name"]
            entry[2] += c.get("arguments", "")
    return content, [tuple(v) for _, v in sorted(calls.items())]


@pytest.mark.parametrize("seed", range(5))
def test_parser_stream_equals_whole(seed: int) -> None:
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "note": "a } and \\" '
            '<tool_call>"}}\n</tool_call>\n<tool_call>\n{"arguments": {"zone": "UTC"}, "name": "get_time"}\n'
            '</tool_call>')
    parser = ToolCallParser(HERMES)
    content, calls = _reassemble(parser, text, random.Random(seed))
    assert content == "Let me check.\n" == parser.content
    assert [(n, json.loads(a)) for _, n, a in calls] == [
        ("get_weather", {"city": "Oslo", "note": 'a } and " <tool_call>'}), ("get_time", {"zone": "UTC"})]
    assert [(c.id, c.name, c.arguments) for c in parser.calls] == calls
    whole = ToolCallParser(HERMES)
    whole.read(text, finished=True)
    assert [(c.name, c.arguments) for c in whole.calls] == [(n, a) for _, n, a in calls]
    assert calls[0][2] == '{"city": "Oslo", "note": "a } and \\" <tool_call>"}'

    plain = "No tools needed: 1 < 2 and <tool is not a call."
    content, calls = _reassemble(ToolCallParser(HERMES), plain, random.Random(seed))
    assert content == plain and calls == []

    llama = '{"name": "get_time", "parameters": {"zone": "CET"}}; {"name": "get_weather", "parameters": {"city": "Lima"}}'
    content, calls = _reassemble(ToolCallParser(LLAMA3_JSON), llama, random.Random(seed))
    assert content == "" and [(n, json.loads(a)) for _, n, a in calls] == [
        ("get_time", {"zone": "CET"}), ("get_weather", {"city": "Lima"})]
    content, calls = _reassemble(ToolCallParser(LLAMA3_JSON, parallel=False), llama, random.Random(seed))
    assert [n for _, n, _ in calls] == ["get_time"]
    content, calls = _reassemble(ToolCallParser(LLAMA3_JSON), "The answer is {x}.", random.Random(seed))
    assert content == "The answer is {x}." and calls == []


def test_formats_from_templates(default_checkpoint) -> None:
    assert tool_format(QWEN25_TEMPLATE) is HERMES
    llama31 = ('{{- "Respond in the format {\\"name\\": function name, \\"parameters\\": dictionary of argument name '
               'and its value}." }}{{- "<|eot_id|>" }}{% if tools %}{% endif %}')
    assert tool_format(llama31) is LLAMA3_JSON
    assert tool_format(default_checkpoint.tokenizer.chat_template) is None
    assert not default_checkpoint.tokenizer.supports_tools
    grammar = call_grammar(HERMES, TOOLS, parallel=True)
    assert grammar.startswith('start: call ("\\n" call)*\ncall: "<tool_call>\\n" (fn_0 | fn_1) "\\n</tool_call>"')


def test_forced_call_grammar_takes_the_template_syntax_only(default_checkpoint) -> None:
    from localllm.engine.guided import GrammarCompiler
    from localllm.engine.sequence import SamplingParams

    tok = default_checkpoint.tokenizer
    compiler = GrammarCompiler(tok, tok.vocab_size)

    def accepts(grammar: str, text: str) -> bool:
        m = compiler.matcher(SamplingParams(guided_grammar=grammar))
        assert m is not None
        return all(m.matcher.consume_token(t) for t in tok.encode(text)) and m.is_accepting

    two = ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n'
           '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima", "unit": "celsius", "days": 2}}\n'
           '</tool_call>')
    parallel, single = call_grammar(HERMES, TOOLS, parallel=True), call_grammar(HERMES, TOOLS, parallel=False)
    assert accepts(parallel, two) and not accepts(single, two)
    assert accepts(single, '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>')
    assert not accepts(single, '<tool_call>\n{"name": "send_email", "arguments": {}}\n</tool_call>')
    assert not accepts(single, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": '
                               '"celsius", "days": 2}}\n</tool_call>')  # not in the enum
    named = call_grammar(LLAMA3_JSON, TOOLS[:1], parallel=False)
    assert accepts(named, '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "fahrenheit", "days": 7}}')
    assert not accepts(named, '{"name": "get_time", "parameters": {"zone": "UTC"}}')
