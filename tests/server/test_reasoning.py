"""``reasoning_content`` apart from ``content``, through the official ``openai`` client against
the real server and the real default model.

The default model (SmolLM2) never writes <think> on its own, so the requests make it: a
``guided_regex`` lets the model pick every token of a "<think>...</think> answer" reply, and the
server is told, as ``--reasoning-parser qwen3`` tells vLLM, that this model's replies carry
their reasoning that way. The tags therefore come from the engine as the model's own tokens,
several per tag, cut across stream chunks wherever the tokens fall. The expected split is
worked out from the raw reply the same engine gives to the plain server (no parser)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from localllm.server.app import create_app
from localllm.server.serving import start_server_thread
from tests.server.conftest import Served

THINK = r"<think>\n[a-z][a-z ]{8,40}\n</think>\n\n[A-Z][a-z ,]{3,40}\."
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
FORCED = {"temperature": 0, "max_tokens": 90, "extra_body": {"guided_regex": THINK}}


@pytest.fixture(scope="module")
def thinking_base(served: Served) -> Iterator[str]:
    """A second app on the shared engine, run as `localllm serve --reasoning-parser qwen3`."""
    server = start_server_thread(create_app(served.engine, reasoning_parser="qwen3"))
    try:
        yield f"{server.url}/v1"
    finally:
        server.stop()


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=300)


def test_reasoning_content_apart_from_content_in_the_message_and_the_stream(
    served: Served, thinking_base: str,
) -> None:
    raw = _client(served.base).chat.completions.create(model=served.model, messages=MESSAGES, **FORCED)
    text = raw.choices[0].message.content or ""
    # the plain server: the model's reply whole, tags and all, and no reasoning field
    assert text.startswith("<think>\n") and "\n</think>\n\n" in text, text
    assert raw.choices[0].message.model_extra.get("reasoning_content") is None
    inner, answer = text[len("<think>\n"):].split("\n</think>\n\n")

    thinking = _client(thinking_base)
    split = thinking.chat.completions.create(model=served.model, messages=MESSAGES, **FORCED)
    message = split.choices[0].message
    assert message.model_extra["reasoning_content"] == inner.strip()
    assert message.content == answer
    assert split.choices[0].finish_reason == raw.choices[0].finish_reason == "stop"
    # the same tokens were generated and billed; only where their text goes differs
    assert split.usage.completion_tokens == raw.usage.completion_tokens
    assert split.usage.prompt_tokens == raw.usage.prompt_tokens

    reasoning_deltas, content_deltas, finish = [], [], None
    with thinking.chat.completions.create(model=served.model, messages=MESSAGES, stream=True,
                                          stream_options={"include_usage": True}, **FORCED) as stream:
        for chunk in stream:
            if chunk.usage is not None:
                assert chunk.usage.completion_tokens == raw.usage.completion_tokens
            for choice in chunk.choices:
                extra = choice.delta.model_extra or {}
                if extra.get("reasoning_content"):
                    reasoning_deltas.append(extra["reasoning_content"])
                if choice.delta.content:
                    content_deltas.append(choice.delta.content)
                finish = choice.finish_reason or finish
    assert "".join(reasoning_deltas) == inner.strip()
    assert "".join(content_deltas) == answer
    assert finish == "stop"
    # streamed as it came, not all at once at the end; no tag text leaks into either side
    assert len(reasoning_deltas) >= 3 and len(content_deltas) >= 2
    assert not any("<" in d or ">" in d for d in reasoning_deltas + content_deltas)
    served.wait_idle()


def test_a_reply_without_a_block_is_all_content(served: Served, thinking_base: str) -> None:
    reply = _client(thinking_base).chat.completions.create(model=served.model, messages=MESSAGES, temperature=0,
                                                           max_tokens=12)
    plain = _client(served.base).chat.completions.create(model=served.model, messages=MESSAGES, temperature=0,
                                                         max_tokens=12)
    assert reply.choices[0].message.content == plain.choices[0].message.content
    assert reply.choices[0].message.model_extra["reasoning_content"] is None


def test_earlier_reasoning_reaches_only_templates_that_ask_for_it(served: Served) -> None:
    """SmolLM2's ChatML template reads no reasoning: a past turn's reasoning_content is not
    rendered into the prompt, so the prompt is the same token for token."""
    history = [*MESSAGES, {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And Spain?"}]
    thought = [*MESSAGES, {"role": "assistant", "content": "Paris.", "reasoning_content": "France's capital is Paris."},
               {"role": "user", "content": "And Spain?"}]
    client = _client(served.base)
    a = client.chat.completions.create(model=served.model, messages=history, max_tokens=1, temperature=0)
    b = client.chat.completions.create(model=served.model, messages=thought, max_tokens=1, temperature=0)
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


@pytest.mark.parametrize("extra, status, message", [
    ({"chat_template_kwargs": ["enable_thinking"]}, 422, "'chat_template_kwargs': expected an object, got array"),
    ({"chat_template_kwargs": {"messages": []}}, 400, "'chat_template_kwargs': 'messages' is set by the server"),
    ({"reasoning_effort": "max"}, 422, "'reasoning_effort': 'max' is not one of low, medium, high"),
    ({"messages": [{"role": "assistant", "content": "a", "reasoning_content": 3}, *MESSAGES]}, 422,
     "'messages[0].reasoning_content': expected a string, got number"),
])
def test_bad_reasoning_fields_get_one_clear_error(served: Served, extra: dict, status: int, message: str) -> None:
    body = {"model": served.model, "messages": MESSAGES, "max_tokens": 1, **extra}
    r = httpx.post(f"{served.base}/chat/completions", json=body, timeout=60)
    assert r.status_code == status, r.text
    assert r.json()["error"]["message"].startswith(message)


def test_the_cli_names_the_parsers_and_refuses_others() -> None:
    from tests.test_cli import cli_here

    proc = cli_here("serve", "--reasoning-parser", "r1")  # argparse refuses it: no process needed
    assert proc.returncode == 2
    assert "invalid choice: 'r1' (choose from 'auto', 'qwen3', 'deepseek_r1', 'openai_gptoss', 'none')" in proc.stderr


HARMONY = (r"<\|channel\|>analysis<\|message\|>[a-z][a-z ]{8,40}<\|end\|>"
           r"<\|start\|>assistant<\|channel\|>final<\|message\|>[A-Z][a-z ,]{3,40}\.")


def test_harmony_channels_as_gpt_oss_writes_them(served: Served) -> None:
    """`--reasoning-parser openai_gptoss`: the analysis channel is reasoning, the final one the
    answer. SmolLM2 has no harmony tokens, so here the markers are text the model writes under
    the regex; the parser reads the same text either way (with gpt-oss they are special tokens,
    which such a server keeps when detokenizing: tests/test_reasoning.py)."""
    forced = {"temperature": 0, "max_tokens": 120, "extra_body": {"guided_regex": HARMONY}}
    raw = _client(served.base).chat.completions.create(model=served.model, messages=MESSAGES, **forced)
    text = raw.choices[0].message.content or ""
    head, final = text.split("<|start|>assistant<|channel|>final<|message|>")
    analysis = head.removeprefix("<|channel|>analysis<|message|>").removesuffix("<|end|>")
    server = start_server_thread(create_app(served.engine, reasoning_parser="openai_gptoss"))
    try:
        client = _client(f"{server.url}/v1")
        message = client.chat.completions.create(model=served.model, messages=MESSAGES, **forced).choices[0].message
        assert (message.model_extra["reasoning_content"], message.content) == (analysis, final)
        parts = {"reasoning_content": "", "content": ""}
        for chunk in client.chat.completions.create(model=served.model, messages=MESSAGES, stream=True, **forced):
            for choice in chunk.choices:
                parts["reasoning_content"] += (choice.delta.model_extra or {}).get("reasoning_content") or ""
                parts["content"] += choice.delta.content or ""
        assert parts == {"reasoning_content": analysis, "content": final}
    finally:
        server.stop()
    served.wait_idle()
