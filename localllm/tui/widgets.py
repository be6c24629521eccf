"""The chat's building blocks: the prompt, the scrolling message list, one message, code
blocks, the status bar, the footer. None of them knows the app or the pane: they post messages."""

from __future__ import annotations

from typing import Any, ClassVar

from markdown_it import MarkdownIt
from markdown_it.rules_core import StateCore
from rich.text import Text
from textual import events
from textual.binding import Binding, BindingType
from textual.containers import Vertical, VerticalScroll
from textual.message import Message
from textual.widget import Widget
from textual.widgets import Collapsible, Footer, Label, Markdown, Static, TextArea
from textual.widgets.markdown import MarkdownBlock, MarkdownFence, MarkdownStream

BRANCHES = Binding.Group("Branch", compact=True)
NEAR_BOTTOM_ROWS = 2  # follow new text only when the view is this close to the end (oterm's rule)


class PromptArea(TextArea):
    """Multi-line input. Enter sends; shift+enter or ctrl+j inserts a newline. Many terminals
    send shift+enter as plain enter, so ctrl+j is the newline key that always arrives.

    Up in an empty prompt recalls earlier prompts (``recall``, oldest first; the pane fills
    it), and down walks back; "?" in an empty prompt asks for the key help."""

    # The keys are bindings (so a keymap can move them) but they run from _on_key, in order
    # with the text. A priority binding runs when the app *receives* a key, ahead of the keys
    # still queued here; an ordinary one runs when the key has bubbled up to the app, after
    # later keys were inserted. Either way a fast burst (a paste, quick typing) got "abcd"
    # for "ab", ctrl+j, "cd", or sent only part of the text.
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("enter", "submit", "Send", id="chat.send", show=False),
        Binding("shift+enter,ctrl+j", "newline", "Newline", id="chat.newline", key_display="^j"),
        Binding("up", "recall(-1)", "Earlier prompt", id="chat.recall_previous", show=False),
        Binding("down", "recall(1)", "Later prompt", id="chat.recall_next", show=False),
        # The app's help key again, here only so that the footer (which lists the focused
        # widget's keys first) names it before it runs out of width.
        Binding("f1", "app.help_screen", "Help", id="app.help"),
    ]
    _OWN_ACTIONS = ("submit", "newline")

    class Submitted(Message):
        def __init__(self, prompt: PromptArea, text: str) -> None:
            super().__init__()
            self.prompt = prompt
            self.text = text

    class HelpRequested(Message):
        pass

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(soft_wrap=True, show_line_numbers=False, tab_behavior="focus", **kwargs)
        self.recall: list[str] = []
        self._recall_at: int | None = None  # index into recall while walking it

    async def _on_key(self, event: events.Key) -> None:
        if event.character == "?" and not self.text:
            event.stop()
            event.prevent_default()
            self.post_message(self.HelpRequested())
            return
        active = self.screen.active_bindings.get(event.key)  # the keymap is applied here
        if active is not None and active.node is self and active.binding.action in self._OWN_ACTIONS:
            event.stop()
            event.prevent_default()  # skips TextArea._on_key, which would insert a newline
            await self.run_action(active.binding.action)

    def action_recall(self, step: int) -> None:
        # Only from an empty prompt, or one still showing a recalled prompt: anywhere else up
        # and down move the cursor, as they do in any text area (this binding replaced those).
        showing = self._recall_at is not None and self.text == self.recall[self._recall_at]
        if not self.recall or (self.text and not showing):
            if step < 0:
                self.action_cursor_up()
            else:
                self.action_cursor_down()
            return
        at = (self._recall_at if showing and self._recall_at is not None else len(self.recall)) + step
        if at >= len(self.recall):
            self._recall_at = None
            self.text = ""
            return
        self._recall_at = max(0, at)
        self.text = self.recall[self._recall_at]
        self.move_cursor(self.document.end)

    def action_submit(self) -> None:
        """Hands the text over and clears the prompt now, so keys typed after the send start
        the next message instead of being wiped when the send is handled."""
        text = self.text
        if not text.strip():
            return
        self._recall_at = None
        self.clear()
        self.post_message(self.Submitted(self, text))

    def action_newline(self) -> None:
        self.insert("\n")

    def restore(self, text: str) -> None:
        """Puts back a message that could not be sent, ahead of anything typed since."""
        self.text = text + self.text
        self.move_cursor(self.document.end)


class MessageList(VerticalScroll):
    """Keeps ``follow`` true while the user is at (or near) the bottom; new text scrolls the
    view only then, so reading back through a long reply is never yanked away."""

    can_focus = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.follow = True

    def watch_scroll_y(self, old_value: float, new_value: float) -> None:
        super().watch_scroll_y(old_value, new_value)
        # Growing content never moves scroll_y, so any change here is a scroll (ours or the
        # user's), and where it lands decides whether we keep following.
        self.follow = self.max_scroll_y - new_value <= NEAR_BOTTOM_ROWS

    def on_resize(self, event: events.Resize) -> None:
        # Sent when the content height changes too. That is the moment to stay at the end:
        # Markdown parses off the event loop, and a hidden tab has no layout at all until it
        # is shown, so a scroll requested earlier lands short. (Textual's anchor() was tried:
        # it left scroll_y negative when a Markdown shrank after its first layout.)
        self.follow_end()

    def follow_end(self) -> None:
        if self.follow:
            # After the next refresh the new text has its height; check follow again then, in
            # case the reader scrolled away in between.
            self.call_after_refresh(self._end_if_following)

    def _end_if_following(self) -> None:
        if self.follow:
            self.scroll_end(animate=False, immediate=True)


class CodeFence(MarkdownFence):
    """A code block under a header naming its language; a click anywhere on it (the header
    says so) copies the code."""

    def compose(self) -> Any:
        yield Label(self._header(), classes="fence-header")
        yield from super().compose()

    def _header(self) -> Text:
        return Text.assemble((self.lexer or "code", "bold"), ("  · click to copy", "dim"))

    async def _update_from_block(self, block: MarkdownBlock) -> None:
        await super()._update_from_block(block)
        if self.is_mounted and self.children:
            self.query_one(".fence-header", Label).update(self._header())


def _hard_breaks(state: StateCore) -> None:
    # A single newline is a line break, as chat models mean it (poems, addresses, line-broken
    # lists); CommonMark joins such lines into one. markdown-it's own "breaks" option only
    # changes its HTML renderer, so the tokens are changed here, before Textual reads them.
    for token in state.tokens:
        for child in token.children or ():
            if child.type == "softbreak":
                child.type = "hardbreak"


def _parser() -> MarkdownIt:
    md = MarkdownIt("gfm-like")
    md.core.ruler.push("hard_breaks", _hard_breaks)
    return md


class ChatMarkdown(Markdown):
    BLOCKS = {**Markdown.BLOCKS, "fence": CodeFence, "code_block": CodeFence}

    def __init__(self, markdown: str | None = None, **kwargs: Any) -> None:
        super().__init__(markdown, parser_factory=_parser, **kwargs)


FINISH_LABELS = {
    "abort": "stopped", "length": "cut at max tokens", "error": "failed",
    "interrupted": "interrupted: ctrl+g goes on, ctrl+r regenerates",
}
ROLE_NAMES = {"user": "You", "assistant": "Assistant", "error": "Error", "note": "Note", "system": "System prompt"}


class ThinkingBlock(Collapsible):
    """A reply's reasoning, folded above the answer: shown on request, never part of the
    answer (copying the reply copies the answer alone). Plain text, updated whole: while
    folded it costs no layout, and a thought is read once, not rendered as Markdown."""

    def __init__(self, reasoning: str, streaming: bool = False) -> None:
        super().__init__(Static(Text(reasoning), classes="thinking-body"), title=self._heading(reasoning, streaming),
                         collapsed=True, classes="thinking")
        self.reasoning = reasoning

    @staticmethod
    def _heading(reasoning: str, streaming: bool) -> str:
        words = len(reasoning.split())
        return f"Thinking… ({words:,} words)" if streaming else f"Thought for {words:,} words"

    def set_reasoning(self, reasoning: str, streaming: bool) -> None:
        self.reasoning = reasoning
        self.title = self._heading(reasoning, streaming)
        self.query_one(".thinking-body", Static).update(Text(reasoning))


class MessageView(Vertical):
    """One message. Assistant replies and notes are Markdown (streamed, then rendered once in
    full); user messages are plain text, so their asterisks and underscores stay as typed.

    User and assistant messages take focus (shift+tab or alt+up from the prompt), and then
    their keys act on them: the view posts ``Act`` and the pane does the work. A click
    copies the message, or just the code block under the pointer."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("up", "act('previous')", "Previous", id="message.previous", show=False),
        Binding("down", "act('next')", "Next", id="message.next", show=False),
        Binding("e", "act('edit')", "Edit", id="message.edit"),
        # ctrl+r too: on a selected reply it means this one, and the footer then names it once
        Binding("r,ctrl+r", "act('regenerate')", "Retry", id="message.regenerate"),
        Binding("left", "act('branch', -1)", "Branch", id="message.branch_previous", key_display="←", group=BRANCHES),
        Binding("right", "act('branch', 1)", "Branch", id="message.branch_next", key_display="→", group=BRANCHES),
        Binding("c", "act('copy')", "Copy", id="message.copy"),
        Binding("k", "act('copy_code')", "Code", id="message.copy_code"),
        # off the footer, which must fit 80 columns: the help names it, and esc is what one tries
        Binding("escape", "act('leave')", "Back", id="message.leave", show=False),
    ]

    class CopyRequested(Message):
        def __init__(self, text: str, what: str) -> None:
            super().__init__()
            self.text = text
            self.what = what

    class Act(Message):
        """A key pressed on a focused message: previous, next, edit, regenerate, branch (with
        ``step``), copy, copy_code or leave."""

        def __init__(self, view: MessageView, what: str, step: int = 0) -> None:
            super().__init__()
            self.view = view
            self.what = what
            self.step = step

    def __init__(
        self, role: str, content: str, *, finish_reason: str | None = None, meta: dict[str, Any] | None = None,
        message_id: int | None = None, branch: tuple[int, int] = (0, 1), reasoning: str = "",
    ) -> None:
        super().__init__(classes=f"message {role}")
        self.role = role
        self.content = content
        self.reasoning = reasoning  # a reply's thinking, shown folded in a ThinkingBlock
        self.finish_reason = finish_reason
        self.meta = dict(meta or {})
        self.message_id = message_id
        self.branch = branch  # (index, count) among the alternatives at this point
        self.can_focus = role in ("user", "assistant")
        self._stream: MarkdownStream | None = None
        self.streaming = False

    def compose(self) -> Any:
        yield Label(self._header(), classes="header")
        if self.role == "assistant" and self.reasoning:
            yield ThinkingBlock(self.reasoning)
        if self.role in ("assistant", "note"):
            yield ChatMarkdown(self.content, classes="body")
        elif self.role == "system":
            text = Text(self.content) if self.content.strip() else Text("the model's default", style="dim italic")
            yield Static(text, classes="body")
        else:
            yield Static(Text(self.content), classes="body")

    def _header(self) -> Text:
        header = Text(ROLE_NAMES.get(self.role, self.role), style="bold")
        bits = []
        if self.role == "assistant":
            if self.finish_reason == "length" and self.meta.get("context_limit"):
                bits.append("cut at the context limit")
            elif self.finish_reason in FINISH_LABELS:
                bits.append(FINISH_LABELS[self.finish_reason])
            elif self.finish_reason is None and self.streaming:
                bits.append("…")
            if self.meta.get("tok_s"):
                bits.append(f"{self.meta['tok_s']:.1f} tok/s")
            if self.meta.get("cached_tokens"):
                bits.append(f"{self.meta['cached_tokens']} cached")
        if self.meta.get("tokens"):
            # "~": a guess (a server that reported no usage); a server counts the system
            # prompt with the first message
            count = f"{'~' if self.meta.get('estimated') else ''}{self.meta['tokens']:,} tok"
            bits.append(count + (" with the system prompt" if self.meta.get("with_system") else ""))
        if self.branch[1] > 1:
            bits.append(f"‹ {self.branch[0] + 1}/{self.branch[1]} ›")
        if self.role == "system":
            bits.append("ctrl+s changes it")
        if bits:
            header.append("  " + " · ".join(bits), style="dim")
        return header

    @property
    def markdown(self) -> Markdown:
        return self.query_one(ChatMarkdown)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "act" and parameters:
            what = parameters[0]
            if what == "edit":
                return self.role == "user"
            if what == "regenerate":
                return self.role == "assistant"
            if what == "copy_code":
                return self.role == "assistant"
            if what == "branch":
                return self.branch[1] > 1
        return True

    def action_act(self, what: str, step: int = 0) -> None:
        self.post_message(self.Act(self, what, step))

    def begin(self) -> None:
        self.streaming = True
        self.refresh_header()

    async def write(self, chunk: str) -> None:
        # The stream is made on the first write, not before: its task must get to run once
        # before stop() cancels it, or stop() raises CancelledError into the caller.
        if self._stream is None:
            self._stream = Markdown.get_stream(self.markdown)
        await self._stream.write(chunk)

    async def set_reasoning(self, reasoning: str) -> None:
        """Shows the reply's reasoning so far (folded); the block appears with the first of it."""
        self.reasoning = reasoning
        blocks = self.query(ThinkingBlock)
        if blocks:
            blocks.first().set_reasoning(reasoning, self.streaming)
        elif reasoning:
            await self.mount(ThinkingBlock(reasoning, self.streaming), before=self.query_one(".body"))

    def refresh_header(self) -> None:
        if self.is_mounted:
            self.query_one(".header", Label).update(self._header())

    def set_branch(self, branch: tuple[int, int]) -> None:
        self.branch = branch
        self.refresh_header()

    async def finish(self, content: str, finish_reason: str | None, meta: dict[str, Any] | None = None) -> None:
        """Stops the stream and renders the whole reply once: appends can leave a code fence
        or a list half-parsed, a full render cannot."""
        self.content = content
        self.finish_reason = finish_reason
        self.streaming = False
        if meta:
            self.meta.update(meta)
        stream, self._stream = self._stream, None
        if stream is not None:
            await stream.stop()
        if self.role in ("assistant", "note"):
            await self.markdown.update(content)
        for block in self.query(ThinkingBlock):  # "Thinking…" becomes "Thought"
            block.set_reasoning(self.reasoning, streaming=False)
        self.refresh_header()

    async def set_content(self, content: str) -> None:
        """Replaces the text of a message that is not streaming (the system prompt after a
        settings change)."""
        self.content = content
        if self.role in ("assistant", "note"):
            await self.markdown.update(content)
        elif self.role == "system":
            text = Text(content) if content.strip() else Text("the model's default", style="dim italic")
            self.query_one(".body", Static).update(text)
        else:
            self.query_one(".body", Static).update(Text(content))

    def on_click(self, event: events.Click) -> None:
        node: Widget | None = event.widget
        while node is not None and node is not self:
            if isinstance(node, MarkdownFence):
                self.post_message(self.CopyRequested(node.code, "code block"))
                return
            node = node.parent if isinstance(node.parent, Widget) else None
        if self.role != "system":
            self.post_message(self.CopyRequested(self.content, "message"))


class StatusBar(Widget):
    """One line: model, precision and device, then this tab's speed, context and the engine's state.

    Repainted a few times a second, so it never asks for a layout pass (``Static.update``
    would, and a layout of the whole screen costs tens of milliseconds on a long chat)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._text = Text()

    def set_text(self, text: Text) -> None:
        if text == self._text:
            return
        self._text = text
        self.refresh()

    @property
    def text(self) -> Text:
        return self._text

    def render(self) -> Text:
        return self._text


class ChatFooter(Footer):
    """The footer with the keys a new user needs first: tabs, newline, help and quit, always
    in the same place at the left; then what applies to the focus now; new tab last.

    Textual orders the keys by the focus chain (the focused widget's first), and a footer
    wider than the terminal is cut at the right: at 80 columns, with a message selected,
    quit and help were the keys cut. Order is by action; the labels are short enough that
    the usual states fit 80 columns whole."""

    FIRST: ClassVar[tuple[str, ...]] = ("previous_tab", "next_tab", "newline", "app.help_screen", "help_screen",
                                        "quit")
    LAST: ClassVar[tuple[str, ...]] = ("new_tab",)

    @classmethod
    def rank(cls, action: str | None) -> int:
        if action in cls.FIRST:
            return cls.FIRST.index(action)
        if action in cls.LAST:
            return 1000 + cls.LAST.index(action)
        return 100  # in the focus chain's order among themselves (the sort is stable)

    async def recompose(self) -> None:
        await super().recompose()
        # Units: a key, or a group of keys (tab switching) with the label after it. The
        # command palette's key is docked right and stays where it is.
        units: list[list[Widget]] = []
        for child in self.children:
            if child.has_class("-command-palette"):
                continue
            if units and not hasattr(child, "action") and not child.children:
                units[-1].append(child)  # a group's label
            else:
                units.append([child])
        ordered = [w for unit in sorted(units, key=lambda u: self.rank(self._action(u[0]))) for w in unit]
        for i, widget in enumerate(ordered):
            if self.children.index(widget) != i:
                self.move_child(widget, before=i)

    @staticmethod
    def _action(widget: Widget) -> str | None:
        action = getattr(widget, "action", None)
        if action is None and widget.children:  # a group: its first key's
            action = getattr(widget.children[0], "action", None)
        return action
