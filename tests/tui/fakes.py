"""A stand-in engine with the ChatEngine interface, for screens that need no model: fixed
stats make snapshots deterministic, and scripted replies make UI tests instant.

It yields the engine's own ``RequestOutput``/``EngineStats`` types and keeps the engine's
rules that the chat relies on: one token per word here, the context limit (a prompt that
does not fit is refused, a reply that reaches it is cut with "length"), ``max_tokens``, and
aborting a request whose stream is closed early."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from localllm.engine.engine import CompletionOutput, EngineStats, RequestOutput
from localllm.engine.outputs import RequestMetrics
from localllm.engine.sequence import SamplingParams
from localllm.errors import LocalLLMError

TEMPLATE_TOKENS = 4  # per message, like a chat template's role markers


def fake_stats(**changes: Any) -> EngineStats:
    values: dict[str, Any] = dict(
        model="fake-model", precision="bfloat16", device="cpu", num_running=0, num_waiting=0, batch_size=0,
        batch_tokens=0, kv_blocks_total=100, kv_blocks_used=0, kv_blocks_cached=0, step_time_s=0.0,
        generation_tokens_per_s=0.0, num_preemptions=0, prefix_cache_hit_tokens=0, prompt_tokens=0,
        max_batch_size_seen=0,
    )
    values.update(changes)
    return EngineStats(**values)


def prompt_tokens(prompt: Any) -> int:
    if isinstance(prompt, str):
        return len(prompt.split())
    if prompt and isinstance(prompt[0], int):
        return len(prompt)
    return sum(len(m["content"].split()) + TEMPLATE_TOKENS for m in prompt)


class FakeEngine:
    """Replies with ``reply`` one word per step, ``delay`` seconds apart. A prompt whose last
    message contains ``fail`` raises, the way an engine step failure reaches a consumer.
    ``usage=False``: no prompt count, as ``RemoteEngine`` yields for a server that sends no
    usage."""

    tokenizer = None
    reasoning = None  # replies are answers only

    def __init__(self, reply: str = "Hello there.", delay: float = 0.0, fail: str | None = None,
                 max_model_len: int | None = 4096, sampling_defaults: dict[str, float | int] | None = None,
                 usage: bool = True) -> None:
        self.usage = usage
        self.reply = reply
        self.delay = delay
        self.fail = fail
        self.max_model_len = max_model_len
        self.sampling_defaults: dict[str, float | int] = dict(sampling_defaults or {})
        self.served_models: list[str] = []
        self._stats = fake_stats()
        self.prompts: list[Any] = []
        self.params: list[SamplingParams] = []
        self.aborted: list[str] = []
        self.live: set[str] = set()
        self.replies: list[str] = []  # used first, in order, before ``reply``
        self.shut_down = False

    def stats(self) -> EngineStats:
        return self._stats

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def shutdown(self) -> None:
        self.shut_down = True

    async def generate(self, prompt: Any, params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        params = params or SamplingParams()
        self.prompts.append(prompt)
        self.params.append(params)
        rid = request_id or "fake"
        n_prompt = prompt_tokens(prompt)
        if self.max_model_len is not None and n_prompt >= self.max_model_len:
            raise LocalLLMError(f"the prompt is {n_prompt} tokens but the context limit is {self.max_model_len}")
        self.live.add(rid)
        finished = False
        metrics = RequestMetrics(time.monotonic())
        try:
            last = prompt[-1]["content"] if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict) \
                else str(prompt)
            if self.fail and self.fail in last:
                raise RuntimeError(f"engine step failed: {self.fail}")
            words = (self.replies.pop(0) if self.replies else self.reply).split(" ")
            text = ""
            for i, w in enumerate(words):
                if self.delay:
                    await asyncio.sleep(self.delay)
                delta = w if i == 0 else " " + w
                text += delta
                n = i + 1
                now = time.monotonic()
                metrics.first_token_time = metrics.first_token_time or now
                metrics.last_token_time = now
                reason = None
                if i == len(words) - 1:
                    reason = "stop"
                if params.max_tokens is not None and n >= params.max_tokens:
                    reason = "length"
                if self.max_model_len is not None and n_prompt + n >= self.max_model_len:
                    reason = "length"
                finished = reason is not None
                completion = CompletionOutput(0, (text,), list(range(n)), None, None, reason, delta_text=delta,
                                              delta_token_ids=[i])
                yield RequestOutput(rid, None, [0] * n_prompt if self.usage else [], [completion], finished, 0,
                                    metrics)
                if finished:
                    return
        finally:
            self.live.discard(rid)
            if not finished:
                self.aborted.append(rid)
