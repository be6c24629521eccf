"""Structured output through the official ``openai`` client against ``localllm serve`` on the
real default model: response_format (json_schema, json_object), ``chat.completions.parse``
with a pydantic model, vLLM's guided_* extras on both endpoints, constrained and free
requests batched in one engine, and schemas the grammar engine cannot compile."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Iterator
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from localllm.engine.async_engine import AsyncEngine
from localllm.engine.engine import EngineConfig, LLMEngine
from localllm.engine.guided import GrammarCompiler
from localllm.server.app import create_app
from localllm.server.serving import start_server_thread
from tests.server.conftest import Served

# nested object, enum, array; strings and arrays are bounded, so a reply always closes
# within max_tokens however the sampler wanders
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "kind": {"enum": ["city", "person", "animal", "food"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3},
        "origin": {
            "type": "object",
            "properties": {"country": {"type": "string", "maxLength": 16},
                           "year": {"type": "integer", "minimum": 0, "maximum": 2100}},
            "required": ["country", "year"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "kind", "tags", "origin"],
    "additionalProperties": False,
}
SUBJECTS = ["Paris", "a red fox", "Marie Curie", "sushi", "Tokyo", "an elephant", "pizza", "Albert Einstein",
            "Rome", "a penguin", "Cairo", "tacos", "Ada Lovelace", "a dolphin", "Lima", "croissants",
            "Nelson Mandela", "an owl", "Oslo", "ramen"]
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "entity", "schema": SCHEMA, "strict": True}}


@pytest.fixture
def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.base, api_key="unused", max_retries=0, timeout=300)


async def test_json_schema_validates_for_20_prompts_at_temperature_08(served: Served) -> None:
    aclient = openai.AsyncOpenAI(base_url=served.base, api_key="unused", max_retries=0, timeout=300)

    async def one(seed: int, subject: str) -> str:
        # max_tokens covers the schema's longest document: its strings hold 24 + 3 x 12 + 16
        # characters, and a character outside ASCII can take 2-3 byte tokens (a draw that
        # wandered into katakana once ran out at 160); seeded, so a failure reproduces
        r = await aclient.chat.completions.create(
            model="any", messages=[{"role": "user", "content": f"Describe {subject} as JSON."}],
            temperature=0.8, max_tokens=320, seed=seed, response_format=RESPONSE_FORMAT)  # type: ignore[arg-type]
        assert r.choices[0].finish_reason == "stop", r.choices[0]
        return r.choices[0].message.content or ""

    texts = await asyncio.gather(*(one(i, s) for i, s in enumerate(SUBJECTS)))
    await aclient.close()
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > 10, "temperature 0.8 over 20 prompts gave near-identical replies"


@pytest.fixture(scope="module")
def served_fp32(default_model_path) -> Iterator[Served]:
    """The default model in fp32: its greedy tokens do not depend on the batch around them
    (the default plan's kernels round differently at other batch sizes), so "the same as
    alone" tests the grammar and nothing else."""
    engine = AsyncEngine(LLMEngine(EngineConfig(model=str(default_model_path), device="cpu", dtype="float32",
                                                max_model_len=1024, chats=2)))
    server = start_server_thread(create_app(engine))
    try:
        yield Served(engine, server.url, server.url)
    finally:
        server.stop()
        engine.shutdown()


def test_constrained_and_free_requests_share_steps(served_fp32: Served) -> None:
    served = served_fp32
    client = openai.OpenAI(base_url=served.base, api_key="unused", max_retries=0, timeout=300)
    free_prompts = [f"Write one sentence about {s}." for s in SUBJECTS[:8]]

    def free(prompt: str) -> str:
        r = client.chat.completions.create(model="any", messages=[{"role": "user", "content": prompt}],
                                           temperature=0, max_tokens=8, extra_body={"ignore_eos": True})
        return r.choices[0].message.content or ""

    served.wait_idle()
    alone = [free(p) for p in free_prompts]

    llm = served.engine.engine
    mixed = threading.Event()
    done = threading.Event()

    def watch() -> None:  # a step runs every running sequence: both kinds running = one batch
        while not done.is_set():
            running = list(llm.scheduler.running)
            if any(s.params.guided for s in running) and not all(s.params.guided for s in running):
                mixed.set()
            done.wait(0.005)

    async def run_all() -> tuple[list[str], list[str]]:
        aclient = openai.AsyncOpenAI(base_url=served.base, api_key="unused", max_retries=0, timeout=300)

        async def constrained(i: int) -> str:
            r = await aclient.chat.completions.create(
                model="any", messages=[{"role": "user", "content": f"Describe {SUBJECTS[i]} as JSON."}],
                temperature=0.8, max_tokens=160, response_format=RESPONSE_FORMAT)  # type: ignore[arg-type]
            return r.choices[0].message.content or ""

        async def free_async(prompt: str) -> str:
            r = await aclient.chat.completions.create(model="any", messages=[{"role": "user", "content": prompt}],
                                                      temperature=0, max_tokens=8, extra_body={"ignore_eos": True})
            return r.choices[0].message.content or ""

        results = await asyncio.gather(*(constrained(i) for i in range(8)), *(free_async(p) for p in free_prompts))
        await aclient.close()
        return list(results[:8]), list(results[8:])

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        constrained_texts, free_texts = asyncio.run(run_all())
    finally:
        done.set()
        watcher.join()
    assert mixed.is_set(), "constrained and free requests never ran in the same engine step"
    assert served.engine.stats().max_batch_size_seen > 1
    assert free_texts == alone, "a free request's greedy tokens changed beside constrained ones"
    for text in constrained_texts:
        jsonschema.validate(json.loads(text), SCHEMA)


class Weather(BaseModel):
    city: str
    sky: Literal["sunny", "cloudy", "rainy"]
    high_c: int


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    r = client.chat.completions.parse(model="any", temperature=0, max_tokens=60, response_format=Weather,
                                      messages=[{"role": "user", "content": "The weather in Paris today?"}])
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Weather) and parsed.sky in ("sunny", "cloudy", "rainy")


def test_json_object_and_streaming(client: openai.OpenAI) -> None:
    kw = dict(model="any", messages=[{"role": "user", "content": "Give me a fruit."}], temperature=0, max_tokens=40)
    r = client.chat.completions.create(**kw, response_format={"type": "json_schema", "json_schema": {
        "name": "fruit", "schema": {"type": "object", "properties": {"fruit": {"enum": ["apple", "pear"]}},
                                    "required": ["fruit"]}}})
    whole = r.choices[0].message.content
    assert json.loads(whole)["fruit"] in ("apple", "pear")
    stream = client.chat.completions.create(**kw, stream=True, response_format={"type": "json_schema", "json_schema": {
        "name": "fruit", "schema": {"type": "object", "properties": {"fruit": {"enum": ["apple", "pear"]}},
                                    "required": ["fruit"]}}})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == whole
    obj = client.chat.completions.create(**{**kw, "max_tokens": 80}, response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":  # any object: unbounded, so only a finished one must parse
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:
        assert obj.choices[0].message.content.startswith("{")


def test_vllm_guided_extras_on_both_endpoints(client: openai.OpenAI) -> None:
    c = client.completions.create(model="any", prompt="The year the war ended:", temperature=0.9, seed=2,
                                  max_tokens=10, extra_body={"guided_regex": r"19[0-9]{2}"})
    assert re.fullmatch(r"19[0-9]{2}", c.choices[0].text) and c.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model="any", messages=[{"role": "user", "content": "Is water wet?"}],
                                       temperature=0, max_tokens=10, extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].message.content in ("yes", "no")
    c = client.completions.create(model="any", prompt="A small JSON object:", temperature=0, max_tokens=60,
                                  extra_body={"guided_json": SCHEMA["properties"]["origin"]})
    jsonschema.validate(json.loads(c.choices[0].text), SCHEMA["properties"]["origin"])
    g = client.completions.create(model="any", prompt="Answer:", temperature=0, max_tokens=10,
                                  extra_body={"guided_grammar": 'root ::= "red" | "green" | "blue"'})  # GBNF
    assert g.choices[0].text in ("red", "green", "blue")


@pytest.mark.parametrize("path,body,param,fragment", [
    ("chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "wat"}}}}}},
     "response_format", "cannot be compiled"),
    ("chat/completions", {"guided_regex": "(ab", "stream": True}, "guided_regex", "unclosed group"),
    ("completions", {"guided_json": {"type": "string", "pattern": "(?<=a)b"}}, "guided_json", "look-around"),
    ("chat/completions", {"response_format": {"type": "yaml"}}, "response_format", "not supported"),
    ("chat/completions", {"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "send one"),
    ("completions", {"guided_grammar": "root ::= (", "stream": True}, "guided_grammar", "grammar"),
    # issue 33: the grammar engine bounds a schema's size (a 50,000-value enum, 1 MB, is refused in ~0.1 s)
    ("chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "enum": [f"value-{i}" for i in range(50_000)]}}}}, "response_format", "schema too large"),
])
def test_grammars_that_cannot_compile_are_400(served: Served, path: str, body: dict, param: str,
                                              fragment: str) -> None:
    base = {"messages": [{"role": "user", "content": "hi"}]} if path.startswith("chat") else {"prompt": "hi"}
    r = httpx.post(f"{served.base}/{path}", json={**base, "max_tokens": 5, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and fragment in error["message"] and error["type"] == "invalid_request_error"
    served.wait_idle()


def test_the_grammar_tokenizer_is_built_with_the_app(served: Served) -> None:
    """Issue 33: llguidance builds its tokenizer holding the GIL for about a second; built by
    the first structured request, it stalled every stream running beside it (a 1.27 s gap in
    the probe). The app builds it before it takes a request."""
    llm = served.engine.engine
    used = llm.guided
    llm.guided = GrammarCompiler(llm.tokenizer, llm.runner.model.config.vocab_size)  # as a fresh engine has it
    try:
        assert llm.guided._llg_tokenizer is None
        create_app(served.engine)
        assert llm.guided._llg_tokenizer is not None
    finally:
        llm.guided = used


def test_bad_shapes_are_422(served: Served) -> None:
    for body, param in [({"response_format": "json"}, "response_format"),
                        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
                        ({"guided_json": "{not json"}, "guided_json"), ({"guided_choice": []}, "guided_choice")]:
        r = httpx.post(f"{served.base}/chat/completions",
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **body}, timeout=60)
        assert r.status_code == 422 and r.json()["error"]["param"] == param, r.text


async def test_remote_engine_sends_the_guided_fields(served: Served) -> None:
    from localllm.engine.sequence import SamplingParams
    from localllm.server.remote import RemoteEngine

    remote = RemoteEngine(served.base)
    origin = SCHEMA["properties"]["origin"]
    try:
        for params, check in [
            (SamplingParams(temperature=0.8, seed=4, max_tokens=60, guided_json=origin),
             lambda t: jsonschema.validate(json.loads(t), origin)),
            (SamplingParams(temperature=0.8, seed=4, max_tokens=10, guided_choice=["left", "right"]),
             lambda t: t in ("left", "right") or pytest.fail(t)),
        ]:
            outs = [o async for o in remote.generate([{"role": "user", "content": "Where?"}], params)]
            check(outs[-1].outputs[0].text)
    finally:
        await remote.aclose()
        remote.shutdown()
