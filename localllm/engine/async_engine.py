"""The engine on a background thread, for asyncio consumers (the TUI, the server).

The thread owns the ``LLMEngine`` exclusively: requests and aborts reach it through a queue,
and its outputs reach each consumer's event loop through one ``call_soon_threadsafe`` per loop
per step at most, never per token, so the step loop never waits on a consumer.

A step faster than ``stream_hold_s`` may hold a loop's outputs for one more step and send
both as one (their deltas joined): each hand-off wakes that loop, whose thread then needs the
GIL and a core that the step's OpenMP team was using (measured on 2 cores: ~0.25 ms of the
engine thread and ~0.2 ms of CPU per wake, against a 12 ms batch-1 step). A first token, a
finished output or an error is never held, and nothing is held past one step, or past the
arrival of a new request (whose prefill may make the next step long).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import queue
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from localllm.engine.engine import EngineStats, LLMEngine, Prompt, RequestOutput
from localllm.engine.outputs import joined
from localllm.engine.sequence import SamplingParams
from localllm.errors import LocalLLMError

if TYPE_CHECKING:
    from localllm.tokenizer import Tokenizer


T = TypeVar("T")

STATS_EVERY_S = 0.1  # while busy; when idle the snapshot is taken at once
STREAM_HOLD_S = 0.025  # outputs come at least 40 times a second; the TUI paints 20 times


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]
    sent_at: float = 0.0  # the engine thread's: when outputs last went to this stream


class EngineDeadError(RuntimeError):
    pass


class AsyncEngine:
    """Invariant: every request added is eventually answered on its stream by a finished
    output, an exception, or an abort; a stream whose consumer stops early aborts its request."""

    engine: LLMEngine  # set on the engine thread before the constructor returns

    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine], stream_hold_s: float = STREAM_HOLD_S) -> None:
        """``engine``: the engine, or better a function that builds it, which then runs on the
        engine thread (this waits for it and raises what it raises). On a CPU that matters:
        libgomp spins between parallel regions only while it manages no more threads than
        there are CPUs, and a thread that ran the load's parallel regions keeps its OpenMP
        workers for good, so stepping on another thread made every region of every step pay
        a futex wake (batch-1 decode 60-65 tok/s instead of 95-99, 2 cores).
        ``stream_hold_s``: see the module docstring; 0 sends every step's outputs at once."""
        self._stream_hold_s = stream_hold_s
        self._held: dict[str, RequestOutput] = {}  # the engine thread's: outputs held back one step
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._stopped = threading.Event()
        built = threading.Event()
        failed: list[BaseException] = []
        self._thread = threading.Thread(target=self._main, args=(engine, built, failed), name="localllm-engine",
                                        daemon=True)
        self._thread.start()
        built.wait()
        if failed:
            raise failed[0]
        self._stats = self.engine.stats()

    # ---- consumer side (any event loop) ----

    @property
    def tokenizer(self) -> Tokenizer:
        """The engine's; read-only after load, so safe from any thread."""
        return self.engine.tokenizer

    @property
    def sampling_defaults(self) -> dict[str, float | int]:
        """The model's sampling defaults (see ``LLMEngine.sampling_defaults``); fixed at load."""
        return self.engine.sampling_defaults

    def stats(self) -> EngineStats:
        """A snapshot taken when the engine last went idle, or at most ``STATS_EVERY_S`` ago
        while it steps, with whether a background compile or graph load still runs as of now
        (it ends while the engine idles); safe to read from any thread."""
        stats = self._stats
        runner = self.engine.runner
        compiling, preparing = runner.compiling, runner.preparing
        if stats.compiling == compiling and stats.preparing == preparing:
            return stats
        return dataclasses.replace(stats, compiling=compiling, preparing=preparing)

    async def generate(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yields one output per step that produced a token for this request; the last one has
        ``finished`` set. A request that fails raises its error here instead. Breaking out of
        the loop, or cancelling the task, aborts the request."""
        if self._stopped.is_set():
            raise EngineDeadError("the engine has stopped")
        params = params or SamplingParams()
        if params.guided:  # compile here, off the engine thread; the engine then finds it cached
            await asyncio.to_thread(self.engine.guided.compile, params)
        request_id = request_id or f"async-{next(self._ids)}"
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        self._inbox.put(("add", (request_id, prompt, params)))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._inbox.put(("abort", request_id))

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """``fn(engine)`` run on the engine thread between steps, for a benchmark that drives
        the model directly: on a CPU the thread that steps owns the only OpenMP team (see the
        constructor), and a second thread running parallel regions would slow both."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._inbox.put(("call", (fn, loop, future)))
        return await future

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    async def aclose(self) -> None:
        """Nothing to close per event loop (``RemoteEngine`` has connections there): the engine
        thread serves every loop until ``shutdown``."""

    def shutdown(self) -> None:
        """Stops the engine thread; a background compile still running is abandoned (its
        compiler processes end): wait for it first (``engine.runner.wait_compiled``) to keep it."""
        self._stopped.set()
        self._inbox.put(("stop", None))
        self._thread.join(timeout=10)
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.runner.stop_compile()

    # ---- engine thread ----

    def _main(self, engine: LLMEngine | Callable[[], LLMEngine], built: threading.Event,
              failed: list[BaseException]) -> None:
        try:
            self.engine = engine if isinstance(engine, LLMEngine) else engine()
        except BaseException as e:  # noqa: BLE001 - raised in the constructor's thread
            failed.append(e)
            return
        finally:
            built.set()
        self.engine.runner.keep_threads_bound()  # this thread only steps the engine
        self._run()

    def _run(self) -> None:
        engine = self.engine
        stats_at = 0.0
        while not self._stopped.is_set():
            kind = ""
            if not engine.has_unfinished() or not self._inbox.empty():  # empty(): no exception raised per step
                kind, payload = self._inbox.get()
            if kind and self._held:  # a new request's prefill may make the next step long
                self._deliver([], hold=False)
            while kind:
                self._handle(kind, payload)
                kind, payload = ("", None) if self._inbox.empty() else self._inbox.get()
            if self._stopped.is_set():
                break
            if not engine.has_unfinished():
                self._stats = engine.stats()
                continue
            try:
                outputs = engine.step()
            except Exception as e:  # a bug outside the step's own isolation: fail all, not the app
                traceback.print_exc()
                self._fail_all(RuntimeError(f"engine step failed: {type(e).__name__}: {e}"))
                continue
            now = time.monotonic()
            if now - stats_at >= STATS_EVERY_S or not engine.has_unfinished():  # ~30 us; a batch-1 step is ~12 ms
                self._stats, stats_at = engine.stats(), now
            self._deliver([(o.request_id, o if o.error is None else o.error) for o in outputs], hold=True)

    def _handle(self, kind: str, payload: object) -> None:
        if kind == "add":
            request_id, prompt, params = payload  # type: ignore[misc]
            try:
                self.engine.add_request(prompt, params, request_id)
            except (LocalLLMError, ValueError, TypeError) as e:
                self._deliver([(request_id, e)])
        elif kind == "call":
            fn, loop, future = payload  # type: ignore[misc]
            try:
                result = (True, fn(self.engine))
            except Exception as e:  # noqa: BLE001 - the caller's, raised where it awaits
                result = (False, e)
            try:
                loop.call_soon_threadsafe(_settle, future, result)
            except RuntimeError:  # that loop has closed
                pass
        elif kind == "abort":
            out = self.engine.abort_request(payload)  # type: ignore[arg-type]
            if out is not None:
                self._deliver([(out.request_id, out)])

    def _fail_all(self, error: BaseException) -> None:
        ids = list(self.engine.requests)
        for request_id in ids:
            self.engine.abort_request(request_id)
        self._deliver([(r, error) for r in ids])

    def _deliver(self, items: list[tuple[str, RequestOutput | BaseException]], hold: bool = False) -> None:
        """Sends ``items`` and every output held from the step before; with ``hold``, a loop
        whose items are all plain progress (no first token, no end, nothing held before) and
        that was sent to less than ``stream_hold_s`` ago keeps them for the next step."""
        now = time.monotonic()
        held, self._held = self._held, {}
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[str, _Stream, RequestOutput | BaseException]]] = {}
        urgent: set[asyncio.AbstractEventLoop] = set()
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is None:
                continue
            batch = by_loop.setdefault(stream.loop, [])
            earlier = held.pop(request_id, None)
            if earlier is not None:
                urgent.add(stream.loop)
                if isinstance(item, RequestOutput):
                    item = joined(earlier, item)
                else:  # the request failed: what it had produced goes out before the error
                    batch.append((request_id, stream, earlier))
            if (not isinstance(item, RequestOutput) or item.finished or len(item.outputs[0].token_ids) <= 1
                    or now - stream.sent_at >= self._stream_hold_s):
                urgent.add(stream.loop)
            batch.append((request_id, stream, item))
        for request_id, item in held.items():  # held last step, nothing new this step (preempted)
            stream = self._streams.get(request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((request_id, stream, item))
                urgent.add(stream.loop)
        for loop, batch in by_loop.items():
            if hold and loop not in urgent:
                self._held.update((request_id, item) for request_id, _, item in batch)  # type: ignore[misc]
                continue
            for _, stream, _ in batch:
                stream.sent_at = now
            try:
                loop.call_soon_threadsafe(_put_all, [(stream.queue, item) for _, stream, item in batch])
            except RuntimeError:  # that loop has closed; its consumers are gone
                pass


def _settle(future: asyncio.Future, result: tuple[bool, object]) -> None:
    if not future.done():  # the caller may have been cancelled meanwhile
        ok, value = result
        future.set_result(value) if ok else future.set_exception(value)  # type: ignore[arg-type]


def _put_all(batch: list[tuple[asyncio.Queue, RequestOutput | BaseException]]) -> None:
    for q, item in batch:
        q.put_nowait(item)
