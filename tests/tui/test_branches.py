"""Regenerate, edit any earlier message, and the branches both leave behind, with the
scripted engine: in the app, in the history, and after a restart."""

from __future__ import annotations

from pathlib import Path

from localllm.history import History
from localllm.tui.app import ChatApp
from tests.tui.conftest import send, wait_until
from tests.tui.fakes import FakeEngine

SIZE = (100, 30)


def _db(home: Path) -> History:
    return History(home / "data" / "history.sqlite3")


def _contents(chat) -> list[str]:
    return [t.content for t in chat.turns]


async def test_regenerate_keeps_the_old_reply_as_a_branch(home: Path) -> None:
    engine = FakeEngine()
    engine.replies = ["first answer", "second answer"]
    app = ChatApp(engine, probe=False)
    async with app.run_test(size=SIZE) as pilot:
        chat = app.active_chat
        await send(pilot, chat, "question")
        await wait_until(pilot, lambda: not chat.generating)
        await pilot.press("ctrl+r")
        await wait_until(pilot, lambda: not chat.generating and _contents(chat)[-1] == "second answer")
        assert _contents(chat) == ["question", "second answer"]
        assert chat.turns[-1].branch == (1, 2) and "‹ 2/2 ›" in str(chat.views[-1].query_one(".header").render())
        # The reply is selected with alt+up; left shows the older branch again.
        await pilot.press("alt+up")
        assert app.focused is chat.views[-1]
        await pilot.press("left")
        await wait_until(pilot, lambda: _contents(chat) == ["question", "first answer"], what="the old branch")
        assert chat.turns[-1].branch == (0, 2)
        assert engine.prompts[1] == engine.prompts[0]  # the regenerated reply saw the same prompt
    assert [m.content for m in _db(home).messages(chat.conversation.id)] == ["question", "first answer"]


async def test_edit_an_earlier_message_branches_from_it(home: Path) -> None:
    engine = FakeEngine()
    engine.replies = ["one", "two", "two again"]
    app = ChatApp(engine, probe=False)
    async with app.run_test(size=SIZE) as pilot:
        chat = app.active_chat
        await send(pilot, chat, "first question")
        await wait_until(pilot, lambda: not chat.generating)
        await send(pilot, chat, "second question")
        await wait_until(pilot, lambda: not chat.generating)
        # Walk up from the prompt to the first message and edit it: not only the last one.
        await pilot.press("alt+up", "up", "up", "up")
        assert app.focused is chat.views[0]
        await pilot.press("e")
        assert chat.prompt.text == "first question" and app.focused is chat.prompt
        assert "editing" in str(chat.prompt.border_title)
        await pilot.press("ctrl+j", *"more", "enter")
        await wait_until(pilot, lambda: not chat.generating and len(chat.turns) == 2, what="the new branch")
        assert _contents(chat) == ["first question\nmore", "two again"]
        assert engine.prompts[-1] == [{"role": "user", "content": "first question\nmore"}]
        assert chat.turns[0].branch == (1, 2)
        # The old branch, with both its turns, is one key away.
        chat.views[0].focus()
        await pilot.press("left")
        await wait_until(pilot, lambda: len(chat.turns) == 4, what="the old branch")
        assert _contents(chat) == ["first question", "one", "second question", "two"]
        await pilot.press("right")
        await wait_until(pilot, lambda: len(chat.turns) == 2)

    restarted = ChatApp(FakeEngine(), probe=False)
    async with restarted.run_test(size=SIZE) as pilot:
        again = restarted.active_chat
        assert _contents(again) == ["first question\nmore", "two again"]  # the branch on screen at exit
        assert again.turns[0].branch == (1, 2)
    h = _db(home)
    assert h.db.execute("SELECT COUNT(*) FROM messages").fetchone()[0] == 6  # nothing was deleted


async def test_escape_cancels_an_edit_and_alt_e_edits_the_last_message() -> None:
    engine = FakeEngine("ok")
    app = ChatApp(engine, probe=False)
    async with app.run_test(size=SIZE) as pilot:
        chat = app.active_chat
        await send(pilot, chat, "hello")
        await wait_until(pilot, lambda: not chat.generating)
        await pilot.press("alt+e")
        assert chat.editing == 0 and chat.prompt.text == "hello"
        await pilot.press("escape")
        assert chat.editing is None and chat.prompt.text == "" and chat.prompt.border_title is None
        await pilot.press("alt+e", "!", "enter")
        await wait_until(pilot, lambda: not chat.generating and _contents(chat)[0] == "hello!")
        assert len(chat.turns) == 2
