"""One real engine for every server test, behind two in-process servers on loopback: one open
and one that requires an API key. In-process, so tests can read the engine's state (batch
sizes, free KV blocks) directly."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from localllm.engine.async_engine import AsyncEngine
from localllm.engine.engine import EngineConfig, LLMEngine
from localllm.server.app import create_app
from localllm.server.serving import RunningServer, start_server_thread

API_KEY = "test-key-123"
MAX_MODEL_LEN = 1024


@dataclass
class Served:
    engine: AsyncEngine
    url: str  # http://127.0.0.1:PORT, no /v1
    auth_url: str  # the same engine, behind --api-key API_KEY

    @property
    def base(self) -> str:
        return f"{self.url}/v1"

    @property
    def model(self) -> str:
        """The id the server shows: the model file's name, never its path."""
        return Path(self.engine.engine.model_name).name

    def wait_idle(self, timeout: float = 20.0) -> None:
        """Until no request is left in the engine and every KV block is free again."""
        llm = self.engine.engine
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not llm.requests and llm.block_manager.num_free_blocks == llm.block_manager.num_blocks:
                return
            time.sleep(0.02)
        raise AssertionError(f"engine not idle: {len(llm.requests)} requests, "
                             f"{llm.block_manager.num_free_blocks}/{llm.block_manager.num_blocks} blocks free")


@pytest.fixture(scope="package")
def served(default_model_path: Path) -> Iterator[Served]:
    # A small context keeps the KV pool small and makes "too long" cheap to reach.
    llm = LLMEngine(EngineConfig(model=str(default_model_path), device="cpu", max_model_len=MAX_MODEL_LEN, chats=2))
    engine = AsyncEngine(llm)
    servers: list[RunningServer] = []
    try:
        servers.append(start_server_thread(create_app(engine)))
        servers.append(start_server_thread(create_app(engine, api_key=API_KEY)))
        yield Served(engine, servers[0].url, servers[1].url)
    finally:
        for s in servers:
            s.stop()
        engine.shutdown()
