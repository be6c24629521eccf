"""gpt-oss tool calls in the server: a reply's harmony call messages read back into OpenAI's
``tool_calls`` (whole and streamed, ``finish_reason: "tool_calls"``), checked against
openai-harmony's own parse of the same tokens; then through the official ``openai`` client
against ``localllm serve`` running a tiny random gpt-oss (transformers) on the o200k_harmony
vocabulary, where a grammar makes the random model write a call.

The rendering of tools, calls and results is checked id for id in tests/models/test_harmony.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from localllm.engine.guided import JSON_DEFAULTS
from localllm.reasoning import format_for, prompt_tail
from localllm.server.reasoning_fields import HarmonyCallsKept
from localllm.server.tools import HARMONY, HarmonyCallParser, ToolCalling, assistant_message
from localllm.tokenizer import IncrementalDetokenizer, Tokenizer
from tests.models.test_harmony import TOOLS, harmony, tokenizer  # noqa: F401
from tests.server.conftest import Served

ASK = [{"role": "user", "content": "Weather in Paris for two days?"}]
ARGS = '{"location":"Paris","days":2}'
# replies as gpt-oss writes them after "<|start|>assistant" (the stop token's text is not
# part of a reply: the engine stops on <|call|> and <|return|>)
REPLIES = {
    "thought then call": ("<|channel|>analysis<|message|>Need the forecast.<|end|><|start|>assistant"
                          f"<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{ARGS}"),
    "recipient first": f" to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{ARGS}",
    "preamble then call": ("<|channel|>commentary<|message|>Let me look.<|end|><|start|>assistant to=functions.now"
                           "<|channel|>commentary <|constrain|>json<|message|>{}"),
    "answer": "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is sunny.",
}


def _expected(oh: Any, enc: Any, tok: Tokenizer, reply: str) -> tuple[str, str, list[tuple[str, str]]]:
    """(reasoning, content, [(function, arguments)]) as openai-harmony parses the reply,
    mapped to OpenAI's fields as vLLM maps them."""
    ended = reply + ("<|return|>" if "final" in reply else "<|call|>")  # the stop token, which it parses
    ids = list(enc.encode(ended, allowed_special="all"))
    assert ids == tok.encode(ended, add_special_tokens=False)
    parsed = enc.parse_messages_from_completion_tokens(ids, oh.Role.ASSISTANT)
    reasoning, content, calls = "", "", []
    for m in parsed:
        text = "".join(c.text for c in m.content)
        if m.recipient and m.recipient.startswith("functions."):
            calls.append((m.recipient.removeprefix("functions."), text))
        elif m.channel == "analysis":
            reasoning += text
        else:
            content += text
    return reasoning, content, calls


@pytest.mark.parametrize("case", list(REPLIES))
def test_a_reply_token_stream_reads_as_openai_harmony_parses_it(harmony: Any, tokenizer: Tokenizer,  # noqa: F811
                                                                case: str) -> None:
    """The server's two readers, fed the reply's tokens one at a time as the engine streams
    them: reasoning, answer and calls as openai-harmony reads the same ids; the stream's
    argument fragments join to the whole message's arguments; the finish reason is
    ``tool_calls`` when the reply called."""
    oh, enc, _ = harmony
    reasoning, content, calls = _expected(oh, enc, tokenizer, REPLIES[case])
    prompt = tokenizer.encode_chat(ASK, tools=TOOLS)
    tail = prompt_tail(tokenizer, prompt)
    fmt = format_for(tokenizer, "gpt-oss")
    assert fmt is not None
    calling = ToolCalling(TOOLS, "auto", True, HARMONY, None)
    ids = tokenizer.encode(REPLIES[case], add_special_tokens=False)

    split, parser = HarmonyCallsKept(tail), calling.parser()
    detok = IncrementalDetokenizer(tokenizer, fmt.skip_special_tokens)
    streamed_reasoning, streamed_content, fragments = "", "", {}
    for i, tid in enumerate(ids):
        last = i == len(ids) - 1
        part = split.read(detok.add([tid]), last)
        streamed_reasoning += part.reasoning
        delta = parser.read(part.content, last).to_openai()
        streamed_content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            got = fragments.setdefault(call["index"], {"name": "", "arguments": ""})
            got["name"] += call["function"].get("name", "")
            got["arguments"] += call["function"]["arguments"]
            assert ("id" in call) == ("name" in call["function"])  # id and name come once, first
    assert streamed_reasoning == reasoning
    assert [(f["name"], f["arguments"]) for f in fragments.values()] == calls
    assert streamed_content.strip() == content.strip()

    whole_reasoning, answer = HarmonyCallsKept(tail).split(tokenizer.decode(ids, skip_special_tokens=False))
    message, finish = assistant_message(calling, answer, "stop")
    assert whole_reasoning == reasoning
    assert finish == ("tool_calls" if calls else "stop")
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])] == calls
    assert (message["content"] or "") == (content.strip() if calls else content)


def test_without_tools_a_call_stays_in_the_answer_as_written(tokenizer: Tokenizer) -> None:  # noqa: F811
    """No tools asked for: nothing reads calls, and the call message is shown as the model
    wrote it (as a Hermes model's <tool_call> block is), not as bare JSON."""
    tail = prompt_tail(tokenizer, tokenizer.encode_chat(ASK))
    reasoning, content = HarmonyCallsKept(tail).split(REPLIES["thought then call"])
    assert reasoning == "Need the forecast."
    assert content == ("<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
                       f"<|message|>{ARGS}<|call|>")


def test_a_call_cut_by_max_tokens_keeps_its_partial_arguments() -> None:
    parser = HarmonyCallParser()
    delta = parser.read('<|channel|>commentary to=functions.now <|constrain|>json<|message|>{"zo', finished=True)
    assert [c.name for c in parser.calls] == ["now"] and parser.calls[0].arguments == '{"zo'
    assert delta.to_openai()["tool_calls"][0]["function"] == {"name": "now", "arguments": '{"zo'}


# ---- through the openai client against the server, a tiny random gpt-oss ----

SCHEMA = {"type": "object", "properties": {"location": {"enum": ["Paris", "Oslo"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
          "required": ["location", "days"], "additionalProperties": False}
SERVER_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast.", "parameters": SCHEMA}},
                {"type": "function", "function": {"name": "now", "description": "The time."}}]


@pytest.fixture(scope="session")
def gpt_oss_engine(tokenizer: Tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:  # noqa: F811
    """A 2-layer random GptOssForCausalLM (transformers) with the harmony vocabulary and no
    chat template (its vocabulary makes it speak harmony), in an AsyncEngine; shared with the
    TUI's test (tests/tui/test_backend_harmony.py)."""
    transformers = pytest.importorskip("transformers")
    import torch

    from localllm.engine.async_engine import AsyncEngine
    from localllm.engine.engine import EngineConfig, LLMEngine

    cfg = transformers.GptOssConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_hidden_layers=2, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=128,
        max_position_embeddings=2048, bos_token_id=199998, eos_token_id=200002, pad_token_id=None,
        tie_word_embeddings=False)
    torch.manual_seed(11)
    path = tmp_path_factory.mktemp("gpt-oss") / "gpt-oss"
    transformers.GptOssForCausalLM(cfg).float().eval().save_pretrained(path)
    tokenizer.backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|startoftext|>", "eos_token": "<|return|>"}))
    engine = AsyncEngine(LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", max_model_len=1024,
                                                chats=2)))
    try:
        yield engine
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def gpt_oss(gpt_oss_engine: Any) -> Iterator[Served]:
    """``localllm serve``'s app on the tiny gpt-oss, in this process."""
    from localllm.server.app import create_app
    from localllm.server.serving import start_server_thread

    server = start_server_thread(create_app(gpt_oss_engine))
    try:
        yield Served(gpt_oss_engine, server.url, server.url)
    finally:
        server.stop()


def test_a_forced_call_comes_back_as_tool_calls_whole_and_streamed(gpt_oss: Served) -> None:
    """``tool_choice`` naming the function: the grammar has the model write harmony's call
    message, the server answers with ``tool_calls`` (arguments that validate against the
    schema) and ``finish_reason: "tool_calls"``; the stream's deltas rebuild the same call;
    ``"required"`` calls one of the tools. The call and a tool result then go back in the
    next request."""
    import jsonschema
    import openai

    client = openai.OpenAI(base_url=gpt_oss.base, api_key="unused", max_retries=0, timeout=300)
    named = {"type": "function", "function": {"name": "get_weather"}}
    kw: dict[str, Any] = {"model": "any", "messages": ASK, "tools": SERVER_TOOLS, "tool_choice": named,
                          "temperature": 0, "max_tokens": 60}
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)

    name, args, finish = "", "", None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                name += d.function.name or ""
                args += d.function.arguments or ""
            finish = c.finish_reason or finish
    assert (name, args, finish) == ("get_weather", call.function.arguments, "tool_calls")

    required = client.chat.completions.create(**{**kw, "tool_choice": "required"}).choices[0]
    assert required.finish_reason == "tool_calls"
    (any_call,) = required.message.tool_calls
    assert any_call.function.name in ("get_weather", "now")
    assert isinstance(json.loads(any_call.function.arguments), dict)

    history = [*ASK, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'}]
    again = client.chat.completions.create(model="any", messages=history, tools=SERVER_TOOLS, max_tokens=2,
                                           temperature=0)
    assert again.usage.prompt_tokens > 0
    gpt_oss.wait_idle()


# the recipient before the channel, in both places gpt-oss writes it: going on from the prompt's
# "<|start|>assistant", and in a message of its own after a thought
RECIPIENT_FIRST = {
    "after the prompt's role": "start: call",
    "after a thought": ('start: thought <|start|> "assistant" call\n'
                        'thought: <|channel|> "analysis" <|message|> /[a-z]{2,8}( [a-z]{2,8}){1,3}/ <|end|>'),
}


@pytest.mark.parametrize("case", list(RECIPIENT_FIRST))
def test_a_recipient_first_call_comes_back_as_tool_calls_whole_and_streamed(gpt_oss: Served, case: str) -> None:
    """``tool_choice: "auto"`` with a ``guided_grammar`` under which the random model writes its
    call as `` to=functions.get_weather<|channel|>commentary json<|message|>{...}<|call|>``: the
    reply is ``tool_calls`` with ``finish_reason: "tool_calls"``, no header text in the answer
    or the reasoning, whole and streamed alike."""
    import jsonschema
    import openai

    grammar = (f'{RECIPIENT_FIRST[case]}\ncall: " to=functions.get_weather" <|channel|> "commentary json" <|message|> '
               f"args <|call|>\nargs: %json {json.dumps({**SCHEMA, 'x-guidance': JSON_DEFAULTS})}\n")
    client = openai.OpenAI(base_url=gpt_oss.base, api_key="unused", max_retries=0, timeout=300)
    kw: dict[str, Any] = {"model": "any", "messages": ASK, "tools": SERVER_TOOLS, "temperature": 0, "max_tokens": 80,
                          "extra_body": {"guided_grammar": grammar}}
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
    assert not choice.message.content
    reasoning = choice.message.model_extra.get("reasoning_content")
    assert (reasoning is not None) == (case == "after a thought")
    assert "to=" not in (reasoning or "") and "<|" not in (reasoning or "")

    name, args, content, thought, finish = "", "", "", "", None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                name += d.function.name or ""
                args += d.function.arguments or ""
            content += c.delta.content or ""
            thought += (c.delta.model_extra or {}).get("reasoning_content") or ""
            finish = c.finish_reason or finish
    assert (name, args, finish) == ("get_weather", call.function.arguments, "tool_calls")
    assert content.strip() == "" and thought == (reasoning or "")
    gpt_oss.wait_idle()
