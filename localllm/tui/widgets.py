"""The chat's building blocks: the prompt, the scrolling message list, one message, the status bar."""

from __future__ import annotations

from typing import Any, ClassVar

from rich.text import Text
from textual import events
from textual.binding import Binding, BindingType
from textual.containers import Vertical, VerticalScroll
from textual.message import Message
from textual.widget import Widget
from textual.widgets import Label, Markdown, Static, TextArea
from textual.widgets.markdown import MarkdownFence, MarkdownStream

NEAR_BOTTOM_ROWS = 2  # follow new text only when the view is this close to the end (oterm's rule)


class PromptArea(TextArea):
    """Multi-line input. Enter sends; shift+enter or ctrl+j inserts a newline. Many terminals
    send shift+enter as plain enter, so ctrl+j is the newline key that always arrives."""

    # The keys are bindings (so a keymap can move them) but they run from _on_key, in order
    # with the text. A priority binding runs when the app *receives* a key, ahead of the keys
    # still queued here; an ordinary one runs when the key has bubbled up to the app, after
    # later keys were inserted. Either way a fast burst (a paste, quick typing) got "abcd"
    # for "ab", ctrl+j, "cd", or sent only part of the text.
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("enter", "submit", "Send", id="chat.send"),
        Binding("shift+enter,ctrl+j", "newline", "Newline", id="chat.newline", show=False),
    ]
    _OWN_ACTIONS = ("submit", "newline")

    class Submitted(Message):
        def __init__(self, prompt: PromptArea, text: str) -> None:
            super().__init__()
            self.prompt = prompt
            self.text = text

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(soft_wrap=True, show_line_numbers=False, tab_behavior="focus", **kwargs)

    async def _on_key(self, event: events.Key) -> None:
        active = self.screen.active_bindings.get(event.key)  # the keymap is applied here
        if active is not None and active.node is self and active.binding.action in self._OWN_ACTIONS:
            event.stop()
            event.prevent_default()  # skips TextArea._on_key, which would insert a newline
            await self.run_action(active.binding.action)

    def action_submit(self) -> None:
        """Hands the text over and clears the prompt now, so keys typed after the send start
        the next message instead of being wiped when the send is handled."""
        text = self.text
        if not text.strip():
            return
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


class MessageView(Vertical):
    """One message. Assistant replies are Markdown (streamed, then rendered once in full);
    user messages are plain text, so their asterisks and underscores stay as typed.
    A click copies the message, or just the code block under the pointer."""

    class CopyRequested(Message):
        def __init__(self, text: str, what: str) -> None:
            super().__init__()
            self.text = text
            self.what = what

    def __init__(
        self, role: str, content: str, *, finish_reason: str | None = None, meta: dict[str, Any] | None = None,
        message_id: int | None = None,
    ) -> None:
        super().__init__(classes=f"message {role}")
        self.role = role
        self.content = content
        self.finish_reason = finish_reason
        self.meta = dict(meta or {})
        self.message_id = message_id
        self._stream: MarkdownStream | None = None
        self.streaming = False

    def compose(self) -> Any:
        yield Label(self._header(), classes="header")
        if self.role == "assistant":
            yield Markdown(self.content, classes="body")
        else:
            yield Static(Text(self.content), classes="body")

    def _header(self) -> Text:
        names = {"user": "You", "assistant": "Assistant", "error": "Error", "note": "Note"}
        header = Text(names.get(self.role, self.role), style="bold")
        bits = []
        if self.role == "assistant":
            if self.finish_reason == "abort":
                bits.append("stopped")
            elif self.finish_reason == "length":
                bits.append("cut at max tokens")
            elif self.finish_reason == "error":
                bits.append("failed")
            elif self.finish_reason is None and self.streaming:
                bits.append("…")
            if self.meta.get("tok_s"):
                bits.append(f"{self.meta['tok_s']:.1f} tok/s")
            if self.meta.get("cached_tokens"):
                bits.append(f"{self.meta['cached_tokens']} cached")
        if bits:
            header.append("  " + " · ".join(bits), style="dim")
        return header

    @property
    def markdown(self) -> Markdown:
        return self.query_one(Markdown)

    def begin(self) -> None:
        self.streaming = True
        self.refresh_header()

    async def write(self, chunk: str) -> None:
        # The stream is made on the first write, not before: its task must get to run once
        # before stop() cancels it, or stop() raises CancelledError into the caller.
        if self._stream is None:
            self._stream = Markdown.get_stream(self.markdown)
        await self._stream.write(chunk)

    def refresh_header(self) -> None:
        if self.is_mounted:
            self.query_one(".header", Label).update(self._header())

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
        if self.role == "assistant":
            await self.markdown.update(content)
        self.refresh_header()

    def on_click(self, event: events.Click) -> None:
        node: Widget | None = event.widget
        while node is not None and node is not self:
            if isinstance(node, MarkdownFence):
                self.post_message(self.CopyRequested(node.code, "code block"))
                return
            node = node.parent if isinstance(node.parent, Widget) else None
        self.post_message(self.CopyRequested(self.content, "message"))


class StatusBar(Widget):
    """One line: model, precision and device, then this tab's speed and the engine's state.

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
