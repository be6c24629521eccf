"""Which requests the server lets into the engine, and how their outputs come back as one stream.

``ServerState`` is per app; its counters are written only on the app's event loop. An
``Admission`` holds the waiting slots of one HTTP request until each job's first output;
``fan_in`` merges the outputs of a request's jobs (n choices x prompts) into one stream.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from localllm.engine.async_engine import AsyncEngine
from localllm.engine.engine import RequestOutput
from localllm.engine.sequence import SamplingParams
from localllm.reasoning import ReasoningFormat, format_for
from localllm.server.protocol import APIError

RETRY_AFTER_S = 1  # a 503's Retry-After: the waiting queue moves every engine step

Job = tuple[list[int], SamplingParams, str]  # prompt ids, params, request id


@dataclass(slots=True)
class Limits:
    """Load limits, as vLLM's and llama-server's. None is off."""

    max_waiting: int | None = None  # engine requests admitted that have no first token yet
    request_timeout: float | None = None  # seconds from admission to the last token


@dataclass(slots=True)
class ServerState:
    """Per app. The counters are written only on the app's event loop."""

    engine: AsyncEngine
    model: str
    context_limit: int
    vocab_size: int  # the model's: the bound of top_k, stop_token_ids and prompt ids
    created: int
    token_text: Callable[[int], str]
    sampling_defaults: dict[str, float | int]  # for the fields a request omits
    limits: Limits = field(default_factory=Limits)
    # how the model marks reasoning in a reply (None: it does not; fixed when the app is made)
    reasoning: ReasoningFormat | None = None
    num_waiting: int = 0  # held by Admission objects
    num_rejected: int = 0  # 503s for --max-waiting
    num_timed_out: int = 0


class Admission:
    """The waiting slots one HTTP request holds: one per job, from admission until that job's
    first output. ``release`` gives back whatever is left; the response calls it when it ends,
    however it ends, so no slot outlives its request."""

    def __init__(self, state: ServerState, num_jobs: int) -> None:
        limit = state.limits.max_waiting
        if limit is not None and num_jobs > limit:  # no wait would help: not a 503
            raise APIError(400, f"this request makes {num_jobs} sequences (n x prompts), more than the server's "
                                f"--max-waiting {limit}", param="n", code="invalid_value")
        if limit is not None and state.num_waiting + num_jobs > limit:
            state.num_rejected += 1
            raise APIError(503, f"the server is busy: {state.num_waiting} requests are waiting for their first "
                                f"token (limit {limit}, --max-waiting); retry shortly",
                           type_="server_error", code="server_busy", headers={"Retry-After": str(RETRY_AFTER_S)})
        self.state = state
        self.pending = set(range(num_jobs))
        self.deadline = None if state.limits.request_timeout is None else (
            time.monotonic() + state.limits.request_timeout)
        state.num_waiting += num_jobs

    def started(self, k: int) -> None:
        if k in self.pending:
            self.pending.discard(k)
            self.state.num_waiting -= 1

    def release(self) -> None:
        self.state.num_waiting -= len(self.pending)
        self.pending.clear()

    def remaining(self) -> float | None:
        return None if self.deadline is None else max(self.deadline - time.monotonic(), 0.0)

    def timed_out(self) -> APIError:
        self.state.num_timed_out += 1
        return APIError(504, f"the request ran past the server's limit of {self.state.limits.request_timeout:g} s "
                             "(--request-timeout) and was stopped", type_="server_error", code="timeout")


def public_model_name(name: str) -> str:
    """The model's name as the routes show it: a catalog or hub id as it is, a local file or
    folder by its last component. The path itself would tell anyone who can reach /health the
    user's name and folder layout."""
    path = Path(name).expanduser()
    if path.is_absolute() or name.startswith((".", "~")) or path.exists():
        return path.resolve().name or name
    return name


def make_state(engine: AsyncEngine, model_name: str | None, reasoning_parser: str | None = None) -> ServerState:
    """``reasoning_parser``: vLLM's ``--reasoning-parser`` (a parser name, ``none``, or None/``auto``:
    the model's chat template and architecture decide)."""
    llm = engine.engine
    tokenizer = engine.tokenizer

    @lru_cache(maxsize=65536)
    def token_text(token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False)

    config = llm.runner.model.config
    return ServerState(engine, model_name or public_model_name(llm.model_name), llm.context_limit,
                       config.vocab_size, int(time.time()), token_text, dict(llm.sampling_defaults),
                       reasoning=format_for(tokenizer, config.architecture, reasoning_parser))


def fan_in(engine: AsyncEngine, jobs: list[Job]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs of several requests as one stream of (job index, output). Closing or
    cancelling the stream aborts every request still running."""
    if len(jobs) == 1:
        return _single(engine, jobs[0])
    return _many(engine, jobs)


async def _single(engine: AsyncEngine, job: Job) -> AsyncIterator[tuple[int, RequestOutput]]:
    async for out in engine.generate(*job):
        yield 0, out


async def _many(engine: AsyncEngine, jobs: list[Job]) -> AsyncIterator[tuple[int, RequestOutput]]:
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(k: int, job: Job) -> None:
        try:
            async for out in engine.generate(*job):
                queue.put_nowait((k, out))
            queue.put_nowait((k, None))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which picks the status
            queue.put_nowait((k, e))

    tasks = [asyncio.create_task(pump(k, job)) for k, job in enumerate(jobs)]
    try:
        remaining = len(jobs)
        while remaining:
            k, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield k, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
