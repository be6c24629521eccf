"""``localllm serve`` through the official ``openai`` client (and raw HTTP for what the client
cannot send): chat and completions, streaming, stop strings, seeds, batching of concurrent
clients, disconnects that free KV blocks, and every kind of bad input."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import httpx
import openai
import pytest

from tests.server.conftest import API_KEY, MAX_MODEL_LEN, Served

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.base, api_key="unused", max_retries=0, timeout=120)


def _greedy(client: openai.OpenAI, **kw: Any) -> Any:
    return client.chat.completions.create(**{"model": "any", "messages": QUESTION, "temperature": 0,
                                             "max_tokens": 12, **kw})


# ---- happy paths ----

def test_models_and_health(served: Served, client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [served.model]
    assert httpx.get(f"{served.url}/health").json() == {"status": "ok", "model": served.model, "optimizing": False}


def test_open_routes_show_the_models_name_not_its_path(served: Served) -> None:
    """Issue 33: /health (open even with a key), /v1/models and /metrics showed the file's absolute path."""
    path = served.engine.engine.model_name
    assert path.startswith("/") and path.endswith(".gguf")  # the engine was loaded from a path
    name = path.rsplit("/", 1)[1]
    texts = [httpx.get(f"{served.url}/health").text, httpx.get(f"{served.base}/models").text,
             httpx.get(f"{served.url}/metrics").text]
    for text in texts:
        assert name in text and path not in text and path.rsplit("/", 1)[0] not in text, text[:300]
    assert f'model_name="{name}"' in texts[2]


def test_models_reports_the_context_and_the_sampling_defaults(served: Served) -> None:
    entry = httpx.get(f"{served.base}/models").json()["data"][0]
    assert entry["max_model_len"] == MAX_MODEL_LEN
    assert entry["sampling_defaults"] == served.engine.sampling_defaults == {"temperature": 0.2, "top_p": 0.5}


def test_omitted_sampling_fields_take_the_models_defaults(client: openai.OpenAI) -> None:
    def replies(**kw: Any) -> list[str]:
        r = client.chat.completions.create(model="any", messages=QUESTION, max_tokens=16, n=4, seed=1234, **kw)
        return [c.message.content for c in r.choices]

    # the default model's temperature 0.2 / top_p 0.5 keep every seeded choice on the answer ...
    assert replies() == ["The capital of France is Paris."] * 4
    assert replies(temperature=0.2) == replies(top_p=0.5) == replies()
    # ... which OpenAI's own defaults (temperature 1, top_p 1) do not: the same seeds scatter
    assert len(set(replies(temperature=1.0, top_p=1.0))) > 1


def test_chat_non_streaming_reports_text_and_usage(client: openai.OpenAI) -> None:
    r = _greedy(client)
    choice = r.choices[0]
    assert "Paris" in choice.message.content
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "stop"  # the model ends the sentence and says eos
    u = r.usage
    assert u.prompt_tokens > 20 and 0 < u.completion_tokens <= 12
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    # the default system prompt is shared with every earlier request: its full blocks are cached
    assert _greedy(client).usage.prompt_tokens_details.cached_tokens >= 16


def test_chat_streaming_matches_non_streaming(client: openai.OpenAI) -> None:
    whole = _greedy(client).choices[0].message.content
    chunks = list(_greedy(client, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])


def test_stop_string_cuts_the_reply(client: openai.OpenAI) -> None:
    whole = _greedy(client, max_tokens=16).choices[0].message.content
    word = whole.split()[2]  # whatever greedy says, stop at its third word
    r = _greedy(client, max_tokens=16, stop=[word])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == whole[: whole.index(word)]
    streamed = "".join(c.choices[0].delta.content or "" for c in _greedy(client, max_tokens=16, stop=word, stream=True)
                       if c.choices)
    assert streamed == whole[: whole.index(word)]


def test_seed_reproducible_and_n_choices(client: openai.OpenAI) -> None:
    def sample(seed: int, n: int = 1) -> list[str]:
        r = client.chat.completions.create(model="any", messages=QUESTION, temperature=1.0, max_tokens=10, seed=seed,
                                           n=n, extra_body={"ignore_eos": True})
        assert [c.index for c in r.choices] == list(range(n))
        return [c.message.content for c in r.choices]

    first = sample(7)
    assert sample(7) == first
    pair = sample(7, n=2)
    assert pair[0] == first[0]  # choice i samples with seed + i
    assert sample(8) == [pair[1]]
    assert pair[0] != pair[1]  # ten tokens at temperature 1: different seeds, different text


def test_streaming_n_choices_with_logprobs(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model="any", messages=QUESTION, temperature=1.0, seed=3, n=2, max_tokens=4, stream=True, logprobs=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    ))
    finishes = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason}
    assert finishes == {0: "length", 1: "length"}
    counted = sum(len(c.choices[0].logprobs.content) for c in chunks if c.choices and c.choices[0].logprobs)
    assert counted == 8 and chunks[-1].usage.completion_tokens == 8


def test_max_completion_tokens_ignore_eos_and_extensions(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="any", messages=QUESTION, temperature=0.8, top_p=0.9, max_completion_tokens=7, seed=1,
        extra_body={"ignore_eos": True, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1},
    )
    assert r.usage.completion_tokens == 7 and r.choices[0].finish_reason == "length"


def test_chat_logprobs(client: openai.OpenAI) -> None:
    r = _greedy(client, max_tokens=5, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        # greedy: the chosen token is the most likely one
        assert entry.token == entry.top_logprobs[0].token
    assert "".join(e.token for e in content) == r.choices[0].message.content


def test_completions_text_ids_batch_and_stream(client: openai.OpenAI) -> None:
    r = client.completions.create(model="any", prompt="The sky is", max_tokens=6, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert r.usage.completion_tokens == 6 and c.finish_reason == "length"
    assert len(c.logprobs.tokens) == 6 and all(len(t) <= 2 for t in c.logprobs.top_logprobs)
    assert "".join(c.logprobs.tokens) == c.text
    ids = [504, 6085, 314]
    by_ids = client.completions.create(model="any", prompt=ids, max_tokens=4, temperature=0)
    assert by_ids.usage.prompt_tokens == 3
    batch = client.completions.create(model="any", prompt=["One, two,", "Hello"], n=2, max_tokens=3, temperature=0)
    assert [ch.index for ch in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text  # greedy choices agree
    stream = client.completions.create(model="any", prompt="The sky is", max_tokens=6, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    assert "".join(ch.choices[0].text for ch in stream if ch.choices) == c.text


async def test_concurrent_streams_are_batched(served: Served) -> None:
    aclient = openai.AsyncOpenAI(base_url=served.base, api_key="unused", max_retries=0, timeout=120)
    seen: list[int] = []
    done = asyncio.Event()

    async def watch() -> None:
        while not done.is_set():
            seen.append(served.engine.stats().batch_size)
            await asyncio.sleep(0.005)

    async def one(i: int) -> tuple[str, int]:
        stream = await aclient.chat.completions.create(
            model="any", messages=[{"role": "user", "content": f"Count to {i + 3}."}], temperature=0, max_tokens=16,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
        text, usage = "", 0
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        return text, usage

    watcher = asyncio.create_task(watch())
    results = await asyncio.gather(*(one(i) for i in range(8)))
    done.set()
    await watcher
    await aclient.close()
    assert all(usage == 16 and text for text, usage in results)
    assert max(seen) > 1, "8 concurrent streams never shared an engine step"


def test_stream_disconnect_aborts_and_frees_blocks(served: Served, client: openai.OpenAI) -> None:
    served.wait_idle()
    llm = served.engine.engine
    stream = client.chat.completions.create(model="any", messages=QUESTION, max_tokens=MAX_MODEL_LEN - 100,
                                            stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    assert len(llm.requests) == 1
    assert llm.block_manager.num_free_blocks < llm.block_manager.num_blocks
    stream.close()
    served.wait_idle(timeout=10)


def test_non_streaming_disconnect_aborts(served: Served) -> None:
    served.wait_idle()
    body = {"messages": QUESTION, "max_tokens": MAX_MODEL_LEN - 100, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{served.base}/chat/completions", json=body, timeout=httpx.Timeout(1.5, connect=5))
    served.wait_idle(timeout=10)


# ---- bad input: an OpenAI-style error with the right status, never a 500 ----

def _post(served: Served, path: str, content: bytes | str | dict[str, Any], **kw: Any) -> httpx.Response:
    data = json.dumps(content).encode() if isinstance(content, dict) else content
    return httpx.post(f"{served.base}{path}", content=data, headers={"content-type": "application/json"},
                      timeout=60, **kw)


def _chat(**fields: Any) -> dict[str, Any]:
    return {"messages": QUESTION, "max_tokens": 2, **fields}


BAD_CHAT = [
    (b'{"messages": [', 400),
    (b"", 400),
    (b"\xff\xfe not json", 400),
    (b"[1, 2]", 400),
    (b'"hello"', 400),
    ({}, 422),
    ({"messages": "hi"}, 422),
    ({"messages": []}, 422),
    ({"messages": [{"role": "user"}]}, 422),
    ({"messages": [{"role": "user", "content": 5}]}, 422),
    ({"messages": [{"content": "hi"}]}, 422),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400),
    (_chat(temperature="hot"), 422),
    (_chat(temperature=5), 422),
    (b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 422),
    (_chat(top_p=0), 422),
    (_chat(top_p=1.5), 422),
    (_chat(top_k=-5), 422),
    (_chat(top_k=2.5), 422),
    (_chat(min_p=2), 422),
    (_chat(max_tokens=0), 422),
    (_chat(max_tokens="10"), 422),
    (_chat(max_tokens=True), 422),
    (_chat(max_completion_tokens=-1), 422),
    (_chat(n=0), 422),
    (_chat(n=1000), 422),
    (_chat(stream="yes"), 422),
    (_chat(stream_options="usage"), 422),
    (_chat(stop=5), 422),
    (_chat(stop=["a", 3]), 422),
    (_chat(seed=1.5), 422),
    (_chat(seed=2**70), 422),
    (_chat(logprobs=3), 422),
    (_chat(logprobs=True, top_logprobs=50), 422),
    (_chat(top_logprobs=2), 422),
    (_chat(presence_penalty=3), 422),
    (_chat(repetition_penalty=0), 422),
    (_chat(ignore_eos="no"), 422),
    (_chat(stop_token_ids=["a"]), 422),
    (_chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400),
    (_chat(response_format={"type": "yaml"}), 400),
    (_chat(best_of=3), 400),
]


@pytest.mark.parametrize(("body", "status"), BAD_CHAT, ids=[str(i) for i in range(len(BAD_CHAT))])
def test_bad_chat_requests(served: Served, body: Any, status: int) -> None:
    r = _post(served, "/chat/completions", body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and "\n" not in error["message"] and "Traceback" not in r.text


BAD_COMPLETIONS = [
    ({}, 422),
    ({"prompt": 5}, 422),
    ({"prompt": []}, 422),
    ({"prompt": [-1, 2]}, 422),
    ({"prompt": [[1, 2], "x"]}, 422),
    ({"prompt": [10**9]}, 400),
    ({"prompt": "x", "echo": True}, 400),
    ({"prompt": "x", "suffix": "y"}, 400),
    ({"prompt": "x", "logprobs": 99}, 422),
    ({"prompt": "x", "logprobs": True}, 422),
    ({"prompt": ["a"] * 20, "n": 2}, 422),
]


@pytest.mark.parametrize(("body", "status"), BAD_COMPLETIONS, ids=[str(i) for i in range(len(BAD_COMPLETIONS))])
def test_bad_completion_requests(served: Served, body: Any, status: int) -> None:
    r = _post(served, "/completions", body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["message"]


def test_context_limits_are_400_with_openai_code(served: Served, client: openai.OpenAI) -> None:
    long_text = "hello " * (MAX_MODEL_LEN + 50)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="any", messages=[{"role": "user", "content": long_text}])
    assert e.value.code == "context_length_exceeded"
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="any", messages=QUESTION, max_tokens=MAX_MODEL_LEN)
    assert e.value.code == "context_length_exceeded" and "in the completion" in e.value.message
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="any", prompt=long_text)
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(model="any", messages=QUESTION, temperature=-1)
    served.wait_idle()


def test_body_over_the_limit_is_413(served: Served) -> None:
    big = json.dumps({"messages": [{"role": "user", "content": "x" * (5 * 2**20)}]}).encode()
    r = _post(served, "/chat/completions", big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks() -> Any:  # no Content-Length: the limit must hold while reading, too
        for _ in range(6):
            yield b" " * 2**20

    r = httpx.post(f"{served.base}/chat/completions", content=chunks(), headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 413


def test_unknown_route_and_method_are_json(served: Served) -> None:
    r = httpx.get(f"{served.base}/nope")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(f"{served.base}/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_api_key_required_except_health(served: Served) -> None:
    base = f"{served.auth_url}/v1"
    assert httpx.get(f"{served.auth_url}/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.get(f"{base}/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.post(f"{base}/chat/completions", json=_chat(), headers=headers).status_code == 401
    assert httpx.get(f"{served.auth_url}/metrics").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).models.list()
    good = openai.OpenAI(base_url=base, api_key=API_KEY, max_retries=0)
    assert good.chat.completions.create(model="any", messages=QUESTION, max_tokens=2).usage.completion_tokens >= 1


def test_metrics_page(served: Served) -> None:
    text = httpx.get(f"{served.url}/metrics").text
    assert "localllm:kv_cache_usage_perc" in text and "localllm:num_requests_running" in text
    assert 'localllm:decode_graphs_pending{model_name="' in text  # 0 once compiled, or when never compiled


def test_engine_survives_the_bad_requests(served: Served, client: openai.OpenAI) -> None:
    # after everything above, the engine still answers and holds no leftover request
    served.wait_idle()
    assert _greedy(client).choices[0].message.content
    assert threading.active_count() >= 3  # engine thread + two server threads still alive
