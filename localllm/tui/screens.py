"""Modal screens: rename, chat settings, history, confirm, key help, a full context, the
probe, and pulling a model. They return their result with ``dismiss``; none knows the app."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from rich.table import Table
from rich.text import Text
from textual import on, work
from textual.binding import Binding, BindingType
from textual.containers import Grid, Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import (
    Button,
    DataTable,
    Input,
    Label,
    OptionList,
    ProgressBar,
    Static,
    TextArea,
)
from textual.widgets.option_list import Option

from localllm.hardware.planner import fmt_bytes
from localllm.tui.backend import (
    PARAM_KEYS,
    PARAM_LABELS,
    ProbeReport,
    parse_params,
    probe_report,
)

if TYPE_CHECKING:
    from localllm.history import History


class RenameScreen(ModalScreen[str | None]):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "dismiss(None)", "Cancel", id="modal.cancel")]

    def __init__(self, title: str) -> None:
        super().__init__(classes="modal")
        self.current = title

    def compose(self) -> Any:
        with Vertical(classes="dialog small"):
            yield Label("Rename chat", classes="dialog-title")
            yield Input(self.current, id="name")
            yield Label("Enter to save, Esc to cancel", classes="hint")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        name = event.value.strip()
        self.dismiss(name or None)


class ConfirmScreen(ModalScreen[bool]):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,n", "dismiss(False)", "No", id="modal.cancel"),
        Binding("y", "dismiss(True)", "Yes", id="modal.confirm"),
    ]

    def __init__(self, question: str, yes: str = "Yes", no: str = "No") -> None:
        super().__init__(classes="modal")
        self.question = question
        self.yes, self.no = yes, no

    def compose(self) -> Any:
        with Vertical(classes="dialog small"):
            yield Static(self.question, classes="question")
            with Horizontal(classes="buttons"):
                yield Button(self.yes, id="yes", variant="primary")
                yield Button(self.no, id="no")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")


class SettingsScreen(ModalScreen[tuple[str, dict[str, Any]] | None]):
    """A tab's system prompt and its own sampling settings; returns (system_prompt, params).

    A field left empty keeps the default, shown greyed in it: the model's own, the config
    file's, or localllm's. A value that is not valid keeps the dialog open and says why."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "dismiss(None)", "Cancel", id="modal.cancel"),
        Binding("ctrl+s", "save", "Save", id="modal.save", priority=True),
    ]

    def __init__(self, system_prompt: str, params: dict[str, Any], base: dict[str, Any],
                 title: str = "Chat settings") -> None:
        super().__init__(classes="modal")
        self.system_prompt = system_prompt
        self.params = params
        self.base = base
        self.dialog_title = title

    def compose(self) -> Any:
        with Vertical(classes="dialog wide"):
            yield Label(self.dialog_title, classes="dialog-title")
            # Not focusable itself: the first tab would land on it, and typing there is lost.
            with VerticalScroll(classes="form", can_focus=False):
                yield Label("System prompt (empty: the model's default)")
                yield TextArea(self.system_prompt, id="system", soft_wrap=True, tab_behavior="focus")
                with Grid(classes="params"):
                    for key in PARAM_KEYS:
                        value = self.params.get(key)
                        default = self.base.get(key)
                        yield Label(PARAM_LABELS[key], classes="param-label")
                        yield Input("" if value is None else str(value), id=f"p-{key}", compact=True,
                                    placeholder="random" if default is None else str(default))
            yield Label("", id="error", classes="error-text")
            with Horizontal(classes="buttons"):
                yield Button("Save ^s", id="save", variant="primary", compact=True)
                yield Button("Cancel esc", id="cancel", compact=True)

    def on_mount(self) -> None:
        self.query_one("#system", TextArea).focus()

    def action_save(self) -> None:
        raw = {key: self.query_one(f"#p-{key}", Input).value for key in PARAM_KEYS}
        try:
            params = parse_params(raw, self.base)
        except ValueError as e:
            self.query_one("#error", Label).update(str(e))
            return
        self.dismiss((self.query_one("#system", TextArea).text, params))

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.action_save()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "save":
            self.action_save()
        else:
            self.dismiss(None)


class HelpScreen(ModalScreen[None]):
    """Every key, by where it acts: ``sections`` are (title, [(keys, what)]), read from the
    live bindings by whoever opens this, so a remapped key shows as remapped."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,f1,q,question_mark", "dismiss(None)", "Close", id="modal.cancel"),
    ]

    def __init__(self, sections: list[tuple[str, list[tuple[str, str]]]]) -> None:
        super().__init__(classes="modal")
        self.sections = sections

    def compose(self) -> Any:
        with Vertical(classes="dialog wide tall"):
            yield Label("Keys", classes="dialog-title")
            with VerticalScroll(id="keys"):  # focusable: the arrows scroll it
                for title, rows in self.sections:
                    table = Table.grid(padding=(0, 2))
                    table.add_column(no_wrap=True, style="bold")
                    table.add_column()
                    for keys, what in rows:
                        table.add_row(keys, what)
                    yield Label(title, classes="help-title")
                    yield Static(table, classes="help-section")
            yield Label("esc close · ctrl+p finds every command by name", classes="hint")


class ContextFullScreen(ModalScreen[str | None]):
    """The chat no longer fits the model's context: drop the oldest turns, or go on in a new
    chat with the last turns or a summary. Returns "drop", "last", "summary" or None."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "dismiss(None)", "Cancel", id="modal.cancel"),
        Binding("d", "dismiss('drop')", "Drop oldest", show=False),
        Binding("l", "dismiss('last')", "Last turns", show=False),
        Binding("s", "dismiss('summary')", "Summary", show=False),
    ]

    def __init__(self, need: int, limit: int, sending: bool = True) -> None:
        super().__init__(classes="modal")
        self.need = need
        self.limit = limit
        self.sending = sending

    def compose(self) -> Any:
        with Vertical(classes="dialog"):
            yield Label("This chat is full" if self.need > self.limit or self.sending else "Make room",
                        classes="dialog-title")
            what = "With your message it needs" if self.sending else "It holds"
            yield Static(f"{what} about {self.need:,} tokens; the model's context holds {self.limit:,}, "
                         "and the reply needs room too. Nothing is deleted: choose how to go on.", classes="question")
            yield OptionList(
                Option(Text.assemble(("d", "bold"), "  Drop the oldest turns (kept on screen, not sent)"), id="drop"),
                Option(Text.assemble(("l", "bold"), "  New chat with the last turns"), id="last"),
                Option(Text.assemble(("s", "bold"), "  New chat starting from a summary of this one"), id="summary"),
                id="choices",
            )
            yield Label("enter or d/l/s chooses · esc cancels" + (", keeping your message" if self.sending else ""),
                        classes="hint")

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option.id)


class HistoryScreen(ModalScreen[int | None]):
    """Past conversations, newest first; typing searches all messages (FTS5). Returns the id
    of the conversation to open. Delete and export act on the highlighted one."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "dismiss(None)", "Close", id="modal.cancel"),
        Binding("down", "move(1)", show=False, priority=True),
        Binding("up", "move(-1)", show=False, priority=True),
        Binding("ctrl+d", "delete", "Delete", id="history.delete", priority=True),
        Binding("ctrl+e", "export", "Export", id="history.export", priority=True),
    ]

    def __init__(self, history: History, export_dir: Path | None = None,
                 delete: Callable[[int], Awaitable[None]] | None = None) -> None:
        """``delete`` removes a conversation everywhere (its open tab too); without it, from
        the history only."""
        super().__init__(classes="modal")
        self.history = history
        self.export_dir = export_dir
        self.delete = delete

    def compose(self) -> Any:
        with Vertical(classes="dialog wide tall"):
            yield Label("History", classes="dialog-title")
            yield Input(placeholder="Search all messages…", id="search")
            yield OptionList(id="conversations")
            yield Label("enter open · ctrl+d delete · ctrl+e export to Markdown · esc close", classes="hint")

    def on_mount(self) -> None:
        self.refresh_list("")

    @on(Input.Changed, "#search")
    def _search_changed(self, event: Input.Changed) -> None:
        self.refresh_list(event.value)

    def refresh_list(self, query: str) -> None:
        options = self.query_one(OptionList)
        options.clear_options()
        try:
            self._fill(options, query)
        except Exception as e:  # noqa: BLE001 - a damaged index must not close the app
            self.notify(f"History unavailable: {e}", severity="error")
        if options.option_count:
            options.highlighted = 0

    def _fill(self, options: OptionList, query: str) -> None:
        if query.strip():
            for hit in self.history.search(query):
                label = Text.assemble((hit.title, "bold"), "  ", (_when(hit.updated), "dim"), "\n  ", hit.snippet)
                options.add_option(Option(label, id=str(hit.conversation_id)))
        else:
            for c in self.history.list_conversations():
                label = Text.assemble((c.title, "bold"), "  ",
                                      (f"{_when(c.updated)} · {c.num_messages} messages", "dim"))
                options.add_option(Option(label, id=str(c.id)))

    def _selected(self) -> int | None:
        options = self.query_one(OptionList)
        if options.highlighted is None or not options.option_count:
            return None
        option = options.get_option_at_index(options.highlighted)
        return int(option.id) if option.id else None

    def action_move(self, delta: int) -> None:
        options = self.query_one(OptionList)
        if options.option_count:
            current = options.highlighted or 0
            options.highlighted = max(0, min(options.option_count - 1, current + delta))

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(self._selected())

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(int(event.option.id) if event.option.id else None)

    def action_delete(self) -> None:
        cid = self._selected()
        if cid is None:
            return
        conv = self.history.get_conversation(cid)

        async def done(yes: bool | None) -> None:
            if yes:
                if self.delete is not None:
                    await self.delete(cid)
                else:
                    self.history.delete_conversation(cid)
                self.refresh_list(self.query_one("#search", Input).value)

        self.app.push_screen(ConfirmScreen(f"Delete “{conv.title if conv else cid}” from history?", "Delete"), done)

    def action_export(self) -> None:
        cid = self._selected()
        if cid is None:
            return
        try:
            path = self.history.export_to_file(cid, self.export_dir)
        except Exception as e:  # noqa: BLE001
            self.notify(f"Export failed: {e}", severity="error")
            return
        self.notify(f"Exported to {path}")


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M")


class ProbeScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,q", "dismiss(None)", "Close", id="modal.cancel")]

    def __init__(self, report: ProbeReport | None = None) -> None:
        super().__init__(classes="modal")
        self.report = report

    def compose(self) -> Any:
        with Vertical(classes="dialog wide tall"):
            yield Label("Hardware probe", classes="dialog-title")
            yield Static("probing…", id="hardware")
            yield DataTable(id="models", cursor_type="row", zebra_stripes=True)
            yield Label("esc close", classes="hint")

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns("Model", "Pulled", "Verdict", "Detail")
        if self.report is not None:
            self._show(self.report)
        else:
            self._probe()

    @work(thread=True, exit_on_error=False)
    def _probe(self) -> None:
        try:
            report = probe_report()
        except Exception as e:  # noqa: BLE001
            self.app.call_from_thread(self.query_one("#hardware", Static).update, f"probe failed: {e}")
            return
        self.app.call_from_thread(self._show, report)

    def _show(self, report: ProbeReport) -> None:
        self.query_one("#hardware", Static).update("\n".join(report.hardware))
        table = self.query_one(DataTable)
        for r in report.rows:
            style = "green" if r.fits else ("red" if r.fits is False else "yellow")
            table.add_row(r.id, fmt_bytes(r.size_bytes) if r.local else "", Text(r.verdict, style=style),
                          r.detail[:120])


@dataclass(slots=True)
class PullState:
    """Written by the pulling thread, read by the screen's timer: plain attribute stores, no
    locks needed for a progress display, and the download never waits on the UI."""

    name: str
    stage: str = "starting"
    done: int = 0
    total: int = 0
    finished: bool = False
    path: Path | None = None
    error: str | None = None
    started: float = field(default_factory=time.monotonic)

    def progress(self, stage: str, done: int, total: int) -> None:
        self.stage, self.done, self.total = stage, done, total


class PullScreen(ModalScreen[PullState]):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "hide", "Hide", id="modal.cancel")]

    def __init__(self, state: PullState, intro: str = "") -> None:
        super().__init__(classes="modal")
        self.state = state
        self.intro = intro

    def compose(self) -> Any:
        with Vertical(classes="dialog"):
            yield Label(f"Pulling {self.state.name}", classes="dialog-title")
            if self.intro:
                yield Static(self.intro)
            yield Label("starting…", id="stage")
            yield ProgressBar(total=None, id="bar", show_eta=False)
            yield Label("esc hides this; the pull goes on", classes="hint")

    def on_mount(self) -> None:
        self.set_interval(0.1, self._paint)

    def _paint(self) -> None:
        st = self.state
        if st.finished:
            self.dismiss(st)
            return
        bar = self.query_one(ProgressBar)
        if st.total > 0:
            bar.update(total=st.total, progress=st.done)
            self.query_one("#stage", Label).update(f"{st.stage}: {fmt_bytes(st.done)} of {fmt_bytes(st.total)}")
        else:
            bar.update(total=None)
            self.query_one("#stage", Label).update(f"{st.stage} ({time.monotonic() - st.started:.0f} s)")

    def action_hide(self) -> None:
        self.dismiss(self.state)
