"""One request never harms another: parameters checked against the model before anything
runs, no 500 for anything a client sends (fuzzed), the kept-alive connection still usable after
an error, and the load limits (--max-waiting, --request-timeout) on the real server."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from localllm.cli import main
from localllm.engine.async_engine import AsyncEngine
from localllm.engine.engine import EngineConfig, LLMEngine
from localllm.engine.sequence import SamplingParams
from localllm.server.app import create_app
from localllm.server.serving import start_server_thread
from localllm.server.remote import RemoteEngine
from tests.server.conftest import MAX_MODEL_LEN, Served

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
VOCAB = 49152  # the default model's


def _error(r: httpx.Response) -> dict[str, Any]:
    """The OpenAI error object of a response, checked for shape."""
    assert r.headers["content-type"].startswith("application/json"), r.text
    body = r.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"] and "\n" not in error["message"]
    assert "Traceback" not in r.text
    return error


def _keeps_connection(r: httpx.Response) -> None:
    assert r.headers.get("connection", "").lower() != "close", "the server dropped the kept-alive connection"


@pytest.fixture(scope="module")
def exact_engine(default_model_path: Path) -> Iterator[AsyncEngine]:
    """An fp32 engine, whose greedy tokens do not depend on what else is in the batch (bf16
    matmuls round differently at different batch sizes), for tests that compare tokens."""
    llm = LLMEngine(EngineConfig(model=str(default_model_path), dtype="float32", device="cpu",
                                 max_model_len=MAX_MODEL_LEN, chats=2))
    engine = AsyncEngine(llm)
    yield engine
    engine.shutdown()


@contextmanager
def _serving(engine: AsyncEngine, **limits: Any) -> Iterator[str]:
    """An app with ``limits`` on ``engine``; yields its /v1 URL."""
    server = start_server_thread(create_app(engine, **limits))
    try:
        yield f"{server.url}/v1"
    finally:
        server.stop()


def _wait_idle(engine: AsyncEngine, timeout: float = 20.0) -> None:
    Served(engine, "", "").wait_idle(timeout)


# ---- parameters against the model ----

async def test_top_k_over_the_vocabulary_fails_alone(exact_engine: AsyncEngine) -> None:
    """Issue 14, item 1: the bad request gets a 4xx naming top_k; 4 streams running beside it
    finish with the tokens they get alone."""
    with _serving(exact_engine) as base:
        await _top_k_beside_four_streams(base)
    await asyncio.to_thread(_wait_idle, exact_engine)


async def _top_k_beside_four_streams(base: str) -> None:
    aclient = openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)
    prompts = [[{"role": "user", "content": f"Count to {i + 3}."}] for i in range(4)]

    async def one(messages: list[dict[str, str]]) -> str:
        stream = await aclient.chat.completions.create(model="any", messages=messages, temperature=0, max_tokens=10,
                                                       stream=True, extra_body={"ignore_eos": True})
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    solo = [await one(m) for m in prompts]
    running = [asyncio.create_task(one(m)) for m in prompts]
    await asyncio.sleep(0.3)
    for top_k in (100000, VOCAB + 1):
        with pytest.raises(openai.UnprocessableEntityError) as e:
            await aclient.chat.completions.create(model="any", messages=QUESTION, temperature=1.0, max_tokens=4,
                                                  extra_body={"top_k": top_k})
        assert e.value.body["param"] == "top_k" and "vocabulary" in e.value.body["message"]
        assert e.value.body["type"] == "invalid_request_error"
    assert await asyncio.gather(*running) == solo
    # the bound is the vocabulary itself: top_k == vocab is every token, which is allowed
    ok = await aclient.chat.completions.create(model="any", messages=QUESTION, temperature=1.0, max_tokens=2,
                                               seed=1, extra_body={"top_k": VOCAB})
    assert ok.usage.completion_tokens >= 1
    await aclient.close()


@pytest.mark.parametrize(("field", "value", "param"), [
    ("stop_token_ids", [VOCAB], "stop_token_ids"),
    ("top_k", 10**400, "top_k"),
])
def test_model_bounds_name_the_field(served: Served, field: str, value: Any, param: str) -> None:
    r = httpx.post(f"{served.base}/chat/completions", json={"messages": QUESTION, "max_tokens": 2, field: value})
    assert r.status_code == 422
    assert _error(r)["param"] == param


def test_run_endpoint_top_k_over_the_vocabulary_is_one_line(served: Served, capsys: pytest.CaptureFixture[str]) -> None:
    """``localllm run --endpoint URL --top-k 100000 hi``: the server's refusal, on one line, exit 2."""
    assert main(["run", "--endpoint", served.base, "--top-k", "100000", "--max-tokens", "2", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("localllm: error:"), err
    assert "top_k" in err and "49152" in err, err


# ---- no 500s, and the connection survives the error ----

RAW_400S: list[tuple[bytes, str]] = [
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": ' + b"9" * 400 + b"}", "temperature"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "top_p": ' + b"9" * 400 + b"}", "top_p"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": Infinity}', "temperature"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "presence_penalty": -Infinity}', "presence_penalty"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "min_p": NaN}', "min_p"),
    (b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content"),
    (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
     "messages[0].content[0].text"),
    (b'{"messages": [{"role": "user", "content": "hi", "name": "x\\ud83d"}]}', "messages[0].name"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "stop": ["ok", "\\ud800"]}', "stop[1]"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "model": "\\ud800"}', "model"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "user": "\\udc80"}', "user"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"1": 5}}', "logit_bias"),
]


@pytest.mark.parametrize(("raw", "param"), RAW_400S, ids=[p for _, p in RAW_400S])
def test_request_problems_are_4xx_and_keep_the_connection(served: Served, raw: bytes, param: str) -> None:
    with httpx.Client(base_url=served.base, timeout=60) as client:
        r = client.post("/chat/completions", content=raw, headers={"content-type": "application/json"})
        assert 400 <= r.status_code < 500, r.text
        assert _error(r)["param"] == param
        _keeps_connection(r)
        ok = client.post("/chat/completions", json={"messages": QUESTION, "max_tokens": 1})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 1


def test_completion_prompt_problems(served: Served) -> None:
    with httpx.Client(base_url=served.base, timeout=60) as client:
        for prompt, param in (("a\ud800b", "prompt"), (["ok", "\udfff"], "prompt[1]")):
            r = client.post("/completions", content=json.dumps({"prompt": prompt, "max_tokens": 1}),
                            headers={"content-type": "application/json"})
            assert r.status_code == 400 and _error(r)["param"] == param
            _keeps_connection(r)
        r = client.post("/completions", json={"prompt": "Hello, \u0000\u200b\ufeff\U0001f600 world", "max_tokens": 1})
        assert r.status_code == 200, r.text  # odd but valid Unicode is a prompt like any other


def test_a_bug_answers_500_in_shape_and_keeps_the_connection(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizer = served.engine.tokenizer

    def broken(*args: Any, **kw: Any) -> list[int]:
        raise RuntimeError("an injected bug")

    with httpx.Client(base_url=served.base, timeout=60) as client:
        monkeypatch.setattr(type(tokenizer), "encode_chat", broken)
        r = client.post("/chat/completions", json={"messages": QUESTION, "max_tokens": 1})
        assert r.status_code == 500 and _error(r)["type"] == "server_error"
        _keeps_connection(r)
        monkeypatch.undo()
        ok = client.post("/chat/completions", json={"messages": QUESTION, "max_tokens": 1})
        assert ok.status_code == 200


# ---- the fuzz: mostly valid bodies, one field mutated ----

# What broke servers before: numbers past float range, NaN and infinities, lone surrogates,
# out-of-vocabulary ids, bools where numbers go, empty and nested containers.
_NASTY = [10**400, -(10**400), float("nan"), float("inf"), "\ud800", "a\udfffb", 2**64, 49153, 10**6, True,
          [], {"a": {"b": [None]}}]
_junk_scalar = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.sampled_from(["\x00", "\u202e", "\ufeff", "🦀", "NaN", "1e999", "", -1, 0, 49151, 49152, 2**63]),
)
_random_junk = st.recursive(_junk_scalar, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)), max_leaves=8)
_junk = st.one_of(st.sampled_from(_NASTY), st.sampled_from(_NASTY), st.sampled_from(_NASTY), _random_junk,
                  _random_junk)

_FIELDS = ["temperature", "top_p", "top_k", "min_p", "max_tokens", "max_completion_tokens", "n", "seed", "stop",
           "stop_token_ids", "stream", "stream_options", "logprobs", "top_logprobs", "presence_penalty",
           "frequency_penalty", "repetition_penalty", "ignore_eos", "user", "model", "logit_bias", "best_of",
           "response_format", "tools", "echo", "suffix", "prompt", "messages", "zzz_unknown"]
_LENGTH_FIELDS = ("max_tokens", "max_completion_tokens")


def _base(endpoint: str, max_tokens: int) -> dict[str, Any]:
    if endpoint == "chat":
        return {"model": "any", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": max_tokens,
                "temperature": 0}
    return {"model": "any", "prompt": "The sky is", "max_tokens": max_tokens, "temperature": 0}


@st.composite
def _mutated(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    endpoint = draw(st.sampled_from(["chat", "completions"]))
    body = _base(endpoint, draw(st.integers(1, 2)))
    where = draw(st.sampled_from(["field", "field", "field", "message", "nested"]))
    value = draw(_junk)
    if where == "message" and endpoint == "chat":
        key = draw(st.sampled_from(["role", "content", "name", "tool_calls"]))
        body["messages"] = [{**body["messages"][0], key: value}]
    elif where == "nested":
        key = draw(st.sampled_from(["stream_options", "response_format", "messages", "prompt"]))
        body[key] = {"include_usage": value} if key == "stream_options" else (
            {"type": value} if key == "response_format" else [value])
    else:
        key = draw(st.sampled_from(_FIELDS))
        body[key] = value
    for k in _LENGTH_FIELDS:  # keep valid requests cheap: a valid length stays at 1-2 tokens
        if isinstance(body.get(k), int) and not isinstance(body[k], bool) and body[k] > 2:
            body[k] = 2
    if isinstance(body.get("n"), int) and not isinstance(body["n"], bool) and body["n"] > 4:
        body["n"] = 4
    if isinstance(body.get("prompt"), list) and len(body["prompt"]) > 4:
        body["prompt"] = body["prompt"][:4]
    return endpoint, body


@pytest.fixture(scope="module")
def fuzz_client(served: Served) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served.base, timeout=60) as client:
        yield client


@settings(max_examples=150, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=_mutated())
def test_fuzz_both_endpoints_never_500(fuzz_client: httpx.Client, case: tuple[str, dict[str, Any]]) -> None:
    endpoint, body = case
    path = "/chat/completions" if endpoint == "chat" else "/completions"
    r = fuzz_client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code < 500, (body, r.text)
    _keeps_connection(r)
    if r.status_code >= 400:
        assert _error(r)["type"] == "invalid_request_error"
    elif r.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert not any('"error"' in e for e in events[:-1]), r.text
    else:
        assert r.json()["choices"], r.text


def test_fuzz_left_the_engine_clean(served: Served) -> None:
    served.wait_idle()


# ---- load limits ----

def _metric(base: str, name: str) -> float:
    text = httpx.get(f"{base.removesuffix('/v1')}/metrics").text
    line = next(ln for ln in text.splitlines() if ln.startswith(f"localllm:{name}{{"))
    return float(line.rsplit(" ", 1)[1])


def test_max_waiting_answers_503_with_retry_after(exact_engine: AsyncEngine) -> None:
    """Two long prefills hold the two waiting slots; a third request is refused at once with
    503 and Retry-After, and gets in once they have their first tokens."""
    import threading

    long = {"prompt": list(range(300, 300 + MAX_MODEL_LEN - 40)), "max_tokens": 1}
    with _serving(exact_engine, max_waiting=2) as base, httpx.Client(base_url=base, timeout=120) as client:
        assert _metric(base, "max_waiting") == 2
        r = client.post("/chat/completions", json={"messages": QUESTION, "max_tokens": 2, "n": 3})
        assert r.status_code == 400 and _error(r)["param"] == "n"  # can never fit: waiting would not help
        statuses: list[int] = []
        holders = [threading.Thread(target=lambda i=i: statuses.append(httpx.post(
            f"{base}/completions", json={**long, "prompt": long["prompt"][i:]}, timeout=120).status_code))
            for i in range(2)]
        for t in holders:
            t.start()
        deadline = time.monotonic() + 60
        while _metric(base, "server_requests_waiting") < 2:  # both admitted, neither has a token yet
            assert time.monotonic() < deadline and all(t.is_alive() for t in holders)
            time.sleep(0.005)
        r = client.post("/chat/completions", json={"messages": QUESTION, "max_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        error = _error(r)
        assert error["code"] == "server_busy" and "--max-waiting" in error["message"]
        _keeps_connection(r)
        for t in holders:
            t.join()
        assert statuses == [200, 200]
        ok = client.post("/chat/completions", json={"messages": QUESTION, "max_tokens": 2, "n": 2})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 2
        assert _metric(base, "requests_rejected_total") == 1
        assert _metric(base, "server_requests_waiting") == 0
    with _serving(exact_engine) as base:
        assert _metric(base, "max_waiting") == float("inf")  # off unless asked


async def test_remote_engine_waits_out_a_busy_server(exact_engine: AsyncEngine) -> None:
    """``--endpoint`` clients (run, the TUI) retry after a 503's Retry-After, as OpenAI's do."""
    long = {"prompt": list(range(300, 300 + MAX_MODEL_LEN - 40)), "max_tokens": 1}
    with _serving(exact_engine, max_waiting=1) as base:
        remote = RemoteEngine(base)
        holder = asyncio.ensure_future(asyncio.to_thread(httpx.post, f"{base}/completions", json=long, timeout=120))
        while await asyncio.to_thread(_metric, base, "server_requests_waiting") < 1:
            assert not holder.done()
        outs = [o async for o in remote.generate(QUESTION, SamplingParams(temperature=0, max_tokens=4))]
        assert outs[-1].finished and outs[-1].outputs[0].text
        assert await asyncio.to_thread(_metric, base, "requests_rejected_total") >= 1
        assert (await holder).status_code == 200
        await remote.aclose()
        remote.shutdown()


def test_request_timeout_stops_the_request_and_frees_its_blocks(exact_engine: AsyncEngine) -> None:
    long = {"messages": QUESTION, "max_tokens": MAX_MODEL_LEN - 100, "ignore_eos": True, "temperature": 0}
    with _serving(exact_engine, request_timeout=1.0) as base, httpx.Client(base_url=base, timeout=60) as client:
        assert _metric(base, "request_timeout_seconds") == 1
        r = client.post("/chat/completions", json=long)
        assert r.status_code == 504
        error = _error(r)
        assert error["code"] == "timeout" and error["type"] == "server_error" and "--request-timeout" in error["message"]
        _keeps_connection(r)
        _wait_idle(exact_engine, 10)
        with client.stream("POST", "/chat/completions", json={**long, "stream": True}) as s:
            assert s.status_code == 200  # the headers went out before the time ran out: the error comes in-band
            events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "timeout"
        assert any(json.loads(e).get("choices") for e in events[:-2])  # it streamed until then
        _wait_idle(exact_engine, 10)
        assert _metric(base, "requests_timed_out_total") == 2
        ok = client.post("/chat/completions", json={**long, "max_tokens": 2})
        assert ok.status_code == 200


# ---- the soak ----

SOAK_CLIENTS = 64
SOAK_S = 10.0  # of mixed load; the 64 clients then each finish one good request at least (_soak_client)
SOAK_MAX_ACTIONS = 40  # per client: bounded in count as well as in time
SOAK_TOPICS = ["the sea", "bread", "chess", "the moon"]
SOAK_BAD: list[bytes] = [
    b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}',
    b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "top_k": 1000000}',
    b'{"messages": [{"role": "user", "content": "hi"}], "temperature": ' + b"9" * 400 + b"}",
    b'{"messages": [{"role": "user", "content": "hi"}], "top_p": NaN}',
    b'{"prompt": [1, 2, 99999999], "max_tokens": 2}',
    b'{"prompt": "x", "stop_token_ids": [49152], "max_tokens": 2}',
    b'{"messages": "hi"}',
    b'{"messages": [',
]


class _Tally:
    def __init__(self) -> None:
        self.good = self.busy = self.dropped = self.bad = 0


async def _good_request(client: httpx.AsyncClient, endpoint: str, topic: str, stream: bool, tally: _Tally) -> str:
    """The greedy text of one request, retrying after a 503 as Retry-After says."""
    path, body = _soak_body(endpoint, topic)
    while True:
        if stream:
            async with client.stream("POST", path, json={**body, "stream": True}) as r:
                if r.status_code == 503:
                    await r.aread()
                else:
                    assert r.status_code == 200, await r.aread()
                    text = ""
                    async for line in r.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            event = json.loads(line[6:])
                            assert "error" not in event, event
                            for c in event["choices"]:
                                text += c["delta"].get("content") or "" if endpoint == "chat" else c["text"]
                    return text
        else:
            r = await client.post(path, json=body)
            if r.status_code != 503:
                assert r.status_code == 200, r.text
                c = r.json()["choices"][0]
                return c["message"]["content"] if endpoint == "chat" else c["text"]
        tally.busy += 1
        assert r.headers["retry-after"] == "1"
        await asyncio.sleep(float(r.headers["retry-after"]))


def _soak_body(endpoint: str, topic: str) -> tuple[str, dict[str, Any]]:
    if endpoint == "chat":
        return "/chat/completions", {"messages": [{"role": "user", "content": f"Write one line about {topic}."}],
                                     "max_tokens": 8, "temperature": 0}
    return "/completions", {"prompt": f"A short poem about {topic}:", "max_tokens": 8, "temperature": 0}


async def _soak_client(i: int, base: str, solo: dict[tuple[str, str], str], until: float, tally: _Tally,
                       one_good: bool = True) -> None:
    import random

    rng = random.Random(i)
    loop = asyncio.get_running_loop()
    good = 0
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        for _ in range(SOAK_MAX_ACTIONS):
            # past the deadline a client still finishes one good request if it has none yet:
            # every one of the 64 gets its solo text back, however slow the machine
            if loop.time() >= until and (good or not one_good):
                break
            action = 1.0 if loop.time() >= until else rng.random()
            endpoint, topic = rng.choice(["chat", "completions"]), rng.choice(SOAK_TOPICS)
            if action < 0.15:  # a bad request: a 4xx, and it must not disturb anyone
                r = await client.post(f"/{endpoint.replace('chat', 'chat/completions')}",
                                      content=rng.choice(SOAK_BAD), headers={"content-type": "application/json"})
                assert r.status_code in (400, 422), r.text
                tally.bad += 1
            elif action < 0.30:  # a client that goes away mid-request
                path, body = _soak_body(endpoint, topic)
                if rng.random() < 0.5:
                    async with client.stream("POST", path, json={**body, "stream": True}) as r:
                        async for _ in r.aiter_bytes():
                            break
                else:
                    try:
                        await client.post(path, json=body, timeout=rng.uniform(0.05, 0.5))
                    except httpx.TimeoutException:
                        pass
                tally.dropped += 1
            else:
                text = await _good_request(client, endpoint, topic, rng.random() < 0.5, tally)
                assert text == solo[endpoint, topic], (endpoint, topic, text)
                tally.good += 1
                good += 1


def _rss() -> int:
    import ctypes
    import gc

    import psutil

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # hands freed heap back, as the loader does
    except (OSError, AttributeError):
        pass
    return psutil.Process().memory_info().rss


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_soak_64_clients_with_disconnects_and_bad_requests(exact_engine: AsyncEngine) -> None:
    """64 clients for SOAK_S seconds against a server with --max-waiting 16 (and each until it
    has one good request done): bad requests and hang-ups mixed in, every good request retried
    through 503s until it completes with its solo greedy text; afterwards no request is left,
    every KV block is free and RSS is back."""
    llm = exact_engine.engine
    with _serving(exact_engine, max_waiting=16, request_timeout=120) as base:
        async with httpx.AsyncClient(base_url=base, timeout=120) as client:
            solo = {(e, t): await _good_request(client, e, t, False, _Tally())
                    for e in ("chat", "completions") for t in SOAK_TOPICS}
        loop = asyncio.get_running_loop()

        async def round_of(seconds: float, offset: int, one_good: bool = True) -> _Tally:
            tally = _Tally()
            until = loop.time() + seconds
            await asyncio.gather(*(_soak_client(offset + i, base, solo, until, tally, one_good)
                                   for i in range(SOAK_CLIENTS)))
            return tally

        await round_of(4.0, 1000, one_good=False)  # warms the allocators and caches that a steady state keeps
        await asyncio.to_thread(_wait_idle, exact_engine, 30)
        rss_before = _rss()
        rejected_before = _metric(base, "requests_rejected_total")
        tally = await round_of(SOAK_S, 0)
        await asyncio.to_thread(_wait_idle, exact_engine, 30)
        assert _metric(base, "server_requests_waiting") == 0
        assert _metric(base, "requests_rejected_total") - rejected_before >= tally.busy
    rss_after = _rss()
    assert not llm.requests and llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    assert tally.good >= SOAK_CLIENTS and tally.bad and tally.dropped and tally.busy, vars(tally)
    assert rss_after <= rss_before * 1.03, (rss_before, rss_after)
