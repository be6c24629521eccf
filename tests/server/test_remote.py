"""The remote backend against a real ``localllm serve``: ``RemoteEngine`` (the interface the
TUI and bench use) and ``localllm run --endpoint``."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys

import pytest

from localllm.cli import main
from localllm.engine.engine import RequestOutput
from localllm.engine.sequence import SamplingParams
from localllm.errors import LocalLLMError
from localllm.server.remote import RemoteEngine, normalize_endpoint
from tests.server.conftest import API_KEY, MAX_MODEL_LEN, Served

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


async def _collect(engine: RemoteEngine, prompt: object, params: SamplingParams, rid: str | None = None) -> list[RequestOutput]:
    return [out async for out in engine.generate(prompt, params, rid)]  # type: ignore[arg-type]


def test_normalize_endpoint() -> None:
    assert normalize_endpoint("localhost:8000") == "http://localhost:8000/v1"
    assert normalize_endpoint("http://h:11434/") == "http://h:11434/v1"
    assert normalize_endpoint("https://h/v1/chat/completions") == "https://h/v1"
    assert normalize_endpoint("http://h:8000/api/openai/v1") == "http://h:8000/api/openai/v1"
    with pytest.raises(LocalLLMError):
        normalize_endpoint("ftp://h")


async def test_remote_chat_matches_the_local_engine(served: Served) -> None:
    remote = RemoteEngine(served.base)
    assert remote.tokenizer is None and remote.max_model_len == MAX_MODEL_LEN
    assert remote.sampling_defaults == served.engine.sampling_defaults == {"temperature": 0.2, "top_p": 0.5}
    local = [o async for o in served.engine.generate(QUESTION, GREEDY)]
    outs = await _collect(remote, QUESTION, GREEDY)  # second: the system prompt is cached by now
    final = outs[-1]
    assert final.finished and all(not o.finished for o in outs[:-1])
    assert final.outputs[0].text == local[-1].outputs[0].text == "".join(o.outputs[0].delta_text for o in outs)
    assert final.outputs[0].finish_reason == local[-1].outputs[0].finish_reason
    # token ids are unknown remotely; the counts come from the server's usage
    assert len(final.outputs[0].token_ids) == len(local[-1].outputs[0].token_ids)
    assert len(final.prompt_token_ids) == len(local[-1].prompt_token_ids)
    assert final.num_cached_tokens >= 16
    m = final.metrics
    assert m.first_token_time is not None and m.ttft is not None and m.ttft > 0
    stats = remote.stats()
    assert stats.device == "remote" and stats.model == served.model
    assert stats.prompt_tokens == len(final.prompt_token_ids)
    await remote.aclose()
    remote.shutdown()


async def test_remote_raw_prompt_uses_completions(served: Served) -> None:
    remote = RemoteEngine(served.url, model=served.model)
    outs = await _collect(remote, "The sky is", SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert outs[-1].outputs[0].finish_reason == "length" and len(outs[-1].outputs[0].token_ids) == 5
    await remote.aclose()


async def test_remote_abort_and_cancel_free_the_server(served: Served) -> None:
    remote = RemoteEngine(served.base)
    long = SamplingParams(temperature=0.0, max_tokens=MAX_MODEL_LEN - 100, ignore_eos=True)
    outs = []
    async for out in remote.generate(QUESTION, long, "r1"):
        outs.append(out)
        if len(outs) == 2:
            remote.abort("r1")
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert remote.stats().num_running == 0
    await asyncio.to_thread(served.wait_idle, 10)
    # breaking out of the loop closes the connection: the server aborts too
    async for _ in remote.generate(QUESTION, long):
        break
    await asyncio.to_thread(served.wait_idle, 10)
    await remote.aclose()


async def test_remote_errors_are_one_line(served: Served) -> None:
    remote = RemoteEngine(served.base)
    with pytest.raises(LocalLLMError, match="context length"):
        await _collect(remote, QUESTION, SamplingParams(max_tokens=MAX_MODEL_LEN * 2))
    await remote.aclose()
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(LocalLLMError, match="cannot reach"):
        RemoteEngine(f"http://127.0.0.1:{port}")
    with pytest.raises(LocalLLMError, match="api-key"):
        RemoteEngine(served.auth_url, api_key="wrong")
    keyed = RemoteEngine(served.auth_url, api_key=API_KEY)
    assert (await _collect(keyed, QUESTION, SamplingParams(max_tokens=2)))[-1].finished
    await keyed.aclose()


def test_run_endpoint_streams_text(served: Served, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--endpoint", served.base, "What is the capital of France?", "--temperature", "0",
                 "--max-tokens", "12"]) == 0
    assert "Paris" in capsys.readouterr().out


def test_run_endpoint_refused_key_is_one_line(served: Served, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--endpoint", served.auth_url, "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("localllm: error:") and "api-key" in err


def test_run_endpoint_json_in_a_subprocess(served: Served) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "localllm.cli", "run", "--endpoint", served.auth_url, "--api-key", API_KEY,
         "Say hello.", "--max-tokens", "6", "--temperature", "0", "--json"],
        check=False, capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["device"] == "remote" and report["model"] == served.model
    assert 0 < report["completion_tokens"] <= 6 and report["prompt_tokens"] > 0
    assert report["timings"]["ttft_s"] > 0

