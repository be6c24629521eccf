"""``localllm chat``: tabs of conversations that all stream at once through one engine.

The app owns the engine (or is lent one), the history database and the tabs. Each tab is a
:class:`ChatPane` with its own worker; the engine batches their requests together, and the
status bar shows that happening (batch size, KV use, prefix-cache hits, the tab's context).
The app is the panes' ``ChatHost`` and the palette's ``PaletteHost``; they reach it only
through those and through messages. The engine and its loading are the ``EngineHost``'s
(``engine_host``), the status line is drawn by ``status_line``.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from rich.text import Text
from textual import work
from textual.app import App
from textual.binding import Binding, BindingType
from textual.css.query import NoMatches
from textual.theme import Theme
from textual.widgets import TabbedContent, TabPane

from localllm.history import History
from localllm.tui.backend import (
    ChatConfig,
    ChatEngine,
    EngineFactory,
    ProbeReport,
    base_params,
    code_blocks,
    load_config,
    probe_report,
)
from localllm.tui.chat import ChatPane
from localllm.tui.commands import ChatCommands
from localllm.tui.conversation import Turn, describe
from localllm.tui.engine_host import EngineHost
from localllm.tui.screens import (
    ConfirmScreen,
    HelpScreen,
    HistoryScreen,
    ProbeScreen,
    PullScreen,
    PullState,
    RenameScreen,
    SettingsScreen,
)
from localllm.tui.status_line import STATUS_HZ, status_text
from localllm.tui.widgets import ChatFooter, MessageView, PromptArea, StatusBar

if TYPE_CHECKING:
    from textual.binding import Binding as BindingT

    from localllm.history import Conversation

T = TypeVar("T")

TABS = Binding.Group("Tabs", compact=True)


def _goto_bindings() -> list[Binding]:
    return [Binding(f"alt+{i}", f"goto_tab({i})", show=False, id=f"tab.goto.{i}", priority=True) for i in range(1, 10)]


class ChatApp(App[None]):
    # Absolute: a relative CSS_PATH resolves beside the module of whatever subclass runs.
    CSS_PATH = Path(__file__).with_name("app.tcss")
    TITLE = "localllm"
    COMMANDS = App.COMMANDS | {ChatCommands}
    # ctrl+tab often never reaches a terminal app, and some terminals keep ctrl+pageup/down
    # for their own tabs, so stepping has three keys. alt+digit arrives as alt+digit only
    # under the kitty keyboard protocol: elsewhere Textual turns ESC+1 into "¡" (macOS
    # Option-key text), so alt+left/right are the fallback that always arrives (and the ones
    # the footer names). Priority, because the prompt (a TextArea) would take ctrl+w as
    # delete-word.
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("ctrl+t", "new_tab", "New", id="tab.new", priority=True),
        Binding("ctrl+w", "close_tab", "Close", id="tab.close", priority=True, show=False),
        Binding("ctrl+pageup,ctrl+shift+tab,alt+left", "previous_tab", "Previous tab", id="tab.previous",
                key_display="alt+←", priority=True, group=TABS),
        Binding("ctrl+pagedown,ctrl+tab,alt+right", "next_tab", "Next tab", id="tab.next", key_display="→",
                priority=True, group=TABS),
        *_goto_bindings(),
        # Off the footer, which must fit 80 columns: the help and the palette name them (and
        # the system prompt's header names ctrl+s).
        Binding("f2", "rename_tab", "Rename", id="tab.rename", show=False),
        Binding("ctrl+o", "history", "History", id="app.history", show=False),
        Binding("ctrl+s", "settings", "Settings", id="chat.settings", show=False),
        Binding("f1", "help_screen", "Help", id="app.help"),
        Binding("ctrl+q", "quit", "Quit", id="app.quit", priority=True),
    ]

    def __init__(
        self,
        engine: ChatEngine | None = None,
        *,
        engine_factory: EngineFactory | None = None,
        model: str | None = None,
        config: ChatConfig | None = None,
        history_path: Path | None = None,
        default_params: dict[str, Any] | None = None,
        offer_pull: bool = False,
        probe: bool = True,
        endpoint: str | None = None,
    ) -> None:
        """``engine``: a ready engine, lent (never shut down here). ``engine_factory``: builds
        one in a thread (and again on a model switch); the app owns what it builds.
        ``endpoint``: the factory connects to this server (remote mode)."""
        super().__init__()
        self.config = config if config is not None else load_config()
        if default_params:
            self.config.params.update(default_params)
        self.host = EngineHost(engine, engine_factory, endpoint=endpoint, model_request=model or self.config.model,
                               post=self._from_thread, on_loaded=self._engine_loaded, on_failed=self._engine_failed)
        self._compiling = False  # the engine optimizes its decode step in the background (last seen)
        self._history_path = history_path
        self._history: History | None = None
        self._tab_counter = 0
        self.offer_pull = offer_pull
        self.probe_enabled = probe and endpoint is None
        self.probe_cache: ProbeReport | None = None
        self._labels: dict[str, str] = {}

    # ---- start and stop ----

    def compose(self) -> Any:
        yield TabbedContent(id="tabs")
        yield StatusBar(id="status")
        yield ChatFooter(compact=True)

    async def on_mount(self) -> None:
        if self.config.keymap:
            self.set_keymap(self.config.keymap)
        for problem in self.config.problems:
            self.notify(problem, severity="warning", timeout=10)
        theme = self.history_call("read the theme", self.history.get_state, "theme")
        if theme and theme in self.available_themes:
            self.theme = theme
        self.theme_changed_signal.subscribe(self, self._theme_changed)
        restored: list[ChatPane] = []
        for conv in self.history_call("read the open tabs", self.history.open_tabs) or []:
            if (chat := await self.open_conversation(conv.id, activate=False)) is not None:
                restored.append(chat)
        if not restored:
            await self.new_tab()
        else:
            active = self.history_call("read the active tab", self.history.get_state, "active_tab")
            chat = next((c for c in restored if c.conversation and str(c.conversation.id) == active), restored[0])
            self._activate(chat)
        self.set_interval(1 / STATUS_HZ, self.refresh_status)
        self.refresh_status()
        if self.host.engine is None and self.host.factory is not None:
            if self.offer_pull and self.host.model_request is None and not _any_local_model():
                self._offer_default_pull()
            else:
                self.load_engine(self.host.model_request)
        elif self.host.engine is not None:
            self._after_load()

    def _theme_changed(self, theme: Theme) -> None:
        self.history_call("save the theme", self.history.set_state, "theme", theme.name)

    @property
    def history(self) -> History:
        if self._history is None:
            try:
                self._history = History(self._history_path)
            except Exception as e:  # noqa: BLE001 - a broken database must not stop the chat
                self.notify(f"History unavailable, this session is not saved: {e}", severity="error", timeout=20)
                self._history = History(Path(":memory:"))
        return self._history

    def history_call(self, doing: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
        """Runs a history operation; a failure (disk full, a locked or damaged file) is shown
        and the chat goes on without it."""
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001
            self.notify(f"Could not {doing}: {e}", severity="error", timeout=10)
            return None

    async def stop_all(self) -> None:
        for chat in self.chats():
            await chat.stop()

    async def action_quit(self) -> None:
        # Stop replies first so their partial text is committed before the database closes.
        await self.stop_all()
        self.exit(return_code=2 if self.load_failure else 0)

    async def on_unmount(self) -> None:
        self.host.closing()
        await self.stop_all()
        await self.host.shutdown()
        if self._history is not None:
            self._history.close()

    # ---- the engine (ChatHost): held by EngineHost ----

    @property
    def engine(self) -> ChatEngine | None:
        return self.host.engine

    @property
    def engine_loading(self) -> bool:
        return self.host.loading

    @property
    def loading(self) -> bool:
        return self.host.loading

    @property
    def engine_error(self) -> str | None:
        return self.host.error

    @property
    def load_failure(self) -> str | None:
        return self.host.load_failure

    @property
    def endpoint(self) -> str | None:
        return self.host.endpoint

    @property
    def model_name(self) -> str:
        return self.host.model_name

    def base_params(self) -> dict[str, Any]:
        defaults = self.host.engine.sampling_defaults if self.host.engine is not None else {}
        return base_params(defaults, self.config.params)

    def served_models(self) -> list[str]:
        return self.host.served_models()

    async def wait_for_engine(self) -> ChatEngine:
        return await self.host.wait()

    def load_engine(self, model: str | None) -> None:
        if self.host.factory is None:
            self.notify("This session runs a fixed engine; restart with --model to change it.", severity="warning")
            return
        self.host.load(model)

    def _from_thread(self, callback: Callable[..., Any], *args: Any) -> bool:
        try:
            self.call_from_thread(callback, *args)
        except RuntimeError:  # the app has gone
            return False
        return True

    def _engine_loaded(self, engine: ChatEngine) -> None:
        self.notify(f"Connected to {self.endpoint}: {self.model_name}" if self.endpoint else f"Loaded {self.model_name}")
        note = engine.tokenizer.template_note if engine.tokenizer is not None else None
        if note:
            self.notify(note, severity="warning", timeout=15)
        self.refresh_status()
        self._after_load()

    def _engine_failed(self, error: str) -> None:
        self.notify(error, severity="error", timeout=20)
        hint = (f" (is the server at {self.endpoint} running? ctrl+p: Reconnect)" if self.endpoint
                else " (ctrl+p: Switch model or Pull model)")
        chat = self.active_chat
        if chat is not None:
            self.call_later(chat.show_error, error + hint)
        self.refresh_status()

    def _after_load(self) -> None:
        if self.probe_enabled:
            self.run_worker(self.action_refresh_models(), group="probe", exclusive=True, exit_on_error=False)

    async def action_refresh_models(self) -> None:
        try:
            self.probe_cache = await asyncio.to_thread(probe_report)
        except Exception as e:  # noqa: BLE001 - the palette then offers no verdicts
            self.log.warning(f"probe failed: {e}")

    def action_reconnect(self) -> None:
        if self.host.loading:
            self.notify("Connecting already.")
            return
        self.run_worker(self.switch_model(self.host.model_request), group="switch", exit_on_error=False)

    def request_switch_model(self, name: str) -> None:
        if name == self.model_name and self.host.engine is not None:
            self.notify(f"{name} is already loaded.")
            return
        busy = [c for c in self.chats() if c.generating]

        async def go(yes: bool | None = True) -> None:
            if yes:
                await self.switch_model(name)

        if busy:
            self.push_screen(ConfirmScreen(f"{len(busy)} tab(s) are replying. Stop them and load {name}?",
                                           "Switch"), go)
        else:
            self.call_later(go)

    async def switch_model(self, name: str | None) -> None:
        if self.host.factory is None:
            self.notify("This session runs a fixed engine; restart with --model to change it.", severity="warning")
            return
        if self.host.loading:
            self.notify("A model is loading already.", severity="warning")
            return
        await self.stop_all()
        await self.host.unload()
        self.load_engine(name)

    # ---- pulling ----

    def pull_model(self, name: str, intro: str = "", then_load: bool = False) -> None:
        state = PullState(name)
        self._pull_worker(state, then_load)
        self.push_screen(PullScreen(state, intro))

    @work(thread=True, group="pull", exit_on_error=False)
    def _pull_worker(self, state: PullState, then_load: bool) -> None:
        from localllm import store

        try:
            state.path = store.pull(state.name, progress=state.progress)
        except BaseException as e:  # noqa: BLE001 - reported, never fatal
            state.error = describe(e)
        state.finished = True
        self._from_thread(self._pull_done, state, then_load)

    def _pull_done(self, state: PullState, then_load: bool) -> None:
        if state.error is not None:
            self.notify(f"Pull of {state.name} failed: {state.error}", severity="error", timeout=20)
            return
        self.notify(f"Pulled {state.name}; ctrl+p → Switch model to use it." if not then_load else f"Pulled {state.name}")
        if then_load:
            self.load_engine(state.name if self.host.model_request is None else self.host.model_request)
        elif self.probe_enabled:
            self.run_worker(self.action_refresh_models(), group="probe", exclusive=True, exit_on_error=False)

    def _offer_default_pull(self) -> None:
        from localllm.catalog import DEFAULT_MODEL

        def answer(yes: bool | None) -> None:
            if yes:
                self.pull_model(DEFAULT_MODEL, "The first model: small, for trying localllm out.", then_load=True)
            else:
                self.host.set_error("no model is pulled yet: ctrl+p, then Pull model")
                self.refresh_status()

        self.push_screen(ConfirmScreen(
            f"No model is pulled yet.\n\nPull the default model, {DEFAULT_MODEL} (about 100 MB)?",
            "Pull", "Not now"), answer)

    # ---- tabs ----

    @property
    def tabs(self) -> TabbedContent:
        return self.query_one("#tabs", TabbedContent)

    def chats(self) -> list[ChatPane]:
        return list(self.query(ChatPane))

    @property
    def active_chat(self) -> ChatPane | None:
        try:
            pane = self.tabs.active_pane
        except NoMatches:  # shutting down: the tabs are gone
            return None
        if pane is None:
            return None
        found = pane.query(ChatPane)
        return found.first() if found else None

    async def new_tab(self, *, title: str | None = None, system_prompt: str | None = None,
                      params: dict[str, Any] | None = None, conversation: Conversation | None = None,
                      turns: list[Turn] | None = None, activate: bool = True) -> ChatPane:
        self._tab_counter += 1
        n = self._tab_counter
        chat = ChatPane(
            self, title=title or f"Chat {n}",
            system_prompt=self.config.system_prompt if system_prompt is None else system_prompt,
            params=dict(params or {}), conversation=conversation, turns=turns, id=f"chat-{n}",
        )
        pane_id = f"tab-{n}"
        await self.tabs.add_pane(TabPane(chat.title, chat, id=pane_id))
        if activate:
            self._activate(chat)
        return chat

    async def open_conversation(self, conversation_id: int, activate: bool = True) -> ChatPane | None:
        for chat in self.chats():
            if chat.conversation is not None and chat.conversation.id == conversation_id:
                if activate:
                    self._activate(chat)
                return chat
        conv = self.history_call("open the chat", self.history.get_conversation, conversation_id)
        if conv is None:
            return None
        # No tab of this process writes to it (it is not open), so a reply still marked as
        # streaming was cut short by a crash.
        self.history_call("check the chat", self.history.mark_interrupted, conversation_id)
        stored = self.history_call("read the chat", self.history.messages, conversation_id)
        if stored is None:
            return None
        chat = await self.new_tab(title=conv.title, system_prompt=conv.system_prompt, params=conv.params,
                                  conversation=conv, turns=[Turn.stored(m) for m in stored], activate=activate)
        self.save_open_tabs()
        return chat

    def save_open_tabs(self) -> None:
        ids = [c.conversation.id for c in self.chats() if c.conversation is not None]
        try:
            self.history.set_open_tabs(ids)
        except Exception as e:  # noqa: BLE001
            self.log.warning(f"could not save open tabs: {e}")

    def _save_active_tab(self) -> None:
        chat = self.active_chat
        if chat is not None and chat.conversation is not None:
            with suppress(Exception):
                self.history.set_state("active_tab", str(chat.conversation.id))

    def _paint_tab_labels(self) -> None:
        """A dot marks tabs that are replying, so background work is visible."""
        for chat in self.chats():
            pane = chat.parent
            if pane is None or pane.id is None:
                continue
            label = ("● " if chat.generating else "") + chat.title
            if self._labels.get(pane.id) != label:
                self._labels[pane.id] = label
                with suppress(Exception):  # a tab being removed
                    self.tabs.get_tab(pane.id).label = label  # type: ignore[assignment]

    def on_chat_pane_changed(self, event: ChatPane.Changed) -> None:
        self.save_open_tabs()
        if event.pane is self.active_chat:
            self._save_active_tab()
        self._paint_tab_labels()

    async def on_chat_pane_new_chat_requested(self, event: ChatPane.NewChatRequested) -> None:
        """Goes on in a new tab: the turns carried over are written to a new conversation first."""
        old = event.pane
        title = old.title if old.title.endswith("(continued)") else f"{old.title} (continued)"
        try:
            conv = self.history.create_conversation(title, event.system_prompt, event.params, self.model_name)
            for t in event.turns:
                self.history.add_message(conv.id, t.role, t.content, t.finish_reason or
                                         ("stop" if t.role == "assistant" else None), t.meta)
        except Exception as e:  # noqa: BLE001
            self.notify(f"Could not start the new chat: {e}", severity="error")
            return
        chat = await self.open_conversation(conv.id)
        if chat is not None and event.text:
            await chat.send(event.text)

    def _activate(self, chat: ChatPane) -> None:
        if chat.parent is not None and chat.parent.id:
            self.tabs.active = chat.parent.id
            chat.prompt.focus()

    def on_tabbed_content_tab_activated(self, event: TabbedContent.TabActivated) -> None:
        chat = self.active_chat
        if chat is not None:
            chat.prompt.focus()
            self._save_active_tab()
            self.refresh_status()

    async def action_new_tab(self) -> None:
        await self.new_tab()

    async def close_chat(self, chat: ChatPane) -> None:
        await chat.stop()
        pane = chat.parent
        if pane is not None and pane.id:
            self._labels.pop(pane.id, None)
            await self.tabs.remove_pane(pane.id)
        self.save_open_tabs()
        if not self.chats():
            await self.new_tab()
        elif (active := self.active_chat) is not None:
            active.prompt.focus()

    async def action_close_tab(self) -> None:
        chat = self.active_chat
        if chat is not None:
            await self.close_chat(chat)

    def _step_tab(self, delta: int) -> None:
        chats = self.chats()
        active = self.active_chat
        if not chats or active is None:
            return
        self._activate(chats[(chats.index(active) + delta) % len(chats)])

    def action_next_tab(self) -> None:
        self._step_tab(1)

    def action_previous_tab(self) -> None:
        self._step_tab(-1)

    def action_goto_tab(self, number: int) -> None:
        chats = self.chats()
        if 1 <= number <= len(chats):
            self._activate(chats[number - 1])

    def action_rename_tab(self) -> None:
        chat = self.active_chat
        if chat is None:
            return

        def rename(name: str | None) -> None:
            if not name:
                return
            chat.title = name
            if chat.conversation is not None:
                self.history_call("rename the chat", self.history.update_conversation, chat.conversation.id,
                                  title=name)
            self._paint_tab_labels()

        self.push_screen(RenameScreen(chat.title), rename)

    def action_settings(self) -> None:
        chat = self.active_chat
        if chat is None:
            return

        async def apply(result: tuple[str, dict[str, Any]] | None) -> None:
            if result is not None:
                await chat.apply_settings(*result)
                self.notify("Settings saved for this tab.")

        self.push_screen(SettingsScreen(chat.system_prompt, chat.params, self.base_params(),
                                        f"Settings: {chat.title}"), apply)

    def action_history(self) -> None:
        async def opened(conversation_id: int | None) -> None:
            if conversation_id is not None:
                await self.open_conversation(conversation_id)

        self.push_screen(HistoryScreen(self.history, self.config.export_dir, self.delete_conversation), opened)

    async def delete_conversation(self, conversation_id: int) -> None:
        for chat in self.chats():
            if chat.conversation is not None and chat.conversation.id == conversation_id:
                await self.close_chat(chat)
        self.history_call("delete the chat", self.history.delete_conversation, conversation_id)
        self.save_open_tabs()

    def action_delete_chat(self) -> None:
        chat = self.active_chat
        if chat is None:
            return
        if chat.conversation is None:
            self.run_worker(self.close_chat(chat), exit_on_error=False)
            return
        conversation_id = chat.conversation.id

        async def answer(yes: bool | None) -> None:
            if yes:
                await self.delete_conversation(conversation_id)
                self.notify(f"Deleted “{chat.title}”.")

        self.push_screen(ConfirmScreen(f"Delete “{chat.title}” and all its messages from the history?", "Delete"),
                         answer)

    def action_clear_chat(self) -> None:
        chat = self.active_chat
        if chat is None or not chat.turns:
            self.notify("This chat is empty already.")
            return

        async def answer(yes: bool | None) -> None:
            if yes:
                await chat.clear()

        self.push_screen(ConfirmScreen(f"Delete all {len(chat.turns)} messages of “{chat.title}” (every branch)?"
                                       " Its settings stay.", "Clear"), answer)

    def action_export_chat(self) -> None:
        chat = self.active_chat
        if chat is None or chat.conversation is None:
            self.notify("Nothing to export yet.")
            return
        try:
            path = self.history.export_to_file(chat.conversation.id, self.config.export_dir)
        except Exception as e:  # noqa: BLE001
            self.notify(f"Export failed: {e}", severity="error")
            return
        self.notify(f"Exported to {path}")

    def action_probe(self) -> None:
        self.push_screen(ProbeScreen(self.probe_cache))

    async def action_chat_do(self, action: str) -> None:
        chat = self.active_chat
        if chat is not None:
            await chat.run_action(action)

    # ---- help ----

    def get_key_display(self, binding: BindingT) -> str:
        if binding.id in self.config.keymap:  # a remapped key: its fixed display would be stale
            binding = dataclasses.replace(binding, key_display=None)
        return super().get_key_display(binding)

    def _keys_of(self, binding: Binding) -> str:
        keys = self.config.keymap.get(binding.id or "", binding.key)
        return ", ".join(super(ChatApp, self).get_key_display(Binding(k.strip(), "")) for k in keys.split(","))

    def help_sections(self) -> list[tuple[str, list[tuple[str, str]]]]:
        """Every key, read from the bindings themselves (after the config's keymap)."""
        descriptions = {
            "tab.previous": "previous tab", "tab.next": "next tab", "tab.new": "new chat tab",
            "tab.close": "close the tab (a running reply is stopped and kept)", "tab.rename": "rename the tab",
            "app.history": "history: reopen, search, delete, export", "chat.settings": "system prompt and sampling",
            "app.help": "this help", "app.quit": "quit", "chat.send": "send", "chat.newline": "newline",
            "chat.recall_previous": "earlier prompt (in an empty prompt)", "chat.recall_next": "later prompt",
            "chat.stop": "stop the reply (keeps what came); cancels an edit",
            "chat.regenerate": "new last reply; the old one stays as a branch",
            "chat.continue": "go on with a stopped, cut or interrupted reply",
            "chat.edit_last": "edit your last message", "chat.messages": "select messages (or shift+tab)",
            "chat.copy_reply": "copy the last reply", "chat.copy_code": "copy the last code block",
            "message.previous": "previous message", "message.next": "next message (past the last: the prompt)",
            "message.edit": "edit it: sending makes a new branch", "message.regenerate": "regenerate this reply",
            "message.branch_previous": "previous branch here", "message.branch_next": "next branch here",
            "message.copy": "copy it", "message.copy_code": "copy its last code block",
            "message.leave": "back to the prompt",
        }

        listed: set[str] = set()

        def rows(bindings: list[BindingType]) -> list[tuple[str, str]]:
            out = []
            for b in bindings:
                if isinstance(b, Binding) and b.id in descriptions and b.id not in listed:
                    listed.add(b.id)
                    out.append((self._keys_of(b), descriptions[b.id]))
            return out

        return [
            ("Tabs and the app", [*rows(ChatApp.BINDINGS), ("alt+1 … alt+9", "go to tab n"),
                                  ("^p", "command palette: every command by name, themes")]),
            ("The prompt", [*rows(PromptArea.BINDINGS), ("?", "this help (in an empty prompt)")]),
            ("The chat", rows(ChatPane.BINDINGS)),
            ("A selected message", [*rows(MessageView.BINDINGS), ("click", "copy it (a code block: just the code)")]),
        ]

    def action_help_screen(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen(self.help_sections()))

    def on_prompt_area_help_requested(self, event: PromptArea.HelpRequested) -> None:
        self.action_help_screen()

    # ---- clipboard ----

    def on_message_view_copy_requested(self, event: MessageView.CopyRequested) -> None:
        self.copy_text(event.text, event.what)

    def copy_text(self, text: str, what: str) -> None:
        self.copy_to_clipboard(text)  # OSC 52: works over SSH, not in macOS Terminal
        # pyperclip is optional: it covers terminals without OSC 52 (macOS Terminal). Not
        # installed, or no clipboard at all (headless): OSC 52 alone then.
        with suppress(Exception):
            import pyperclip

            pyperclip.copy(text)
        self.notify(f"Copied {what} ({len(text)} characters)")

    def active_code_blocks(self) -> list[str]:
        chat = self.active_chat
        if chat is None:
            return []
        return next((code_blocks(t.content) for t in reversed(chat.turns)
                     if t.role == "assistant" and code_blocks(t.content)), [])

    # ---- status ----

    def status_text(self) -> Text:
        return status_text(self.host, self.active_chat)

    def refresh_status(self) -> None:
        try:
            self.query_one(StatusBar).set_text(self.status_text())
        except Exception:  # noqa: BLE001 - during shutdown the bar may be gone
            return
        self._paint_tab_labels()
        compiling = False
        if self.host.engine is not None:
            with suppress(Exception):
                compiling = self.host.engine.stats().compiling
        if self._compiling and not compiling:
            self.notify("Optimized for this CPU: replies now come faster")
        self._compiling = compiling


def _any_local_model() -> bool:
    from localllm import store

    try:
        return bool(store.local_models())
    except Exception:  # noqa: BLE001
        return False
