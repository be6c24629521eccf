"""The chat's one engine: lent by the caller, or built by a factory on a thread of its own (and
built again on a model switch), and the state of that load.

``EngineHost`` is the only writer of the engine fields. Everything but the loading thread runs
on the app's event loop; the thread hands its result back through ``post`` (the app's
``call_from_thread``), and only the latest load's engine is kept: an older one, or one that
arrives after ``close``, is shut down. Textual-free: the app shows what happens through the
``on_loaded`` and ``on_failed`` callbacks.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from contextlib import suppress

from localllm.errors import LocalLLMError
from localllm.tui.backend import ChatEngine, EngineFactory
from localllm.tui.conversation import describe

# calls a function on the app's event loop from another thread; False once the app has gone
Post = Callable[..., bool]


class EngineHost:
    def __init__(
        self, engine: ChatEngine | None, factory: EngineFactory | None, *, endpoint: str | None,
        model_request: str | None, post: Post, on_loaded: Callable[[ChatEngine], None],
        on_failed: Callable[[str], None],
    ) -> None:
        """``engine``: a ready engine, lent (never shut down here). ``factory``: builds one in a
        thread; the host owns what it builds. ``endpoint``: the factory connects to this server
        (remote mode)."""
        self.engine = engine
        self.factory = factory
        self.endpoint = endpoint
        self.model_request = model_request
        self.owns_engine = False
        self.error: str | None = None
        self.load_failure: str | None = None  # the last load failed and none succeeded since: exit code 2
        self.loading = False
        self.load_progress: tuple[str, int, int] = ("starting", 0, 0)
        self._load_id = 0  # the latest load's number: an older load's engine is shut down, not used
        self._closed = False  # the app has gone: an engine that arrives now is shut down, not used
        self._ready = asyncio.Event()
        if engine is not None:
            self._ready.set()
        self._post = post
        self._on_loaded = on_loaded
        self._on_failed = on_failed

    @property
    def model_name(self) -> str:
        if self.engine is not None:
            with suppress(Exception):  # a remote engine that lost its server: fall through
                return str(self.engine.stats().model)
        return self.model_request or ""

    def served_models(self) -> list[str]:
        return list(self.engine.served_models) if self.engine is not None else []

    async def wait(self) -> ChatEngine:
        """The engine once loaded; raises LocalLLMError (for the user) if there is none."""
        if self.engine is None and not self.loading:
            if self.endpoint is not None:
                raise LocalLLMError(self.error or f"not connected to {self.endpoint}: ctrl+p, then Reconnect")
            raise LocalLLMError(self.error or "no model is loaded: ctrl+p, then Pull model or Switch model")
        await self._ready.wait()
        if self.engine is None:
            raise LocalLLMError(self.error or "no model is loaded")
        return self.engine

    def set_error(self, message: str) -> None:
        """Why there is no engine, for the status bar and for tabs that wait for one."""
        self.error = message

    def load(self, model: str | None) -> None:
        """Starts building ``model``'s engine with the factory (which must be set)."""
        assert self.factory is not None
        self.model_request = model
        self.error = None
        self.loading = True
        self.load_progress = ("starting", 0, 0)
        if self._ready.is_set():
            self._ready = asyncio.Event()
        self._load_id += 1
        # A daemon thread of its own, not a Textual thread worker: the app's exit waits for its
        # workers' threads, and a load can take minutes (a first start builds kernels), so
        # ctrl+q did nothing until it ended. The process exits without joining this thread.
        threading.Thread(target=self._load_in_thread, args=(model, self._load_id), name="localllm-load",
                         daemon=True).start()

    async def unload(self) -> None:
        """Drops the engine before a switch; one the host built is shut down."""
        old, self.engine = self.engine, None
        self._ready = asyncio.Event()
        if old is not None and self.owns_engine:
            await asyncio.to_thread(old.shutdown)
        del old

    def closing(self) -> None:
        """The app is going: an engine that a load delivers from now on is shut down, not used."""
        self._closed = True

    async def shutdown(self) -> None:
        """Shuts down the engine the host built (a lent one is left alone)."""
        if self.engine is not None and self.owns_engine:
            engine, self.engine = self.engine, None
            await asyncio.to_thread(engine.shutdown)

    def _on_progress(self, stage: str, done: int, total: int) -> None:
        # Called from the loading thread, often (once per tensor): store only; the status
        # timer paints it.
        self.load_progress = (stage, done, total)

    def _load_in_thread(self, model: str | None, load_id: int) -> None:
        assert self.factory is not None
        try:
            engine = self.factory(model, self._on_progress)
        except BaseException as e:  # noqa: BLE001 - shown in the app, which goes on without a model
            if load_id == self._load_id:
                self._post(self._failed, e)
            return
        if load_id != self._load_id or not self._post(self._loaded, engine) or self.engine is not engine:
            engine.shutdown()  # a later load replaced this one, or the app quit while loading

    def _loaded(self, engine: ChatEngine) -> None:
        if self._closed:  # the app quit while it loaded: the loading thread shuts it down
            return
        self.engine = engine
        self.owns_engine = True
        self.loading = False
        self.load_failure = None
        self._ready.set()
        self._on_loaded(engine)

    def _failed(self, e: BaseException) -> None:
        self.loading = False
        what = "the connection failed" if self.endpoint else "the model failed to load"
        self.error = self.load_failure = f"{what}: {describe(e)}"
        self._ready.set()
        self._on_failed(self.error)
