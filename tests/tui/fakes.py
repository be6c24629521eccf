"""A stand-in engine with the AsyncEngine interface, for screens that need no model: fixed
stats make snapshots deterministic, and scripted replies make UI tests instant."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any


@dataclass
class FakeStats:
    model: str = "fake-model"
    precision: str = "bfloat16"
    device: str = "cpu"
    num_running: int = 0
    num_waiting: int = 0
    batch_size: int = 0
    kv_blocks_total: int = 100
    kv_blocks_used: int = 0
    prefix_cache_hit_tokens: int = 0
    max_batch_size_seen: int = 0

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total


@dataclass
class _Completion:
    text: str
    delta_text: str
    token_ids: list[int]
    finish_reason: str | None


@dataclass
class _Metrics:
    first_token_time: float | None = None
    last_token_time: float | None = None


@dataclass
class _Output:
    request_id: str
    outputs: list[_Completion]
    finished: bool
    num_cached_tokens: int = 0
    metrics: _Metrics = field(default_factory=_Metrics)


class FakeEngine:
    """Replies with ``reply`` one word per step, ``delay`` seconds apart. A prompt whose last
    message contains ``fail`` raises, the way an engine step failure reaches a consumer."""

    tokenizer = None

    def __init__(self, reply: str = "Hello there.", delay: float = 0.0, fail: str | None = None) -> None:
        self.reply = reply
        self.delay = delay
        self.fail = fail
        self._stats = FakeStats()
        self.prompts: list[Any] = []
        self.aborted: list[str] = []
        self.live: set[str] = set()
        self.replies: list[str] = []  # used first, in order, before ``reply``
        self.shut_down = False

    def stats(self) -> FakeStats:
        return self._stats

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def shutdown(self) -> None:
        self.shut_down = True

    async def generate(self, prompt: Any, params: Any = None, request_id: str | None = None) -> AsyncIterator[_Output]:
        self.prompts.append(prompt)
        rid = request_id or "fake"
        self.live.add(rid)
        finished = False
        try:
            last = prompt[-1]["content"] if isinstance(prompt, list) and prompt else str(prompt)
            if self.fail and self.fail in last:
                raise RuntimeError(f"engine step failed: {self.fail}")
            words = (self.replies.pop(0) if self.replies else self.reply).split(" ")
            text = ""
            for i, w in enumerate(words):
                if self.delay:
                    await asyncio.sleep(self.delay)
                delta = w if i == 0 else " " + w
                text += delta
                finished = i == len(words) - 1
                yield _Output(rid, [_Completion(text, delta, list(range(i + 1)), "stop" if finished else None)],
                              finished)
        finally:
            self.live.discard(rid)
            if not finished:
                self.aborted.append(rid)
