"""The app's behaviour with a scripted engine: keys, tabs, editing, copying, settings,
history, the palette, model loading and errors. No model, so these run in seconds."""

from __future__ import annotations

import asyncio
from pathlib import Path

from textual import events
from textual.widgets import Input, TextArea

from localllm.history import History
from localllm.tui.app import ChatApp
from localllm.tui.screens import ConfirmScreen, HistoryScreen, SettingsScreen
from localllm.tui.widgets import CodeFence, MessageView
from tests.tui.conftest import send, wait_until
from tests.tui.fakes import FakeEngine

SIZE = (100, 30)


def _db(home: Path) -> History:
    return History(home / "data" / "history.sqlite3")


def _db_of(app: ChatApp) -> History:
    return app.history


async def test_enter_sends_and_ctrl_j_or_shift_enter_insert_newlines() -> None:
    engine = FakeEngine("ok")
    app = ChatApp(engine, probe=False)
    async with app.run_test(size=SIZE) as pilot:
        chat = app.active_chat
        await pilot.press("a", "ctrl+j", "b", "shift+enter", "c")
        assert chat.prompt.text == "a\nb\nc"
        await pilot.press("enter")
        await wait_until(pilot, lambda: not chat.generating and len(chat.turns) == 2)
        assert chat.turns[0].content == "a\nb\nc" and chat.prompt.text == ""
        assert engine.prompts[-1] == [{"role": "user", "content": "a\nb\nc"}]


async def test_keys_in_one_burst_keep_their_order() -> None:
    """A terminal delivers a paste or fast typing as one burst of key events, the way the
    driver posts them here. The newline and the send must act in order with the text."""
    engine = FakeEngine("ok")
    app = ChatApp(engine, probe=False)
    async with app.run_test(size=SIZE) as pilot:
        chat = app.active_chat
        burst = [("a", "a"), ("b", "b"), ("ctrl+j", "\n"), ("c", "c"), ("d", "d"), ("enter", "\r"),
                 ("x", "x")]
        for key, character in burst:
            app.post_message(events.Key(key, character))
        await wait_until(pilot, lambda: len(chat.turns) == 2)
        assert chat.turns[0].content == "ab\ncd"
        assert chat.prompt.text == "x"  # typed after the send: kept for the next message


async def test_tab_keys_and_their_fallbacks() -> None:
    app = ChatApp(FakeEngine(), probe=False)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("ctrl+t", "ctrl+t")
        await pilot.pause()
        ids = [c.id for c in app.chats()]
        assert len(ids) == 3 and app.active_chat.id == ids[2]
        await pilot.press("ctrl+pageup")
        assert app.active_chat.id == ids[1]
        await pilot.press("ctrl+pagedown", "ctrl+pagedown")
        assert app.active_chat.id == ids[0]  # wraps around
        await pilot.press("alt+3")
        assert app.active_chat.id == ids[2]
        await pilot.press("ctrl+tab")
        assert app.active_chat.id == ids[0]
        await pilot.press("alt+left")
        assert app.active_chat.id == ids[2]
        await pilot.press("alt+right")
        assert app.active_chat.id == ids[0]
        assert app.focused is app.active_chat.prompt  # switching lands in the prompt
        await pilot.press("ctrl+w")
        await pilot.pause()
        assert [c.id for c in app.chats()] == ids[1:]


async def test_keys_can_be_remapped_in_config(home: Path) -> None:
    (home / "config.toml").write_text('[keymap]\n"tab.new" = "ctrl+n"\n"chat.send" = "ctrl+s"\n'
                                      '"chat.settings" = "f4"\n')
    app = ChatApp(FakeEngine("ok"), probe=False)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("ctrl+n")
        await pilot.pause()
        assert len(app.chats()) == 2
        chat = app.active_chat
        await pilot.press("x", "enter", "y")  # enter is a newline now
        assert chat.prompt.text == "x\ny" and not chat.turns
        await pilot.press("ctrl+s")
        await wait_until(pilot, lambda: len(chat.turns) == 2)
        assert chat.turns[0].content == "x\ny"


async def test_rename_tab_is_saved(home: Path) -> None:
    app = ChatApp(FakeEngine("ok"), probe=False)
    async with app.run_test(size=SIZE) as pilot:
        chat = app.active_chat
        await send(pilot, chat, "first message")
        await wait_until(pilot, lambda: not chat.generating)
        assert chat.title == "first message"  # a new chat is named after its first message
        await pilot.press("f2")
        await wait_until(pilot, lambda: isinstance(app.screen, type(app.screen)) and app.screen.query(Input))
        app.screen.query_one(Input).value = "Renamed"
        await pilot.press("enter")
        await wait_until(pilot, lambda: chat.title == "Renamed")
        assert str(app.tabs.get_tab(chat.parent.id).label) == "Renamed"
    assert _db(home).get_conversation(chat.conversation.id).title == "Renamed"


async def test_copy_reply_and_any_code_block() -> None:
    reply = "Here:\n\n```python\nprint('hi')\n```\n\nAnd in shell:\n\n```bash\necho hi\n```\n\nDone."
    app = ChatApp(FakeEngine(reply), probe=False)
    async with app.run_test(size=(100, 40)) as pilot:
        chat = app.active_chat
        await send(pilot, chat, "code please")
        await wait_until(pilot, lambda: not chat.generating)
        await pilot.press("alt+c")
        assert app.clipboard == reply
        await pilot.press("alt+k")
        assert app.clipboard == "echo hi"  # the last block
        fences = list(chat.query(CodeFence))
        await wait_until(pilot, lambda: len(list(chat.query(CodeFence))) == 2, what="both code blocks")
        fences = list(chat.query(CodeFence))
        # Each block is labelled with its language and says how to copy it.
        headers = [str(f.query_one(".fence-header").render()) for f in fences]
        assert headers[0].startswith("python") and headers[1].startswith("bash") and "copy" in headers[0]
        app.copy_to_clipboard("")
        await pilot.pause()
        await pilot.click(fences[0].query_one(".fence-header"))
        assert app.clipboard == "print('hi')"  # the first block, not only the last
        await pilot.click(fences[1])
        assert app.clipboard == "echo hi"
        await pilot.click(MessageView, offset=(4, 0))  # the system prompt's header: no copy
        await pilot.click(chat.views[0], offset=(4, 0))  # the first message's header: the whole message
        assert app.clipboard == "code please"
        # The palette offers every block of the last reply.
        await pilot.press("ctrl+p")
        await pilot.pause()
        await pilot.press(*"copy code block 1")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.clipboard == "print('hi')", what="the palette's copy")


class _HeldEngine(FakeEngine):
    """Streams nothing until ``release`` is set: the first tab still streams when the second
    sends on any machine (a state, not a race against a slow reply)."""

    def __init__(self, reply: str, delay: float) -> None:
        super().__init__(reply, delay=delay)
        self.release = asyncio.Event()

    async def generate(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        await self.release.wait()
        async for out in super().generate(*args, **kwargs):
            yield out


async def test_tabs_stream_together_and_a_hidden_tab_catches_up() -> None:
    engine = _HeldEngine(" ".join(f"w{i}" for i in range(150)), delay=0.01)
    app = ChatApp(engine, probe=False)
    async with app.run_test(size=SIZE) as pilot:
        first = app.active_chat
        await send(pilot, first, "one")
        await pilot.press("ctrl+t")
        await pilot.pause()
        second = app.active_chat
        await send(pilot, second, "two")
        assert first.generating and second.generating
        engine.release.set()  # both replies stream now, the first into a hidden tab
        await wait_until(pilot, lambda: not first.generating and not second.generating)
        await pilot.press("alt+1")
        await pilot.pause()
        view = first.messages.query(MessageView).last()
        assert view.content == engine.reply and view.finish_reason == "stop"
        assert first.turns[-1].content == engine.reply == second.turns[-1].content


async def test_an_engine_error_is_shown_in_its_tab_only() -> None:
    engine = FakeEngine(" ".join(["word"] * 30), delay=0.02, fail="BOOM")
    app = ChatApp(engine, probe=False)
    async with app.run_test(size=SIZE) as pilot:
        good = app.active_chat
        await send(pilot, good, "fine")
        await pilot.press("ctrl+t")
        await pilot.pause()
        bad = app.active_chat
        await send(pilot, bad, "BOOM")
        await wait_until(pilot, lambda: not bad.generating and not good.generating)
        assert "engine step failed: BOOM" in bad.messages.query(".error").first().content
        assert [t.role for t in bad.turns] == ["user"]  # no empty reply is kept
        assert [m.role for m in _db_of(app).messages(bad.conversation.id)] == ["user"]
        assert good.turns[-1].content == engine.reply and not good.messages.query(".error")


async def test_settings_change_this_tab_only(home: Path) -> None:
    engine = FakeEngine("ok")
    app = ChatApp(engine, probe=False)
    async with app.run_test(size=SIZE) as pilot:
        chat = app.active_chat
        await pilot.press("ctrl+s")
        await wait_until(pilot, lambda: isinstance(app.screen, SettingsScreen))
        app.screen.query_one("#system", TextArea).text = "Answer in French."
        app.screen.query_one("#p-temperature", Input).value = "0.2"
        await pilot.press("ctrl+s")
        await wait_until(pilot, lambda: not isinstance(app.screen, SettingsScreen))
        assert chat.effective_params()["temperature"] == 0.2 and chat.system_prompt == "Answer in French."
        # The system prompt is shown at the top of the chat it applies to.
        system_view = chat.messages.query(MessageView).first()
        assert system_view.role == "system" and "Answer in French." in str(system_view.query_one(".body").render())
        await send(pilot, chat, "hello")
        await wait_until(pilot, lambda: not chat.generating)
        assert engine.prompts[-1][0] == {"role": "system", "content": "Answer in French."}
        assert engine.params[-1].temperature == 0.2
        await pilot.press("ctrl+t")
        await pilot.pause()
        other = app.active_chat
        assert other.system_prompt == "" and other.effective_params()["temperature"] == 0.7
    conv = _db(home).get_conversation(chat.conversation.id)
    assert conv.system_prompt == "Answer in French." and conv.params["temperature"] == 0.2


async def test_invalid_settings_typed_as_keys_keep_the_dialog_open() -> None:
    app = ChatApp(FakeEngine("ok"), probe=False)
    async with app.run_test(size=(80, 24)) as pilot:
        chat = app.active_chat
        for submit in (("ctrl+s",), ("enter",)):
            await pilot.press("ctrl+s")
            await wait_until(pilot, lambda: isinstance(app.screen, SettingsScreen))
            await pilot.pause()
            assert app.focused is app.screen.query_one("#system", TextArea)  # typing goes somewhere visible
            await pilot.press("tab")  # to the temperature, the way a user gets there
            assert app.focused is app.screen.query_one("#p-temperature", Input)
            await pilot.press(*"abc", *submit)
            await pilot.pause()
            assert isinstance(app.screen, SettingsScreen), f"{submit} saved an invalid temperature"
            error = str(app.screen.query_one("#error").render())
            assert "Temperature" in error and "'abc'" in error
            assert app.screen.query_one("#system", TextArea).text == ""
            await pilot.press("escape")
            await wait_until(pilot, lambda: not isinstance(app.screen, SettingsScreen))
        for bad, says in (("-1", "temperature: must be a finite number >= 0"), ("inf", "finite"), ("5.5", None)):
            await pilot.press("ctrl+s")
            await wait_until(pilot, lambda: isinstance(app.screen, SettingsScreen))
            key = "max_tokens" if bad == "5.5" else "temperature"
            app.screen.query_one(f"#p-{key}", Input).value = bad
            await pilot.click("#save")
            await pilot.pause()
            assert isinstance(app.screen, SettingsScreen), f"{key}={bad} was saved"
            assert (says or "whole number") in str(app.screen.query_one("#error").render())
            await pilot.press("escape")
            await wait_until(pilot, lambda: not isinstance(app.screen, SettingsScreen))
        assert chat.params == {} and chat.effective_params()["temperature"] == 0.7


async def test_new_tabs_start_from_the_models_sampling_defaults(home: Path) -> None:
    (home / "config.toml").write_text("[chat]\nmax_tokens = 300\n")
    engine = FakeEngine("ok", sampling_defaults={"temperature": 0.2, "top_p": 0.9, "max_tokens": 999})
    app = ChatApp(engine, probe=False)
    async with app.run_test(size=SIZE) as pilot:
        chat = app.active_chat
        params = chat.effective_params()
        # The model's own settings over ours; the config file over the model's.
        assert params["temperature"] == 0.2 and params["top_p"] == 0.9 and params["max_tokens"] == 300
        await pilot.press("ctrl+s")
        await wait_until(pilot, lambda: isinstance(app.screen, SettingsScreen))
        field = app.screen.query_one("#p-temperature", Input)
        assert field.value == "" and field.placeholder == "0.2"  # empty: the default, shown greyed
        await pilot.press("escape")
        await send(pilot, chat, "hi")
        await wait_until(pilot, lambda: not chat.generating)
        assert engine.params[-1].temperature == 0.2 and engine.params[-1].max_tokens == 300


async def test_history_screen_searches_and_reopens(home: Path) -> None:
    h = _db(home)
    c = h.create_conversation("Old chat about zebras")
    h.add_message(c.id, "user", "Tell me about zebras")
    h.add_message(c.id, "assistant", "Zebras have stripes.", "stop")
    h.close()
    app = ChatApp(FakeEngine(), probe=False)
    async with app.run_test(size=SIZE) as pilot:
        assert len(app.chats()) == 1 and not app.active_chat.turns  # closed chats do not reopen by themselves
        await pilot.press("ctrl+o")
        await wait_until(pilot, lambda: isinstance(app.screen, HistoryScreen))
        await pilot.press(*"strip")
        await pilot.pause()
        await pilot.press("enter")
        await wait_until(pilot, lambda: len(app.chats()) == 2)
        chat = app.active_chat
        assert chat.title == "Old chat about zebras"
        assert [t.content for t in chat.turns] == ["Tell me about zebras", "Zebras have stripes."]


async def test_palette_runs_commands() -> None:
    app = ChatApp(FakeEngine(), probe=False)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("ctrl+p")
        await pilot.pause()
        await pilot.press(*"new chat")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await wait_until(pilot, lambda: len(app.chats()) == 2)


async def test_model_loads_in_the_background_and_switches() -> None:
    built: list[FakeEngine] = []
    gate = asyncio.Event()

    def factory(model, progress):
        progress("loading", 1, 2)
        engine = FakeEngine(f"from {model}")
        engine._stats.model = model or "default"
        built.append(engine)
        return engine

    app = ChatApp(engine_factory=factory, probe=False)
    async with app.run_test(size=SIZE) as pilot:
        chat = app.active_chat
        await wait_until(pilot, lambda: app.engine is not None, what="the load")
        assert app.status_text().plain.startswith(" default")
        await send(pilot, chat, "hi")
        await wait_until(pilot, lambda: not chat.generating)
        assert chat.turns[-1].content == "from None"
        await app.switch_model("other")
        await wait_until(pilot, lambda: app.engine is not None, what="the switch")
        assert built[0].shut_down and app.model_name == "other"
        gate.set()


async def test_a_model_that_fails_to_load_leaves_the_app_usable_and_exits_2() -> None:
    from localllm.errors import LocalLLMError

    def factory(model, progress):
        raise LocalLLMError(f"{model}: no such file or folder")

    app = ChatApp(engine_factory=factory, model="/nonexistent", probe=False)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.engine_error is not None)
        assert "no such file" in app.status_text().plain
        chat = app.active_chat
        await wait_until(pilot, lambda: chat.messages.query(".error"), what="the error in the chat")
        assert "Pull model" in chat.messages.query(".error").last().content  # local: pulling is the way out
        await send(pilot, chat, "hello?")
        await wait_until(pilot, lambda: not chat.generating)
        assert "no such file" in chat.messages.query(".error").last().content
        await pilot.press("ctrl+t")
        await pilot.pause()
        assert len(app.chats()) == 2  # still alive
        await pilot.press("ctrl+q")
    assert app.return_code == 2  # bad input: 2, as everywhere else in the CLI


async def test_first_run_offers_to_pull_the_default_model() -> None:
    calls: list[str | None] = []

    def factory(model, progress):
        calls.append(model)
        return FakeEngine()

    app = ChatApp(engine_factory=factory, offer_pull=True, probe=False)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        assert "smollm2-135m-instruct" in app.screen.question
        await pilot.press("n")
        await pilot.pause()
        assert not calls and "Pull model" in app.status_text().plain


async def test_view_follows_new_text_only_near_the_bottom() -> None:
    engine = FakeEngine("\n\n".join(f"line {i}" for i in range(80)).replace("\n\n", "\n\n "), delay=0.01)
    app = ChatApp(engine, probe=False)
    async with app.run_test(size=(80, 20)) as pilot:
        chat = app.active_chat
        await send(pilot, chat, "lines")
        view = chat.messages
        await wait_until(pilot, lambda: view.max_scroll_y > 10, what="the view to overflow")
        await wait_until(pilot, lambda: view.max_scroll_y - view.scroll_y <= 2, what="following")
        view.scroll_home(animate=False)
        await pilot.pause()
        await wait_until(pilot, lambda: not chat.generating)
        await pilot.pause(0.2)
        assert view.scroll_y == 0  # the reader was left where they scrolled to


async def test_a_restored_long_chat_opens_at_its_end(home: Path) -> None:
    h = _db(home)
    c = h.create_conversation("Long", tab_position=0)
    for i in range(15):
        h.add_message(c.id, "user", f"question {i}")
        h.add_message(c.id, "assistant", f"Answer {i}.\n\n- one\n- two\n\nThe end of answer {i}.", "stop")
    h.close()
    app = ChatApp(FakeEngine(), probe=False)
    async with app.run_test(size=SIZE) as pilot:
        view = app.active_chat.messages
        await wait_until(pilot, lambda: view.max_scroll_y > 20 and view.max_scroll_y - view.scroll_y <= 2,
                         timeout=10, what="the view to rest at the end")
