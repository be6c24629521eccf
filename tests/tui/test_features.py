"""What oterm, elia and LM Studio users look for, with the scripted engine: key help and the
footer, prompt recall, line breaks in Markdown, theme and active tab across restarts, and
clearing or deleting a chat from the palette."""

from __future__ import annotations

from pathlib import Path

from textual.widgets import Footer

from localllm.history import History
from localllm.tui.app import ChatApp
from localllm.tui.screens import ConfirmScreen, HelpScreen
from tests.tui.conftest import send, wait_until
from tests.tui.fakes import FakeEngine

SIZE = (100, 30)


def _db(home: Path) -> History:
    return History(home / "data" / "history.sqlite3")


def _help_text(screen: HelpScreen) -> str:
    """The rows the help screen shows (its snapshots show how)."""
    return " ".join(f"{keys} {what}" for _, rows in screen.sections for keys, what in rows)


async def _palette(pilot, command: str) -> None:
    await pilot.press("ctrl+p")
    await pilot.pause()
    await pilot.press(*command)
    await pilot.pause(0.3)
    await pilot.press("enter")


def _footer(app: ChatApp) -> tuple[list[str], list[str]]:
    """The footer's labels left to right: those whole on screen, and those cut (under the
    palette's key, which is docked right, or past the edge)."""
    footer = app.query_one(Footer)
    palette = footer.query_one(".-command-palette")
    whole, cut = [], []
    for node in footer.query("FooterKey, FooterLabel"):
        if node is palette or node.has_class("-grouped"):
            continue
        region = node.region
        fits = region.width and region.right <= palette.region.x
        (whole if fits else cut).append(str(node.render()).split()[-1])
    return whole, cut


async def _footer_settles(pilot, app: ChatApp, *labels: str, may_cut: tuple[str, ...] = ()) -> list[str]:
    """The whole labels once ``labels`` are among the footer's; only ``may_cut`` may be cut."""
    await wait_until(pilot, lambda: all(x in sum(_footer(app), []) for x in labels), timeout=10,
                     what=f"the footer to show {labels}")
    whole, cut = _footer(app)
    assert set(cut) <= set(may_cut), f"cut at 80 columns: {cut} (whole: {whole})"
    return whole


async def test_the_footer_fits_80_columns_with_the_basics_first_in_every_state() -> None:
    engine = FakeEngine(" ".join(["w"] * 60), delay=0.05)
    app = ChatApp(engine, probe=False)
    basics = ["Tabs", "Newline", "Help", "Quit"]
    async with app.run_test(size=(80, 24)) as pilot:
        chat = app.active_chat
        assert (await _footer_settles(pilot, app, "Newline", "New")) == [*basics, "New"]
        await send(pilot, chat, "hello")
        assert (await _footer_settles(pilot, app, "Newline", "Stop", "New")) == [*basics, "Stop", "New"]
        await wait_until(pilot, lambda: chat.reply is not None and chat.reply.text, what="some text")
        await pilot.press("escape")
        await wait_until(pilot, lambda: not chat.generating)
        shown = await _footer_settles(pilot, app, "Newline", "Retry", "on", "New")  # "Go on"
        assert shown == [*basics, "Retry", "on", "New"]
        chat.views[-1].focus()
        shown = await _footer_settles(pilot, app, "Retry", "Copy", "Code", "on", "New")
        assert shown == ["Tabs", "Help", "Quit", "Retry", "Copy", "Code", "on", "New"]  # one Retry: this reply's
        await pilot.press("r")  # a second branch of this reply, left to finish
        await wait_until(pilot, lambda: chat.generating)
        await wait_until(pilot, lambda: not chat.generating)
        chat.views[-1].focus()
        shown = await _footer_settles(pilot, app, "Branch", "Code")
        assert shown == ["Tabs", "Help", "Quit", "Retry", "Branch", "Copy", "Code", "New"]
        chat.views[0].focus()
        shown = await _footer_settles(pilot, app, "Edit", "Retry")
        assert shown == ["Tabs", "Help", "Quit", "Edit", "Copy", "Retry", "New"]
        chat.prompt.focus()
        await pilot.press("ctrl+r")  # a third branch, stopped
        await wait_until(pilot, lambda: chat.reply is not None and chat.reply.text, what="the third branch")
        await pilot.press("escape")
        await wait_until(pilot, lambda: not chat.generating)
        chat.views[-1].focus()  # the widest state: only the pane's keys, which come last, may be cut
        shown = await _footer_settles(pilot, app, "Branch", "Code", may_cut=("on", "New"))
        assert shown[:7] == ["Tabs", "Help", "Quit", "Retry", "Branch", "Copy", "Code"]
        chat.views[0].focus()
        await pilot.press("e")  # editing: only what ends the edit
        assert (await _footer_settles(pilot, app, "Newline", "Stop")) == [*basics, "Stop", "New"]


async def test_f1_and_question_mark_open_the_key_help_and_the_footer_names_the_basics() -> None:
    app = ChatApp(FakeEngine(), probe=False)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        footer = " ".join(str(k.render()) for k in app.query_one(Footer).query("FooterKey, FooterLabel"))
        for shown in ("Tab", "Newline", "Quit", "Help"):
            assert shown in footer, f"the footer lacks {shown}: {footer}"
        await pilot.press("f1")
        await wait_until(pilot, lambda: isinstance(app.screen, HelpScreen))
        text = _help_text(app.screen)
        for key, what in (("^t", "new chat tab"), ("^j", "newline"), ("^q", "quit"), ("alt+←", "previous tab"),
                          ("e", "edit it"), ("^g", "go on")):
            assert key in text and what in text, (key, what)
        await pilot.press("escape")
        await wait_until(pilot, lambda: not isinstance(app.screen, HelpScreen))
        await pilot.press("?")  # in the empty prompt: the help
        await wait_until(pilot, lambda: isinstance(app.screen, HelpScreen))
        await pilot.press("escape")
        await wait_until(pilot, lambda: not isinstance(app.screen, HelpScreen))
        await pilot.press("w", "h", "y", "?")  # in a sentence: a question mark
        assert app.active_chat.prompt.text == "why?" and not isinstance(app.screen, HelpScreen)


async def test_help_shows_remapped_keys(home: Path) -> None:
    (home / "config.toml").write_text('[keymap]\n"tab.new" = "ctrl+n"\n')
    app = ChatApp(FakeEngine(), probe=False)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f1")
        await wait_until(pilot, lambda: isinstance(app.screen, HelpScreen))
        text = _help_text(app.screen)
        assert "^n new chat tab" in text and "^t new chat tab" not in text


async def test_up_in_an_empty_prompt_recalls_earlier_prompts(home: Path) -> None:
    h = _db(home)
    c = h.create_conversation("earlier session")
    h.add_message(c.id, "user", "from yesterday")
    h.close()
    app = ChatApp(FakeEngine("ok"), probe=False)
    async with app.run_test(size=SIZE) as pilot:
        chat = app.active_chat
        await send(pilot, chat, "first\nof two lines")
        await wait_until(pilot, lambda: not chat.generating)
        await send(pilot, chat, "second")
        await wait_until(pilot, lambda: not chat.generating)
        await pilot.press("up")
        assert chat.prompt.text == "second"
        await pilot.press("up")
        assert chat.prompt.text == "first\nof two lines"
        await pilot.press("up")
        assert chat.prompt.text == "from yesterday"  # from the history, other chats too
        await pilot.press("down", "down")
        assert chat.prompt.text == "second"
        await pilot.press("down")
        assert chat.prompt.text == ""
        # In a prompt being written, up moves the cursor and recalls nothing.
        await pilot.press("a", "ctrl+j", "b", "up")
        assert chat.prompt.text == "a\nb" and chat.prompt.cursor_location == (0, 1)


async def test_single_line_breaks_survive_markdown() -> None:
    poem = "Roses are red,\nviolets are blue,\nsugar is sweet."
    app = ChatApp(FakeEngine(poem), probe=False)
    async with app.run_test(size=SIZE) as pilot:
        chat = app.active_chat
        await send(pilot, chat, "a poem")
        await wait_until(pilot, lambda: not chat.generating)
        await wait_until(pilot, lambda: chat.views[-1].markdown.children, what="the rendered reply")
        [paragraph] = chat.views[-1].markdown.children
        lines = [line.rstrip() for line in str(paragraph.render()).splitlines()]
        assert lines == ["Roses are red,", "violets are blue,", "sugar is sweet."]


async def test_theme_and_active_tab_survive_a_restart(home: Path) -> None:
    app = ChatApp(FakeEngine("ok"), probe=False)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, app.active_chat, "first tab")
        await wait_until(pilot, lambda: not app.active_chat.generating)
        await pilot.press("ctrl+t")
        await pilot.pause()
        await send(pilot, app.active_chat, "second tab")
        await wait_until(pilot, lambda: not app.active_chat.generating)
        await pilot.press("ctrl+t")
        await pilot.pause()
        await send(pilot, app.active_chat, "third tab")
        await wait_until(pilot, lambda: not app.active_chat.generating)
        await pilot.press("alt+2")
        await pilot.pause()
        app.theme = "nord"
        await pilot.pause()
    again = ChatApp(FakeEngine(), probe=False)
    async with again.run_test(size=SIZE) as pilot:
        await pilot.pause()
        assert again.theme == "nord"
        assert [c.title for c in again.chats()] == ["first tab", "second tab", "third tab"]
        assert again.active_chat.title == "second tab"


async def test_clear_and_delete_chat_from_the_palette(home: Path) -> None:
    app = ChatApp(FakeEngine("ok"), probe=False)
    async with app.run_test(size=SIZE) as pilot:
        chat = app.active_chat
        await send(pilot, chat, "to be cleared")
        await wait_until(pilot, lambda: not chat.generating)
        cid = chat.conversation.id
        await _palette(pilot, "clear chat")
        await wait_until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press("y")
        await wait_until(pilot, lambda: not chat.turns)
        assert not chat.views and app.history.messages(cid) == []
        assert app.history.get_conversation(cid) is not None  # the chat and its settings stay
        await send(pilot, chat, "to be deleted")
        await wait_until(pilot, lambda: not chat.generating)
        await _palette(pilot, "delete chat")
        await wait_until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press("y")
        await wait_until(pilot, lambda: chat not in app.chats())
        assert app.history.get_conversation(cid) is None and len(app.chats()) == 1
