"""The context window as the user meets it: token counts, the gauge, the warning as a chat
fills, a reply cut by the limit, and the three ways on when it is full. The scripted engine
keeps the real engine's rules (one token per word, 4 per message for the template)."""

from __future__ import annotations

import re
from pathlib import Path

from localllm.history import History
from localllm.tui.app import ChatApp
from localllm.tui.screens import ContextFullScreen
from localllm.tui.widgets import MessageView
from tests.tui.conftest import send, wait_until
from tests.tui.fakes import FakeEngine

SIZE = (100, 30)


def _words(n: int, word: str = "w") -> str:
    return " ".join([word] * n)


def _header(view: MessageView) -> str:
    return str(view.query_one(".header").render())


async def test_token_counts_and_the_gauge() -> None:
    engine = FakeEngine(_words(12), max_model_len=1000)
    app = ChatApp(engine, probe=False)
    async with app.run_test(size=SIZE) as pilot:
        chat = app.active_chat
        await send(pilot, chat, "a b c")
        await wait_until(pilot, lambda: not chat.generating)
        # prompt (3 words + 4) and reply (12), as the engine counted them, not guessed
        assert _header(chat.views[0]).endswith("You  7 tok")
        assert "12 tok" in _header(chat.views[1]) and "~" not in _header(chat.views[1])
        assert chat.context_used() == 7 + 12
        assert "ctx 19/1,000" in app.status_text().plain
        await send(pilot, chat, "d e")
        await wait_until(pilot, lambda: not chat.generating)
        # The second prompt is 7 + (12 + 4) + (2 + 4): the message added itself and the
        # framing of the reply before it, and the gauge is the sum of the counts shown.
        assert chat.turns[2].meta == {"tokens": 10} and chat.context() == (7 + 12 + 10 + 12, False)


async def test_counts_without_a_servers_usage_are_marked_as_guesses() -> None:
    engine = FakeEngine(_words(12), max_model_len=1000, usage=False)
    app = ChatApp(engine, probe=False)
    async with app.run_test(size=SIZE) as pilot:
        chat = app.active_chat
        await send(pilot, chat, "a b c")
        await wait_until(pilot, lambda: not chat.generating)
        assert "~" in _header(chat.views[0]) and "~12 tok" in _header(chat.views[1])
        assert re.search(r"ctx ~\d+/1,000", app.status_text().plain)


async def test_a_filling_chat_warns_once() -> None:
    engine = FakeEngine(_words(75), max_model_len=100)
    app = ChatApp(engine, probe=False)
    async with app.run_test(size=SIZE) as pilot:
        chat = app.active_chat
        await send(pilot, chat, "tell me")
        await wait_until(pilot, lambda: not chat.generating)
        notes = [v for v in chat.messages.query(MessageView) if v.role == "note"]
        assert len(notes) == 1 and "81 of the model's 100 tokens" in notes[0].content
        assert "ctx 81/100" in app.status_text().plain


async def test_a_reply_cut_by_the_context_says_so_and_dropping_old_turns_goes_on(home: Path) -> None:
    engine = FakeEngine(_words(40), max_model_len=30)
    app = ChatApp(engine, probe=False)
    async with app.run_test(size=SIZE) as pilot:
        chat = app.active_chat
        await send(pilot, chat, "a long one please")
        await wait_until(pilot, lambda: not chat.generating)
        reply = chat.turns[-1]
        assert reply.finish_reason == "length" and reply.meta["context_limit"]
        assert "cut at the context limit" in _header(chat.views[-1])
        assert "max tokens" not in _header(chat.views[-1])
        # The next message would not fit: a choice, not an error.
        engine.reply = "short"
        chat.prompt.text = "and now?"
        await pilot.press("enter")
        await wait_until(pilot, lambda: isinstance(app.screen, ContextFullScreen), what="the choice")
        assert chat.prompt.text == "and now?"  # kept while the user chooses
        await pilot.press("d")
        await wait_until(pilot, lambda: not chat.generating and chat.turns[-1].content == "short")
        assert engine.prompts[-1] == [{"role": "user", "content": "and now?"}]  # the old turns were not sent
        assert [t.content for t in chat.turns[:2]] == ["a long one please", " ".join(["w"] * 22)]  # still shown
        assert chat.views[0].has_class("-dropped") and not chat.views[2].has_class("-dropped")
        assert chat.messages.query(".context-divider")
        assert not chat.messages.query(".error")
    restarted = ChatApp(FakeEngine(max_model_len=30), probe=False)
    async with restarted.run_test(size=SIZE) as pilot:
        again = restarted.active_chat
        assert again.context_start == 2 and again.views[0].has_class("-dropped")  # remembered
        assert again.prompt_messages() == [{"role": "user", "content": "and now?"}, {"role": "assistant",
                                                                                    "content": "short"}]


async def test_a_full_chat_goes_on_in_a_new_chat_with_its_last_turns(home: Path) -> None:
    engine = FakeEngine(max_model_len=60)
    engine.replies = [_words(10, "x"), _words(10, "y"), _words(10, "z"), "fresh"]
    app = ChatApp(engine, probe=False)
    async with app.run_test(size=SIZE) as pilot:
        old = app.active_chat
        for q in ("one", "two", "three"):
            await send(pilot, old, q)
            await wait_until(pilot, lambda: not old.generating)
        old.prompt.text = "four"
        await pilot.press("enter")
        await wait_until(pilot, lambda: isinstance(app.screen, ContextFullScreen))
        await pilot.press("l")
        await wait_until(pilot, lambda: len(app.chats()) == 2 and not app.active_chat.generating
                         and app.active_chat.turns and app.active_chat.turns[-1].content == "fresh")
        new = app.active_chat
        assert new is not old and new.title.endswith("(continued)")
        # The newest turns that fit in half the context, then the new message.
        assert [t.content for t in new.turns] == ["three", _words(10, "z"), "four", "fresh"]
        assert len(old.turns) == 6  # the old chat is untouched
    h = History(home / "data" / "history.sqlite3")
    assert [m.content for m in h.messages(new.conversation.id)] == ["three", _words(10, "z"), "four", "fresh"]


async def test_a_full_chat_goes_on_in_a_new_chat_from_a_summary() -> None:
    engine = FakeEngine(max_model_len=200)
    engine.replies = [_words(170), "They talked about w.", "ok"]
    app = ChatApp(engine, probe=False)
    async with app.run_test(size=SIZE) as pilot:
        old = app.active_chat
        await send(pilot, old, "hello")
        await wait_until(pilot, lambda: not old.generating)
        old.prompt.text = "next"
        await pilot.press("enter")
        await wait_until(pilot, lambda: isinstance(app.screen, ContextFullScreen))
        await pilot.press("s")
        await wait_until(pilot, lambda: len(app.chats()) == 2 and app.active_chat.turns
                         and app.active_chat.turns[-1].content == "ok", what="the new chat's reply")
        new = app.active_chat
        assert new.system_prompt.endswith("Summary of an earlier chat: They talked about w.")
        summary_prompt = engine.prompts[1]
        # The newest of the chat, as much as fits beside the summary's own room.
        assert "Summarize" in summary_prompt[-1]["content"] and summary_prompt[-1]["content"].endswith(" w w w")
        assert engine.prompts[-1][0] == {"role": "system", "content": new.system_prompt}
        assert engine.prompts[-1][-1] == {"role": "user", "content": "next"}
        # The summary is visible at the top of the new chat, as its system prompt.
        assert "They talked about w." in str(new.messages.query(MessageView).first().query_one(".body").render())


async def test_escape_in_the_choice_keeps_the_message() -> None:
    engine = FakeEngine(_words(40), max_model_len=30)
    app = ChatApp(engine, probe=False)
    async with app.run_test(size=SIZE) as pilot:
        chat = app.active_chat
        await send(pilot, chat, "go")
        await wait_until(pilot, lambda: not chat.generating)
        chat.prompt.text = "kept"
        await pilot.press("enter")
        await wait_until(pilot, lambda: isinstance(app.screen, ContextFullScreen))
        await pilot.press("escape")
        await wait_until(pilot, lambda: not isinstance(app.screen, ContextFullScreen))
        assert chat.prompt.text == "kept" and len(chat.turns) == 2 and len(engine.prompts) == 1
