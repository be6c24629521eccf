"""One chat tab: its conversation, its prompt and its own generation worker.

Every tab streams through the one shared engine at the same time; nothing serialises tabs.
The engine thread hands each step's outputs to this event loop in one batch
(``AsyncEngine._deliver``); this pane folds them into a buffer and repaints at most once a
frame from a timer, so neither the engine nor the UI waits on the other.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import aclosing, suppress
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from textual import work
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.timer import Timer
from textual.worker import Worker, WorkerCancelled, WorkerFailed, WorkerState

from localllm.history import Conversation
from localllm.tui.backend import code_blocks, sampling_params, title_from
from localllm.tui.widgets import MessageList, MessageView, PromptArea

if TYPE_CHECKING:
    from localllm.tui.app import ChatApp

FRAME_S = 1 / 20  # at most one Markdown append per tab per 50 ms: each one costs a layout pass of the screen


@dataclass(slots=True)
class Turn:
    """A message as the pane holds it; ``message_id`` is its history row once committed."""

    role: str
    content: str
    message_id: int | None = None
    finish_reason: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class Reply:
    """The reply being streamed: text so far, text not yet painted, and speed figures."""

    view: MessageView
    request_id: str
    text: str = ""
    pending: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    num_tokens: int = 0
    cached_tokens: int = 0
    tok_s: float = 0.0
    first_token_time: float | None = None
    settled: bool = False  # committed to history; Esc during the final render must not commit twice

    def add(self, out: Any) -> None:
        completion = out.outputs[0]
        if completion.delta_text:
            self.pending.append(completion.delta_text)
        self.text = completion.text if completion.text is not None else self.text + (completion.delta_text or "")
        self.num_tokens = len(completion.token_ids or ()) or self.num_tokens + 1
        self.cached_tokens = int(getattr(out, "num_cached_tokens", 0) or 0)
        m = getattr(out, "metrics", None)
        first = getattr(m, "first_token_time", None) if m is not None else None
        last = getattr(m, "last_token_time", None) if m is not None else None
        if first is None:  # an engine without metrics: time it here
            self.first_token_time = self.first_token_time or time.monotonic()
            first, last = self.first_token_time, time.monotonic()
        if last is not None and last > first and self.num_tokens > 1:
            self.tok_s = (self.num_tokens - 1) / (last - first)
        if out.finished:
            self.finish_reason = completion.finish_reason or "stop"

    def meta(self) -> dict[str, Any]:
        return {"tok_s": round(self.tok_s, 2), "cached_tokens": self.cached_tokens, "tokens": self.num_tokens}


def describe(e: BaseException) -> str:
    from localllm.errors import LocalLLMError

    # LocalLLMError messages are written for users; anything else needs its type to make sense.
    return str(e) if isinstance(e, LocalLLMError) else f"{type(e).__name__}: {e}"


class ChatPane(Vertical):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "stop", "Stop", id="chat.stop"),
        Binding("ctrl+r", "regenerate", "Regenerate", id="chat.regenerate"),
        Binding("alt+e", "edit_last", "Edit last", id="chat.edit_last", show=False),
        Binding("alt+c", "copy_reply", "Copy reply", id="chat.copy_reply", show=False),
        # Not alt+b: terminals send ESC b, which Textual reads as ctrl+left (word left).
        Binding("alt+k", "copy_code", "Copy code", id="chat.copy_code", show=False),
    ]

    def __init__(
        self, *, title: str, system_prompt: str, params: dict[str, Any], conversation: Conversation | None = None,
        turns: list[Turn] | None = None, id: str | None = None,
    ) -> None:
        super().__init__(id=id, classes="chat")
        self.title = title
        self.system_prompt = system_prompt
        self.params = dict(params)
        self.conversation = conversation
        self.turns: list[Turn] = list(turns or [])
        self.reply: Reply | None = None
        last = next((t for t in reversed(self.turns) if t.role == "assistant"), None)
        self.last_tok_s = float(last.meta.get("tok_s", 0.0)) if last else 0.0
        self.last_cached_tokens = int(last.meta.get("cached_tokens", 0)) if last else 0
        self._worker: Worker[None] | None = None
        self._flush_timer: Timer | None = None

    @property
    def chat_app(self) -> ChatApp:
        return self.app  # type: ignore[return-value]

    def compose(self) -> Any:
        with MessageList(classes="messages"):
            for t in self.turns:
                yield MessageView(t.role, t.content, finish_reason=t.finish_reason, meta=t.meta,
                                  message_id=t.message_id)
        yield PromptArea(classes="prompt")

    def on_mount(self) -> None:
        self.messages.follow_end()  # a restored chat opens at its end

    @property
    def messages(self) -> MessageList:
        return self.query_one(MessageList)

    @property
    def prompt(self) -> PromptArea:
        return self.query_one(PromptArea)

    @property
    def generating(self) -> bool:
        return self._worker is not None and self._worker.state in (WorkerState.PENDING, WorkerState.RUNNING)

    # ---- sending ----

    def on_prompt_area_submitted(self, event: PromptArea.Submitted) -> None:
        event.stop()
        if self.generating:
            event.prompt.restore(event.text)
            self.notify("Still replying: Esc stops it.", severity="warning")
            return
        self._commit("user", event.text.strip())
        self._start()

    def _commit(self, role: str, content: str, finish_reason: str | None = None,
                meta: dict[str, Any] | None = None, view: MessageView | None = None) -> None:
        """Writes a message to history at once (durability: a kill after this loses nothing),
        then shows it. History failing is reported and the chat goes on in memory."""
        history = self.chat_app.history
        turn = Turn(role, content, None, finish_reason, dict(meta or {}))
        try:
            if self.conversation is None:
                if self.title.startswith("Chat ") and role == "user":
                    self.title = title_from(content)
                    self.chat_app.retitle(self)
                self.conversation = history.create_conversation(
                    self.title, self.system_prompt, self.params, self.chat_app.model_name)
                self.chat_app.save_open_tabs()
            stored = history.add_message(self.conversation.id, role, content, finish_reason, meta)
            turn.message_id = stored.id
        except Exception as e:  # noqa: BLE001 - a full disk must not end the chat
            self.notify(f"History not saved: {e}", severity="error")
        self.turns.append(turn)
        if view is None:
            view = MessageView(role, content, finish_reason=finish_reason, meta=meta, message_id=turn.message_id)
            self.messages.mount(view)
            self.messages.follow = True
            self.messages.follow_end()
        else:
            view.message_id = turn.message_id

    def prompt_messages(self) -> list[dict[str, str]]:
        msgs = [{"role": "system", "content": self.system_prompt}] if self.system_prompt.strip() else []
        msgs += [{"role": t.role, "content": t.content} for t in self.turns if t.role in ("user", "assistant")]
        return msgs

    def _start(self) -> None:
        self._worker = self._generate()

    @work(exclusive=True, group="generate", exit_on_error=False)
    async def _generate(self) -> None:
        app = self.chat_app
        view = MessageView("assistant", "")
        reply = Reply(view, f"{self.id or 'chat'}-{uuid.uuid4().hex[:12]}")
        self.reply = reply
        try:
            await self.messages.mount(view)
            self.messages.follow_end()
            view.begin()
            if app.engine is None and app.loading:
                self.notify("The model is still loading; the reply starts when it is ready.")
            engine = await app.wait_for_engine()
            params = sampling_params(self.params)
            self._flush_timer = self.set_interval(FRAME_S, self._flush)
            async with aclosing(engine.generate(self.prompt_messages(), params, request_id=reply.request_id)) as outs:
                async for out in outs:
                    reply.add(out)
                    self.last_tok_s = reply.tok_s
            await self._finish(reply, reply.finish_reason or "stop")
        except asyncio.CancelledError:
            # Esc or closing the tab: the engine request is already aborted (aclosing closed
            # the stream, whose finally aborts it); keep and save what came so far.
            self._settle(reply, "abort")  # a no-op if Esc came during the final render
            if self.is_attached:
                self.call_later(self._final_render, reply, reply.finish_reason or "abort")
            raise
        except Exception as e:  # noqa: BLE001 - errors stay inside this tab
            await self._finish(reply, "error")
            await self.show_error(describe(e))

    async def _flush(self) -> None:
        reply = self.reply
        if reply is None or not reply.pending or not self.chat_app.is_active(self):
            return  # a hidden tab keeps buffering; it paints when shown
        chunk = "".join(reply.pending)
        reply.pending.clear()
        await reply.view.write(chunk)
        # follow is read after the write: the reader may have scrolled away meanwhile.
        self.messages.follow_end()

    def _settle(self, reply: Reply, finish_reason: str) -> None:
        """The synchronous end of a reply: stop repainting, record the figures, commit."""
        if reply.settled:
            return
        reply.settled = True
        if self._flush_timer is not None:
            self._flush_timer.stop()
            self._flush_timer = None
        reply.finish_reason = finish_reason
        reply.pending.clear()
        self.last_tok_s = reply.tok_s
        self.last_cached_tokens = reply.cached_tokens
        if reply.text or finish_reason not in ("abort", "error"):
            self._commit("assistant", reply.text, finish_reason, reply.meta(), view=reply.view)
        if self.reply is reply:
            self.reply = None

    async def _finish(self, reply: Reply, finish_reason: str) -> None:
        self._settle(reply, finish_reason)
        await self._final_render(reply, finish_reason)

    async def _final_render(self, reply: Reply, finish_reason: str) -> None:
        if not reply.text and finish_reason in ("abort", "error"):
            await reply.view.remove()
            return
        await reply.view.finish(reply.text, finish_reason, reply.meta())
        self.messages.follow_end()

    async def show_error(self, text: str) -> None:
        await self.messages.mount(MessageView("error", text))
        self.messages.follow = True
        self.messages.follow_end()

    # ---- stopping ----

    async def stop(self) -> None:
        """Cancels the reply (if any) and waits until its partial text is committed."""
        worker = self._worker
        if worker is None or not self.generating:
            return
        worker.cancel()
        with suppress(WorkerCancelled, WorkerFailed, asyncio.CancelledError):
            await worker.wait()

    async def action_stop(self) -> None:
        await self.stop()

    # ---- regenerate, edit, copy ----

    async def _truncate(self, index: int) -> None:
        """Drops turns[index:] from the view and from history."""
        dropped = self.turns[index:]
        if not dropped:
            return
        first_id = next((t.message_id for t in dropped if t.message_id is not None), None)
        if self.conversation is not None and first_id is not None:
            try:
                self.chat_app.history.delete_messages_from(self.conversation.id, first_id)
            except Exception as e:  # noqa: BLE001
                self.notify(f"History not updated: {e}", severity="error")
        del self.turns[index:]
        views = [v for v in self.messages.query(MessageView) if v.role in ("user", "assistant")]
        for v in views[index:]:
            await v.remove()
        for v in self.messages.query(MessageView).filter(".error"):
            await v.remove()

    async def action_regenerate(self) -> None:
        if self.generating:
            await self.stop()
        if not self.turns:
            return
        if self.turns[-1].role == "assistant":
            await self._truncate(len(self.turns) - 1)
        if self.turns and self.turns[-1].role == "user":
            self._start()

    async def action_edit_last(self) -> None:
        if self.generating:
            await self.stop()
        index = next((i for i in range(len(self.turns) - 1, -1, -1) if self.turns[i].role == "user"), None)
        if index is None:
            return
        text = self.turns[index].content
        await self._truncate(index)
        self.prompt.text = text
        self.prompt.move_cursor(self.prompt.document.end)
        self.prompt.focus()

    def last_reply(self) -> str | None:
        if self.reply is not None and self.reply.text:
            return self.reply.text
        return next((t.content for t in reversed(self.turns) if t.role == "assistant"), None)

    def action_copy_reply(self) -> None:
        text = self.last_reply()
        if text:
            self.chat_app.copy_text(text, "reply")
        else:
            self.notify("No reply to copy yet.")

    def action_copy_code(self) -> None:
        for t in reversed(self.turns):
            if t.role == "assistant" and (blocks := code_blocks(t.content)):
                self.chat_app.copy_text(blocks[-1], "code block")
                return
        self.notify("No code block to copy.")

    def on_message_view_copy_requested(self, event: MessageView.CopyRequested) -> None:
        self.chat_app.copy_text(event.text, event.what)

    # ---- settings ----

    def apply_settings(self, system_prompt: str, params: dict[str, Any]) -> None:
        self.system_prompt = system_prompt
        self.params = dict(params)
        if self.conversation is not None:
            try:
                self.chat_app.history.update_conversation(
                    self.conversation.id, system_prompt=system_prompt, params=self.params)
            except Exception as e:  # noqa: BLE001
                self.notify(f"History not updated: {e}", severity="error")
