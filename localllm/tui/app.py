"""``localllm chat``: tabs of conversations that all stream at once through one engine.

The app owns the engine (or is lent one), the history database and the tabs. Each tab is a
:class:`ChatPane` with its own worker; the engine batches their requests together, and the
status bar shows that happening (batch size, KV use, prefix-cache hits).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from rich.text import Text
from textual import work
from textual.app import App
from textual.binding import Binding, BindingType
from textual.widgets import Footer, TabbedContent, TabPane

from localllm.errors import LocalLLMError
from localllm.history import History
from localllm.tui.backend import (
    ChatConfig,
    ChatEngine,
    EngineFactory,
    ProbeReport,
    load_config,
    memory_label,
    precision_label,
    probe_report,
)
from localllm.tui.chat import ChatPane, Turn, describe
from localllm.tui.commands import ChatCommands
from localllm.tui.screens import (
    ConfirmScreen,
    HistoryScreen,
    ProbeScreen,
    PullScreen,
    PullState,
    RenameScreen,
    SettingsScreen,
)
from localllm.tui.widgets import StatusBar

T = TypeVar("T")

STATUS_HZ = 4  # status figures change slowly; 4 repaints a second are plenty and cheap


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
    # Option-key text), so alt+left/right are the fallback that always arrives. Priority,
    # because the prompt (a TextArea) would take ctrl+w as delete-word.
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("ctrl+t", "new_tab", "New", id="tab.new", priority=True),
        Binding("ctrl+w", "close_tab", "Close", id="tab.close", priority=True),
        Binding("ctrl+pagedown,ctrl+tab,alt+right", "next_tab", "Next tab", id="tab.next", show=False,
                priority=True),
        Binding("ctrl+pageup,ctrl+shift+tab,alt+left", "previous_tab", "Previous tab", id="tab.previous",
                show=False, priority=True),
        *_goto_bindings(),
        Binding("f2", "rename_tab", "Rename", id="tab.rename"),
        Binding("ctrl+o", "history", "History", id="app.history"),
        Binding("ctrl+s", "settings", "Settings", id="chat.settings"),
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
    ) -> None:
        """``engine``: a ready engine, lent (never shut down here). ``engine_factory``: builds
        one in a thread (and again on a model switch); the app owns what it builds."""
        super().__init__()
        self.config = config if config is not None else load_config()
        if default_params:
            self.config.params.update(default_params)
        self.engine: ChatEngine | None = engine
        self.engine_factory = engine_factory
        self._owns_engine = False
        self.model_request = model or self.config.model
        self.engine_error: str | None = None
        self.loading = False
        self.load_progress: tuple[str, int, int] = ("starting", 0, 0)
        self._engine_ready = asyncio.Event()
        if engine is not None:
            self._engine_ready.set()
        self._history_path = history_path
        self._history: History | None = None
        self._tab_counter = 0
        self.offer_pull = offer_pull
        self.probe_enabled = probe
        self.probe_cache: ProbeReport | None = None
        self._labels: dict[str, str] = {}

    # ---- start and stop ----

    def compose(self) -> Any:
        yield TabbedContent(id="tabs")
        yield StatusBar(id="status")
        yield Footer()

    async def on_mount(self) -> None:
        if self.config.keymap:
            self.set_keymap(self.config.keymap)
        for problem in self.config.problems:
            self.notify(problem, severity="warning", timeout=10)
        restored = 0
        for conv in self.history_call("read the open tabs", self.history.open_tabs) or []:
            if await self.open_conversation(conv.id, activate=False) is not None:
                restored += 1
        if not restored:
            await self.new_tab()
        else:
            first = self.chats()[0]
            self.tabs.active = first.parent.id or ""
            first.prompt.focus()
        self.set_interval(1 / STATUS_HZ, self.refresh_status)
        self.refresh_status()
        if self.engine is None and self.engine_factory is not None:
            if self.offer_pull and self.model_request is None and not _any_local_model():
                self._offer_default_pull()
            else:
                self.load_engine(self.model_request)
        elif self.engine is not None:
            self._after_load()

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
        self.exit()

    async def on_unmount(self) -> None:
        await self.stop_all()
        if self.engine is not None and self._owns_engine:
            engine, self.engine = self.engine, None
            await asyncio.to_thread(engine.shutdown)
        if self._history is not None:
            self._history.close()

    # ---- the engine ----

    @property
    def model_name(self) -> str:
        if self.engine is not None:
            with suppress(Exception):  # a remote engine that lost its server: fall through
                return str(self.engine.stats().model)
        return self.model_request or ""

    async def wait_for_engine(self) -> ChatEngine:
        if self.engine is None and not self.loading:
            raise LocalLLMError(self.engine_error or "no model is loaded: ctrl+p, then Pull model or Switch model")
        await self._engine_ready.wait()
        if self.engine is None:
            raise LocalLLMError(self.engine_error or "no model is loaded")
        return self.engine

    def load_engine(self, model: str | None) -> None:
        if self.engine_factory is None:
            self.notify("This session runs a fixed engine; restart with --model to change it.", severity="warning")
            return
        self.model_request = model
        self.engine_error = None
        self.loading = True
        self.load_progress = ("starting", 0, 0)
        if self._engine_ready.is_set():
            self._engine_ready = asyncio.Event()
        self._load_worker(model)

    def _on_load_progress(self, stage: str, done: int, total: int) -> None:
        # Called from the loading thread, often (once per tensor): store only; the status
        # timer paints it.
        self.load_progress = (stage, done, total)

    @work(thread=True, exclusive=True, group="engine-load", exit_on_error=False)
    def _load_worker(self, model: str | None) -> None:
        assert self.engine_factory is not None
        try:
            engine = self.engine_factory(model, self._on_load_progress)
        except BaseException as e:  # noqa: BLE001 - shown in the app, which goes on without a model
            self._from_thread(self._engine_failed, e)
            return
        if not self._from_thread(self._engine_loaded, engine):
            engine.shutdown()  # the app quit while loading

    def _from_thread(self, callback: Any, *args: Any) -> bool:
        try:
            self.call_from_thread(callback, *args)
        except RuntimeError:  # the app has gone
            return False
        return True

    def _engine_loaded(self, engine: ChatEngine) -> None:
        self.engine = engine
        self._owns_engine = True
        self.loading = False
        self._engine_ready.set()
        self.notify(f"Loaded {self.model_name}")
        note = getattr(engine.tokenizer, "template_note", None)  # a remote engine has no tokenizer
        if note:
            self.notify(note, severity="warning", timeout=15)
        self.refresh_status()
        self._after_load()

    def _engine_failed(self, e: BaseException) -> None:
        self.loading = False
        self.engine_error = f"the model failed to load: {describe(e)}"
        self._engine_ready.set()
        self.notify(self.engine_error, severity="error", timeout=20)
        chat = self.active_chat
        if chat is not None:
            self.call_later(chat.show_error, self.engine_error + " (ctrl+p: Switch model or Pull model)")
        self.refresh_status()

    def _after_load(self) -> None:
        if self.probe_enabled:
            self.run_worker(self.action_refresh_models(), group="probe", exclusive=True, exit_on_error=False)

    async def action_refresh_models(self) -> None:
        try:
            self.probe_cache = await asyncio.to_thread(probe_report)
        except Exception as e:  # noqa: BLE001 - the palette then offers no verdicts
            self.log.warning(f"probe failed: {e}")

    def request_switch_model(self, name: str) -> None:
        if name == self.model_name and self.engine is not None:
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
        if self.engine_factory is None:
            self.notify("This session runs a fixed engine; restart with --model to change it.", severity="warning")
            return
        if self.loading:
            self.notify("A model is loading already.", severity="warning")
            return
        await self.stop_all()
        old, self.engine = self.engine, None
        self._engine_ready = asyncio.Event()
        if old is not None and self._owns_engine:
            await asyncio.to_thread(old.shutdown)
        del old
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
            self.load_engine(state.name if self.model_request is None else self.model_request)
        elif self.probe_enabled:
            self.run_worker(self.action_refresh_models(), group="probe", exclusive=True, exit_on_error=False)

    def _offer_default_pull(self) -> None:
        from localllm.catalog import DEFAULT_MODEL

        def answer(yes: bool | None) -> None:
            if yes:
                self.pull_model(DEFAULT_MODEL, "The first model: small, for trying localllm out.", then_load=True)
            else:
                self.engine_error = "no model is pulled yet: ctrl+p, then Pull model"
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
        pane = self.tabs.active_pane
        if pane is None:
            return None
        found = pane.query(ChatPane)
        return found.first() if found else None

    def is_active(self, chat: ChatPane) -> bool:
        return chat.parent is not None and chat.parent is self.tabs.active_pane

    async def new_tab(self, *, title: str | None = None, system_prompt: str | None = None,
                      params: dict[str, Any] | None = None, conversation: Any = None,
                      turns: list[Turn] | None = None, activate: bool = True) -> ChatPane:
        self._tab_counter += 1
        n = self._tab_counter
        chat = ChatPane(
            title=title or f"Chat {n}",
            system_prompt=self.config.system_prompt if system_prompt is None else system_prompt,
            params={**self.config.params, **(params or {})},
            conversation=conversation, turns=turns, id=f"chat-{n}",
        )
        pane_id = f"tab-{n}"
        await self.tabs.add_pane(TabPane(chat.title, chat, id=pane_id))
        if activate:
            self.tabs.active = pane_id
            chat.prompt.focus()
        return chat

    async def open_conversation(self, conversation_id: int, activate: bool = True) -> ChatPane | None:
        for chat in self.chats():
            if chat.conversation is not None and chat.conversation.id == conversation_id:
                if activate:
                    self._activate(chat)
                return chat
        conv = self.history_call("open the chat", self.history.get_conversation, conversation_id)
        stored = self.history_call("read the chat", self.history.messages, conversation_id) if conv else None
        if conv is None or stored is None:
            return None
        turns = [Turn(m.role, m.content, m.id, m.finish_reason, m.meta) for m in stored]
        chat = await self.new_tab(title=conv.title, system_prompt=conv.system_prompt, params=conv.params,
                                  conversation=conv, turns=turns, activate=activate)
        self.save_open_tabs()
        return chat

    def save_open_tabs(self) -> None:
        ids = [c.conversation.id for c in self.chats() if c.conversation is not None]
        try:
            self.history.set_open_tabs(ids)
        except Exception as e:  # noqa: BLE001
            self.log.warning(f"could not save open tabs: {e}")

    def retitle(self, chat: ChatPane) -> None:
        self._labels.pop(chat.parent.id or "", None) if chat.parent is not None else None
        self._paint_tab_labels()

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

    def _activate(self, chat: ChatPane) -> None:
        if chat.parent is not None and chat.parent.id:
            self.tabs.active = chat.parent.id
            chat.prompt.focus()

    def on_tabbed_content_tab_activated(self, event: TabbedContent.TabActivated) -> None:
        chat = self.active_chat
        if chat is not None:
            chat.prompt.focus()
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
            self.retitle(chat)
            if chat.conversation is not None:
                self.history_call("rename the chat", self.history.update_conversation, chat.conversation.id,
                                  title=name)

        self.push_screen(RenameScreen(chat.title), rename)

    def action_settings(self) -> None:
        chat = self.active_chat
        if chat is None:
            return

        def apply(result: tuple[str, dict[str, Any]] | None) -> None:
            if result is not None:
                chat.apply_settings(*result)
                self.notify("Settings saved for this tab.")

        self.push_screen(SettingsScreen(chat.system_prompt, chat.params, f"Settings: {chat.title}"), apply)

    def action_history(self) -> None:
        async def opened(conversation_id: int | None) -> None:
            if conversation_id is not None:
                await self.open_conversation(conversation_id)

        self.push_screen(HistoryScreen(self.history, self.config.export_dir), opened)

    async def delete_conversation(self, conversation_id: int) -> None:
        for chat in self.chats():
            if chat.conversation is not None and chat.conversation.id == conversation_id:
                await self.close_chat(chat)
        self.history_call("delete the chat", self.history.delete_conversation, conversation_id)
        self.save_open_tabs()

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

    # ---- clipboard ----

    def copy_text(self, text: str, what: str) -> None:
        self.copy_to_clipboard(text)  # OSC 52: works over SSH, not in macOS Terminal
        # pyperclip is optional: it covers terminals without OSC 52 (macOS Terminal). Not
        # installed, or no clipboard at all (headless): OSC 52 alone then.
        with suppress(Exception):
            import pyperclip

            pyperclip.copy(text)
        self.notify(f"Copied {what} ({len(text)} characters)")

    # ---- status ----

    def status_text(self) -> Text:
        text = Text()
        if self.engine is None:
            if self.loading:
                stage, done, total = self.load_progress
                pct = done / total if total else 0.0
                filled = int(pct * 20)
                text.append(f" loading {self.model_request or 'the default model'} ", style="bold")
                text.append("█" * filled + "░" * (20 - filled), style="cyan")
                text.append(f" {stage} {pct:.0%}" if total else f" {stage}…")
            elif self.engine_error:
                text.append(f" {self.engine_error}", style="bold red")
            else:
                text.append(" no model: ctrl+p, then Pull model", style="yellow")
            return text
        try:
            s = self.engine.stats()
        except Exception as e:  # noqa: BLE001
            text.append(f" engine stats unavailable: {e}", style="red")
            return text
        chat = self.active_chat
        running = int(getattr(s, "num_running", 0) or 0)
        batch = int(getattr(s, "batch_size", 0) or 0) if running else 0
        kv = float(getattr(s, "kv_usage", 0.0) or 0.0)
        sep = (" │ ", "dim")
        text.append(f" {s.model}", style="bold")
        precision = precision_label(str(getattr(s, "precision", "") or ""))
        where = str(getattr(s, "device", "") or "?")
        # A remote server does not say its precision; "unknown/remote" would be noise.
        text.append(f"  {precision}/{where}" if precision and precision != "unknown" else f"  {where}")
        text.append(*sep)
        tok_s = chat.last_tok_s if chat is not None else 0.0
        text.append(f"{tok_s:.1f} tok/s")
        text.append(*sep)
        text.append(f"batch {batch}", style="bold green" if batch > 1 else "")
        waiting = int(getattr(s, "num_waiting", 0) or 0)
        if waiting:
            text.append(f" +{waiting} waiting", style="yellow")
        text.append(*sep)
        text.append(f"KV {kv:.1%}")
        text.append(*sep)
        cached = chat.last_cached_tokens if chat is not None else 0
        text.append(f"prefix hit {cached}")
        text.append(*sep)
        text.append(memory_label(str(getattr(s, "device", ""))))
        return text

    def refresh_status(self) -> None:
        try:
            self.query_one(StatusBar).set_text(self.status_text())
        except Exception:  # noqa: BLE001 - during shutdown the bar may be gone
            return
        self._paint_tab_labels()


def _any_local_model() -> bool:
    from localllm import store

    try:
        return bool(store.local_models())
    except Exception:  # noqa: BLE001
        return False
