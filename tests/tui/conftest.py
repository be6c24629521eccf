"""Fixtures for the TUI tests: an isolated LOCALLLM_HOME per test, and helpers to wait on a
running app (one ``pilot.pause()`` is not enough for background workers)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """History, config and the model store all move under tmp_path. Tests that need the real
    model get its path from the session fixture, resolved before this one applies."""
    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path))
    return tmp_path


async def wait_until(pilot, predicate: Callable[[], bool], timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what or predicate}")
        await asyncio.sleep(0.02)
        await pilot.pause()


async def send(pilot, chat, text: str) -> None:
    """Types into the tab's prompt the way a user does and presses enter."""
    before = len(chat.turns)
    chat.prompt.focus()
    chat.prompt.text = text
    await pilot.press("enter")
    await wait_until(pilot, lambda: len(chat.turns) > before, timeout=10, what="the message to be sent")
