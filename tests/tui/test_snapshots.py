"""Screens as SVG snapshots, each at 80×24 and 140×40. Content is fixed: a conversation
loaded from history, a scripted engine with fixed stats, a fixed memory figure and date, no
generation, no cursor blink. Update with ``pytest tests/tui/test_snapshots.py --snapshot-update``
after a deliberate change, and look at the new files."""

from __future__ import annotations

from pathlib import Path

import pytest
from textual.widgets import Input, Markdown, TextArea

from localllm.history import History
from localllm.tui.app import ChatApp
from localllm.tui.screens import ContextFullScreen, HelpScreen, HistoryScreen, SettingsScreen
from tests.tui.conftest import wait_until
from tests.tui.fakes import FakeEngine

SIZES = [pytest.param((80, 24), id="80x24"), pytest.param((140, 40), id="140x40")]

REPLY = """Use a list comprehension:

```python
squares = [n * n for n in range(10)]
```

- it reads left to right
- it is faster than `append` in a loop"""


@pytest.fixture(autouse=True)
def fixed_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("localllm.tui.status_line.memory_label", lambda device: "RAM 512.0 MiB")
    monkeypatch.setattr("localllm.tui.screens._when", lambda ts: "2026-11-29 12:00")


@pytest.fixture
def saved_chat(home: Path) -> None:
    h = History(home / "data" / "history.sqlite3")
    c = h.create_conversation("Squares in Python", system_prompt="Answer briefly, with code.", tab_position=0)
    h.add_message(c.id, "user", "How do I make a list of squares?", meta={"tokens": 17})
    h.add_message(c.id, "assistant", REPLY, "stop", {"tok_s": 42.5, "cached_tokens": 32, "tokens": 40})
    other = h.create_conversation("Boiling eggs")
    h.add_message(other.id, "user", "How long do I boil an egg?")
    h.add_message(other.id, "assistant", "About nine minutes for a firm y", "abort", {"tok_s": 40.0})
    h.close()


async def _still(pilot) -> None:
    """Waits until every Markdown has parsed (it parses in a thread, so a loaded machine
    can otherwise snap a half-built screen), then hides the cursors: whether one shows
    depends on blink timing and on the terminal's focus, neither of which is layout. Where
    focus goes is tested with Pilot (test_app, test_branches)."""
    app = pilot.app
    await wait_until(pilot, lambda: all(md.children for md in app.query(Markdown) if md.source), timeout=20,
                     what="the Markdown to render")
    for area in app.query(TextArea):
        area.cursor_blink = False
    for field in app.query(Input):
        field.cursor_blink = False
    app.screen.set_focus(None)
    await pilot.pause()


async def _open(pilot, key: str, screen: type) -> None:
    await _still(pilot)
    await pilot.press(key)
    await wait_until(pilot, lambda: isinstance(pilot.app.screen, screen), timeout=20, what=screen.__name__)
    await _still(pilot)


def _app() -> ChatApp:
    return ChatApp(FakeEngine(), probe=False)


@pytest.mark.parametrize("size", SIZES)
def test_chat_loaded_from_history(snap_compare, saved_chat, size) -> None:
    assert snap_compare(_app(), terminal_size=size, run_before=_still)


@pytest.mark.parametrize("size", SIZES)
def test_history_screen(snap_compare, saved_chat, size) -> None:
    async def open_history(pilot) -> None:
        await _open(pilot, "ctrl+o", HistoryScreen)

    assert snap_compare(_app(), terminal_size=size, run_before=open_history)


@pytest.mark.parametrize("size", SIZES)
def test_settings_screen(snap_compare, saved_chat, size) -> None:
    async def open_settings(pilot) -> None:
        await _open(pilot, "ctrl+s", SettingsScreen)

    assert snap_compare(_app(), terminal_size=size, run_before=open_settings)


@pytest.mark.parametrize("size", SIZES)
def test_help_screen(snap_compare, saved_chat, size) -> None:
    async def open_help(pilot) -> None:
        await _open(pilot, "f1", HelpScreen)

    assert snap_compare(_app(), terminal_size=size, run_before=open_help)


@pytest.mark.parametrize("size", SIZES)
def test_context_full_dialog(snap_compare, saved_chat, size) -> None:
    async def fill(pilot) -> None:
        await _still(pilot)
        pilot.app.active_chat.ask_for_room("one more question", 4100, 4096)
        await wait_until(pilot, lambda: isinstance(pilot.app.screen, ContextFullScreen), what="the dialog")
        await _still(pilot)

    assert snap_compare(_app(), terminal_size=size, run_before=fill)


@pytest.mark.parametrize("size", SIZES)
def test_first_run_offer(snap_compare, size) -> None:
    app = ChatApp(engine_factory=lambda model, progress: FakeEngine(), offer_pull=True, probe=False)
    assert snap_compare(app, terminal_size=size, run_before=_still)
