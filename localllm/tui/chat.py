"""One chat tab: its conversation, its prompt and its own generation worker.

Every tab streams through the one shared engine at the same time; nothing serialises tabs.
The engine thread hands each step's outputs to this event loop in one batch
(``AsyncEngine._deliver``); this pane folds them into a buffer and repaints at most once a
frame from a timer, so neither the engine nor the UI waits on the other. A second, slower
timer writes the reply so far to the history (``SAVE_S``): a crash loses at most that much.

The pane knows the app only as a ``ChatHost`` and tells it about itself through messages
(``Changed``, ``NewChatRequested``, ``MessageView.CopyRequested``); it never imports the app.
The pane is the only writer of its conversation's rows in the history. What it holds is in
``conversation`` (turns, the streamed reply), what that costs in context in ``context_count``.
"""

from __future__ import annotations

import asyncio
import traceback
import uuid
from contextlib import aclosing, suppress
from typing import TYPE_CHECKING, Any, ClassVar

from textual import work
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.message import Message
from textual.timer import Timer
from textual.widget import Widget
from textual.widgets import Static
from textual.worker import Worker, WorkerCancelled, WorkerFailed, WorkerState

from localllm.history import Conversation
from localllm.reasoning import HarmonyCall, HarmonyParser
from localllm.tui.backend import code_blocks, continuation_prompt, sampling_params, title_from
from localllm.tui.context_count import ContextCount, reply_reserve
from localllm.tui.conversation import CONTINUABLE, ChatHost, Reply, Turn, describe
from localllm.tui.screens import ContextFullScreen
from localllm.tui.widgets import MessageList, MessageView, PromptArea

if TYPE_CHECKING:
    from localllm.tokenizer import Message as ChatMessage

FRAME_S = 1 / 20  # at most one Markdown append per tab per 50 ms: each one costs a layout pass of the screen
SAVE_S = 1.0  # a streaming reply reaches the history at most this far behind
WARN_FILL = 0.8  # share of the context at which the chat says it is filling up


def tool_call_note(calls: list[HarmonyCall]) -> str:
    """What the chat says of a reply's tool calls (gpt-oss addressing ``functions.NAME`` or a
    built-in tool): this chat runs no tools, and a call is neither answer nor reasoning, so
    it is shown apart, with its arguments as written."""
    return "\n\n".join(f"Tool call: the model called `{c.recipient}` (this chat runs no tools; the call is not "
                       f"part of the answer) with\n\n```{c.content_type or ''}\n{c.arguments}\n```" for c in calls)


class ChatPane(ContextCount, Vertical):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "stop", "Stop", id="chat.stop"),
        Binding("ctrl+r", "regenerate", "Retry", id="chat.regenerate"),
        Binding("ctrl+g", "continue", "Go on", id="chat.continue"),
        Binding("alt+e", "edit_last", "Edit last", id="chat.edit_last", show=False),
        Binding("alt+up", "focus_messages", "Messages", id="chat.messages", show=False),
        Binding("alt+c", "copy_reply", "Copy reply", id="chat.copy_reply", show=False),
        # Not alt+b: terminals send ESC b, which Textual reads as ctrl+left (word left).
        Binding("alt+k", "copy_code", "Copy code", id="chat.copy_code", show=False),
    ]

    class Changed(Message):
        """The title, the conversation or the busy state changed: the app repaints the tab."""

        def __init__(self, pane: ChatPane) -> None:
            super().__init__()
            self.pane = pane

    class NewChatRequested(Message):
        """Go on in a new tab: with ``turns`` copied and ``system_prompt``, then send ``text``."""

        def __init__(self, pane: ChatPane, system_prompt: str, params: dict[str, Any], turns: list[Turn],
                     text: str) -> None:
            super().__init__()
            self.pane = pane
            self.system_prompt = system_prompt
            self.params = params
            self.turns = turns
            self.text = text

    def __init__(
        self, host: ChatHost, *, title: str, system_prompt: str, params: dict[str, Any],
        conversation: Conversation | None = None, turns: list[Turn] | None = None, id: str | None = None,
    ) -> None:
        super().__init__(id=id, classes="chat")
        self.host = host
        self.title = title
        self.system_prompt = system_prompt
        self.params = dict(params)  # this tab's own settings, over host.base_params()
        self.conversation = conversation
        self.turns: list[Turn] = list(turns or [])
        self.views: list[MessageView] = [self._view(t) for t in self.turns]  # one per turn, same order
        # turns[:context_start] stay on screen but are not sent (dropped to make room)
        dropped = conversation.dropped_until if conversation is not None else None
        self.context_start = self._index_of(dropped) + 1 if dropped is not None else 0
        self.reply: Reply | None = None
        self.editing: int | None = None  # index of the user turn being edited in the prompt
        last = next((t for t in reversed(self.turns) if t.role == "assistant"), None)
        self.last_tok_s = float(last.meta.get("tok_s", 0.0)) if last else 0.0
        self.last_cached_tokens = int(last.meta.get("cached_tokens", 0)) if last else 0
        self._warned_full = False
        self._worker: Worker[None] | None = None
        self._flush_timer: Timer | None = None
        self._save_timer: Timer | None = None

    def _index_of(self, message_id: int) -> int:
        """The index of that message on the branch shown; -1 if it is on another branch."""
        return next((i for i, t in enumerate(self.turns) if t.message_id == message_id), -1)

    @staticmethod
    def _view(t: Turn) -> MessageView:
        return MessageView(t.role, t.content, finish_reason=t.finish_reason, meta=t.meta, message_id=t.message_id,
                           branch=t.branch, reasoning=t.reasoning)

    def compose(self) -> Any:
        with MessageList(classes="messages"):
            yield MessageView("system", self.system_prompt)
            for i, v in enumerate(self.views):
                if i == self.context_start and i > 0:
                    yield self._divider()
                v.set_class(i < self.context_start, "-dropped")
                yield v
        yield PromptArea(classes="prompt")

    def on_mount(self) -> None:
        with suppress(Exception):  # the recall list is a convenience; a broken history has none
            self.prompt.recall = self.host.history.recent_prompts()
        self._show_system_tokens()
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

    @property
    def shown(self) -> bool:
        """Whether this tab is the one on screen (the tab switcher hides the others' panes)."""
        return isinstance(self.parent, Widget) and self.parent.display

    def effective_params(self) -> dict[str, Any]:
        return {**self.host.base_params(), **self.params}

    def _changed(self) -> None:
        self.refresh_bindings()  # the footer shows Stop, Regenerate and Go on only when they apply
        self.post_message(self.Changed(self))

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "stop":
            return self.generating or self.editing is not None
        # not while editing: the footer then names only what ends the edit
        if action == "regenerate":
            return bool(self.turns) and not self.generating and self.editing is None
        if action == "continue":
            return (not self.generating and self.editing is None and bool(self.turns) and self.turns[-1].role == "assistant"
                    and self.turns[-1].finish_reason in CONTINUABLE)
        return True

    # ---- the context window: counted in ContextCount ----

    def _count_prompt(self, reply: Reply) -> None:
        """Makes the count of the user message a reply answers exact (see ``_counted_prompt``),
        on screen and in the history."""
        counted = self._counted_prompt(reply)
        if counted is None:
            return
        index, meta = counted
        user = self.turns[index]
        user.meta = meta
        view = self.views[index]
        view.meta = dict(meta)
        view.refresh_header()
        if user.message_id is not None:
            try:
                self.host.history.update_message(user.message_id, meta=meta)
            except Exception as e:  # noqa: BLE001
                self.log.warning(f"could not save the message's token count: {e}")

    def _show_system_tokens(self) -> None:
        """The system prompt's own count on its header, where the engine is local."""
        n = self.system_prompt_tokens()
        view = self.messages.query(MessageView).filter(".system").first()
        if view.meta.get("tokens") != n:
            view.meta = {"tokens": n} if n else {}
            view.refresh_header()

    # ---- sending ----

    async def on_prompt_area_submitted(self, event: PromptArea.Submitted) -> None:
        event.stop()
        if self.generating:
            event.prompt.restore(event.text)
            self.notify("Still replying: Esc stops it.", severity="warning")
            return
        text = event.text.strip()
        limit = self.context_limit()
        if limit is not None:
            upto = self.editing  # an edit replaces the turns from there on
            own, guess = self._new_message_tokens(text, upto)
            reserve = reply_reserve(limit, self.effective_params().get("max_tokens"))
            if own + reserve > limit:  # no room would help: the message alone is too long
                event.prompt.restore(event.text)
                await self.show_error(f"this message is {'about ' if guess else ''}{own:,} tokens, and with room "
                                      f"for a reply that is over the context limit of {limit:,}: shorten it")
                return
            need = self.context(upto)[0] + own
            if need + reserve > limit:
                event.prompt.restore(event.text)  # kept until the user chooses
                self.ask_for_room(text, need, limit)
                return
        await self.send(text)

    async def send(self, text: str) -> None:
        """Sends ``text`` as the next user message (or, while editing, as a new branch at
        the edited message) and starts the reply."""
        if self.editing is not None:
            index, self.editing = self.editing, None
            parent = self.turns[index].parent_id
            self._end_edit_marks()
            await self._drop_views_from(index)
        else:
            parent = self._last_id()
        self.prompt.recall.append(text)
        tokens, guess = self._new_message_tokens(text)
        self._commit("user", text, None, {"tokens": tokens, **({"estimated": True} if guess else {})}, parent)
        self._start()

    def _last_id(self) -> int | None:
        """The parent of what comes next: the pane's last turn, which is the history's head
        except right after a regenerate took the old reply off the screen."""
        return self.turns[-1].message_id if self.turns else None

    def _commit(self, role: str, content: str, finish_reason: str | None, meta: dict[str, Any],
                parent_id: int | None, view: MessageView | None = None) -> Turn:
        """Writes a message to history at once (durability: a kill after this loses nothing),
        then shows it. History failing is reported and the chat goes on in memory."""
        history = self.host.history
        turn = Turn(role, content, None, finish_reason, dict(meta or {}))
        try:
            if self.conversation is None:
                if self.title.startswith("Chat ") and role == "user":
                    self.title = title_from(content)
                self.conversation = history.create_conversation(
                    self.title, self.system_prompt, self.params, self.host.model_name)
                self._changed()
            stored = history.add_message(self.conversation.id, role, content, finish_reason, meta, parent_id)
            turn.message_id, turn.parent_id = stored.id, stored.parent_id
            turn.branch = (stored.sibling_index, stored.num_siblings)
        except Exception as e:  # noqa: BLE001 - a full disk must not end the chat
            self.notify(f"History not saved: {e}", severity="error")
        self.turns.append(turn)
        if view is None:
            view = self._view(turn)
            self.messages.mount(view)
            self.messages.follow = True
            self.messages.follow_end()
        else:
            view.message_id = turn.message_id
            view.set_branch(turn.branch)
        self.views.append(view)
        return turn

    def _start(self, continue_index: int | None = None) -> None:
        self._worker = self._generate(continue_index)

    @work(exclusive=True, group="generate", exit_on_error=False)
    async def _generate(self, continue_index: int | None = None) -> None:
        host = self.host
        await self._clear_transients()
        if continue_index is None:
            prompt_msgs = self.prompt_messages()
            view = MessageView("assistant", "")
            # The reply's row exists from its start (finish_reason NULL) and grows with it.
            turn = self._commit("assistant", "", None, {}, self._last_id(), view=view)
            await self.messages.mount(view)
            reply = Reply(view, turn, self._request_id())
        else:
            turn, view = self.turns[continue_index], self.views[continue_index]
            prompt_msgs = self.prompt_messages(continue_index)
            reply = Reply(view, turn, self._request_id(), prefix=turn.content, text=turn.content,
                          saved=turn.content, prefix_tokens=int(turn.meta.get("tokens", 0)), reasoning=turn.reasoning,
                          saved_reasoning=turn.reasoning)
            turn.finish_reason = view.finish_reason = None
        self.reply = reply
        self._changed()
        try:
            self.messages.follow_end()
            view.begin()
            if host.engine is None and host.engine_loading:
                self.notify("The model is still loading; the reply starts when it is ready.")
            engine = await host.wait_for_engine()
            if continue_index is not None and engine.tokenizer is not None:
                # what continuation_prompt appends, so the prompt's count minus it is exact
                reply.prefix_tokens = len(engine.tokenizer.encode(reply.prefix, add_special_tokens=False))
            params = sampling_params(self.effective_params())
            # a thinking model's reply is split as it streams; harmony's markers are special tokens
            reply.thinking, reply.tokenizer = engine.reasoning, engine.tokenizer
            if engine.reasoning is not None and not engine.reasoning.skip_special_tokens:
                params.skip_special_tokens = False
            prompt = (prompt_msgs if continue_index is None
                      else continuation_prompt(engine.tokenizer, prompt_msgs, reply.prefix, reply.reasoning))
            self._flush_timer = self.set_interval(FRAME_S, self._flush)
            self._save_timer = self.set_interval(SAVE_S, self._save_partial)
            # generate is an async generator; the engines annotate it as the iterator it is used as
            async with aclosing(engine.generate(prompt, params, request_id=reply.request_id)) as outs:  # type: ignore[type-var]
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
        finally:
            self._changed()

    def _request_id(self) -> str:
        return f"{self.id or 'chat'}-{uuid.uuid4().hex[:12]}"

    async def _flush(self) -> None:
        reply = self.reply
        if reply is None or not (reply.pending or reply.reasoning_changed) or not self.shown:
            return  # a hidden tab keeps buffering; it paints when shown
        if reply.reasoning_changed:
            reply.reasoning_changed = False
            await reply.view.set_reasoning(reply.reasoning)
        if not reply.pending:
            return
        chunk = "".join(reply.pending)
        reply.pending.clear()
        await reply.view.write(chunk)
        # follow is read after the write: the reader may have scrolled away meanwhile.
        self.messages.follow_end()

    def _save_partial(self) -> None:
        """One UPDATE of the growing reply, about once a second, whatever the token rate."""
        reply = self.reply
        if reply is None or reply.settled or reply.turn.message_id is None or (
                reply.text == reply.saved and reply.reasoning == reply.saved_reasoning):
            return
        try:
            self.host.history.update_message(reply.turn.message_id, content=reply.text,
                                             meta={"tokens": reply.num_tokens}, reasoning=reply.reasoning)
            reply.saved, reply.saved_reasoning = reply.text, reply.reasoning
        except Exception as e:  # noqa: BLE001 - the reply goes on; the final write retries
            self.log.warning(f"could not save the partial reply: {e}")

    def _settle(self, reply: Reply, finish_reason: str) -> None:
        """The synchronous end of a reply: stop repainting and saving, record the figures, write."""
        if reply.settled:
            return
        reply.settled = True
        for timer in (self._flush_timer, self._save_timer):
            if timer is not None:
                timer.stop()
        self._flush_timer = self._save_timer = None
        reply.finish_reason = finish_reason
        reply.pending.clear()
        self.last_tok_s = reply.tok_s
        self.last_cached_tokens = reply.cached_tokens
        self._count_prompt(reply)
        turn = reply.turn
        if reply.text or reply.reasoning or finish_reason not in ("abort", "error"):
            turn.content, turn.finish_reason, turn.reasoning = reply.text, finish_reason, reply.reasoning
            turn.meta.update(reply.meta(self.dropped_until, self.context_limit()))
            reply.view.reasoning = reply.reasoning  # the final render shows all of it
            if turn.message_id is not None:
                try:
                    self.host.history.update_message(turn.message_id, content=turn.content,
                                                     finish_reason=finish_reason, meta=turn.meta,
                                                     reasoning=turn.reasoning)
                except Exception as e:  # noqa: BLE001
                    self.notify(f"History not saved: {e}", severity="error")
        else:  # nothing came: no empty reply is kept
            if turn.message_id is not None:
                with suppress(Exception):
                    self.host.history.delete_message(turn.message_id)
            if turn in self.turns:
                index = self.turns.index(turn)
                del self.turns[index], self.views[index]
        if self.reply is reply:
            self.reply = None

    async def _finish(self, reply: Reply, finish_reason: str) -> None:
        self._settle(reply, finish_reason)
        await self._final_render(reply, finish_reason)

    async def _final_render(self, reply: Reply, finish_reason: str) -> None:
        if not reply.text and not reply.reasoning and finish_reason in ("abort", "error"):
            await reply.view.remove()
            return
        await reply.view.finish(reply.text, finish_reason, reply.turn.meta)
        if isinstance(reply.parser, HarmonyParser) and reply.parser.calls:
            self.show_note(tool_call_note(reply.parser.calls))
        self._show_system_tokens()  # the engine may have loaded since the tab opened
        self.messages.follow_end()
        self._warn_if_filling()

    def _warn_if_filling(self) -> None:
        limit = self.context_limit()
        if not limit or self._warned_full:
            return
        used, guess = self.context()
        if used >= WARN_FILL * limit:
            self._warned_full = True
            self.show_note(
                f"This chat holds {'about ' if guess else ''}{used:,} of the model's {limit:,} tokens of context. When it is full, "
                "you choose: drop the oldest turns, or go on in a new chat with the last turns or a summary "
                "(ctrl+p: Make room).")

    async def show_error(self, text: str) -> None:
        await self.messages.mount(MessageView("error", text))
        self.messages.follow = True
        self.messages.follow_end()

    def show_note(self, text: str) -> None:
        self.messages.mount(MessageView("note", text))
        self.messages.follow = True
        self.messages.follow_end()

    async def _clear_transients(self) -> None:
        """Errors and notes belong to the attempt before; a new reply clears them."""
        for v in self.messages.query(MessageView):
            if v.role in ("error", "note"):
                await v.remove()

    # ---- stopping ----

    async def stop(self) -> None:
        """Cancels the reply (if any) and waits until its partial text is committed."""
        worker = self._worker
        if worker is None or not self.generating:
            return
        worker.cancel()
        with suppress(WorkerCancelled, WorkerFailed, asyncio.CancelledError):
            await worker.wait()
        # The cancelled worker keeps its CancelledError, and the worker outlives this call: it
        # is the active_worker context of every widget mounted while it ran. The traceback's
        # frames hold the engine; clearing them lets a model switch free the old model.
        if worker.error is not None:
            traceback.clear_frames(worker.error.__traceback__)
        if self._worker is worker:
            self._worker = None

    async def action_stop(self) -> None:
        if self.generating:
            await self.stop()
        elif self.editing is not None:
            self.editing = None
            self._end_edit_marks()
            self.prompt.clear()

    # ---- regenerate, continue, edit, branches ----

    async def _drop_views_from(self, index: int) -> None:
        """Takes turns[index:] off the screen and out of the pane (the history keeps them as a branch)."""
        for v in self.views[index:]:
            await v.remove()
        del self.turns[index:], self.views[index:]
        if self.context_start > index:
            self.context_start = 0

    async def regenerate(self, index: int) -> None:
        """A new reply in place of turns[index] (an assistant turn); the old one stays as a branch."""
        if self.generating:
            await self.stop()
        if not (0 < index < len(self.turns)) or self.turns[index].role != "assistant":
            return
        await self._drop_views_from(index)
        self._start()

    async def action_regenerate(self) -> None:
        if self.generating:
            await self.stop()
        if not self.turns:
            return
        if self.turns[-1].role == "assistant":
            await self.regenerate(len(self.turns) - 1)
        elif self.turns[-1].role == "user":
            self._start()

    async def action_continue(self) -> None:
        """Goes on with the last reply where it stopped: stopped by Esc, cut at max tokens or
        interrupted by a crash."""
        if self.generating:
            return
        if not self.turns or self.turns[-1].role != "assistant" or self.turns[-1].finish_reason not in CONTINUABLE:
            self.notify("Nothing to go on with: the last reply is complete.")
            return
        self._start(len(self.turns) - 1)

    async def edit(self, index: int) -> None:
        """Puts turns[index] (a user turn) in the prompt; sending it starts a new branch there."""
        if self.generating:
            await self.stop()
        if not (0 <= index < len(self.turns)) or self.turns[index].role != "user":
            return
        self._end_edit_marks()
        self.editing = index
        self.refresh_bindings()
        self.views[index].add_class("-editing")
        self.prompt.border_title = "editing a message: enter sends it as a new branch, esc cancels"
        self.prompt.text = self.turns[index].content
        self.prompt.move_cursor(self.prompt.document.end)
        self.prompt.focus()

    def _end_edit_marks(self) -> None:
        self.refresh_bindings()
        self.prompt.border_title = None
        for v in self.views:
            v.remove_class("-editing")

    async def action_edit_last(self) -> None:
        index = next((i for i in range(len(self.turns) - 1, -1, -1) if self.turns[i].role == "user"), None)
        if index is not None:
            await self.edit(index)

    async def switch_branch(self, index: int, step: int) -> None:
        """Shows the next (step 1) or previous (-1) alternative of turns[index] and its branch."""
        if self.generating or self.conversation is None:
            return
        turn = self.turns[index]
        if turn.message_id is None:
            return
        try:
            ids = self.host.history.siblings(turn.message_id)
            target = ids[(ids.index(turn.message_id) + step) % len(ids)]
            branch = self.host.history.switch_branch(self.conversation.id, target)
        except Exception as e:  # noqa: BLE001
            self.notify(f"Could not switch branch: {e}", severity="error")
            return
        await self._clear_transients()
        await self._drop_views_from(index)
        for m in branch[index:]:
            t = Turn.stored(m)
            self.turns.append(t)
            self.views.append(self._view(t))
        await self.messages.mount_all(self.views[index:])
        self._changed()
        self.views[index].focus()

    # ---- making room in a full context ----

    def ask_for_room(self, text: str, need: int, limit: int) -> None:
        def chosen(choice: str | None) -> None:
            if choice is not None:
                self.prompt.clear()
                self.run_worker(self.make_room(choice, text), group="room", exit_on_error=False)

        self.app.push_screen(ContextFullScreen(need, limit, bool(text)), chosen)

    def action_make_room(self) -> None:
        limit = self.context_limit()
        if limit is None:
            self.notify("The context limit is unknown for this engine.")
            return
        self.ask_for_room("", self.context_used(), limit)

    async def make_room(self, choice: str, text: str) -> None:
        """``drop``: stop sending the oldest turns (they stay on screen, dimmed); ``last``: a new
        chat with the newest turns; ``summary``: a new chat whose system prompt holds a summary
        of this one. Then ``text`` (if any) is sent."""
        limit = self.context_limit() or 0
        keep = self._keep_from(limit // 2)
        if choice == "drop":
            await self._drop_context_before(keep)
            if text:
                await self.send(text)
        elif choice == "last":
            turns = [Turn(t.role, t.content, meta=dict(t.meta)) for t in self.turns[keep:]
                     if t.role in ("user", "assistant")]
            self.post_message(self.NewChatRequested(self, self.system_prompt, self.params, turns, text))
        elif choice == "summary":
            self._worker = self._summarize(keep, text)

    async def _drop_context_before(self, index: int) -> None:
        self.context_start = index
        if self.conversation is not None:
            try:
                self.host.history.update_conversation(self.conversation.id, dropped_until=self.dropped_until)
            except Exception as e:  # noqa: BLE001
                self.notify(f"History not updated: {e}", severity="error")
        for i, v in enumerate(self.views):
            v.set_class(i < index, "-dropped")
        for old in self.messages.query(".context-divider"):
            await old.remove()
        if 0 < index < len(self.views):
            await self.messages.mount(self._divider(), before=self.views[index])
        elif index >= len(self.views) and self.views:
            await self.messages.mount(self._divider())
        self._warned_full = False

    @staticmethod
    def _divider() -> Static:
        return Static("⋯ the messages above stay here but are no longer sent to the model ⋯",
                      classes="context-divider")

    @work(exclusive=True, group="generate", exit_on_error=False)
    async def _summarize(self, keep: int, text: str) -> None:
        """Streams a summary of the newest turns (from ``keep``, as many as fit) into a note,
        then asks for a new chat that starts from it (and sends ``text`` there)."""
        view = MessageView("note", "")
        await self.messages.mount(view)
        self.messages.follow_end()
        summary = ""
        try:
            engine = await self.host.wait_for_engine()
            limit = engine.max_model_len or 4096
            max_tokens = max(16, min(256, limit // 4))
            instruction = ("Summarize this conversation in a few sentences. Keep names, facts, numbers and "
                           "decisions.")
            overhead = self._estimate(instruction) + self._estimate("You write short, factual summaries.") + 16
            transcript = self._transcript(keep, limit - max_tokens - overhead)
            prompt: list[ChatMessage] = [
                {"role": "system", "content": "You write short, factual summaries."},
                {"role": "user", "content": f"{instruction}\n\n{transcript}"},
            ]
            params = sampling_params({**self.effective_params(), "temperature": 0.0, "max_tokens": max_tokens})
            await view.write("*Summarizing for a new chat…*\n\n")
            async with aclosing(engine.generate(prompt, params, request_id=self._request_id())) as outs:  # type: ignore[type-var]
                async for out in outs:
                    summary = out.outputs[0].text
                    if out.outputs[0].delta_text:
                        await view.write(out.outputs[0].delta_text)
        except Exception as e:  # noqa: BLE001
            await view.remove()
            await self.show_error(f"the summary failed: {describe(e)}")
            return
        await view.finish(f"Summary for the new chat:\n\n{summary}", "stop")
        system = "\n\n".join(p for p in (self.system_prompt.strip(), f"Summary of an earlier chat: {summary.strip()}")
                             if p)
        self.post_message(self.NewChatRequested(self, system, self.params, [], text))

    # ---- messages: moving between them and acting on them ----

    def action_focus_messages(self) -> None:
        if self.views:
            self.views[-1].focus()
            self.views[-1].scroll_visible()

    async def on_message_view_act(self, event: MessageView.Act) -> None:
        event.stop()
        view = event.view
        if view not in self.views:
            return
        index = self.views.index(view)
        what = event.what
        if what in ("previous", "next"):
            target = index + (-1 if what == "previous" else 1)
            if target >= len(self.views):
                self.prompt.focus()
            elif target >= 0:
                self.views[target].focus()
                self.views[target].scroll_visible()
        elif what == "leave":
            self.prompt.focus()
        elif what == "edit":
            await self.edit(index)
        elif what == "regenerate":
            await self.regenerate(index)
        elif what == "branch":
            await self.switch_branch(index, event.step)
        elif what == "copy":
            self.post_message(MessageView.CopyRequested(self.turns[index].content, "message"))
        elif what == "copy_code":
            self._copy_code(self.turns[index].content)

    # ---- copy ----

    def last_reply(self) -> str | None:
        if self.reply is not None and self.reply.text:
            return self.reply.text
        return next((t.content for t in reversed(self.turns) if t.role == "assistant" and t.content), None)

    def action_copy_reply(self) -> None:
        text = self.last_reply()
        if text:
            self.post_message(MessageView.CopyRequested(text, "reply"))
        else:
            self.notify("No reply to copy yet.")

    def action_copy_code(self) -> None:
        for t in reversed(self.turns):
            if t.role == "assistant" and code_blocks(t.content):
                self._copy_code(t.content)
                return
        self.notify("No code block to copy.")

    def _copy_code(self, content: str) -> None:
        blocks = code_blocks(content)
        if blocks:
            self.post_message(MessageView.CopyRequested(blocks[-1], "code block"))
        else:
            self.notify("No code block in this message.")

    # ---- settings ----

    async def apply_settings(self, system_prompt: str, params: dict[str, Any]) -> None:
        self.system_prompt = system_prompt
        self.params = dict(params)
        await self.messages.query(MessageView).filter(".system").first().set_content(system_prompt)
        self._show_system_tokens()
        if self.conversation is not None:
            try:
                self.host.history.update_conversation(
                    self.conversation.id, system_prompt=system_prompt, params=self.params)
            except Exception as e:  # noqa: BLE001
                self.notify(f"History not updated: {e}", severity="error")

    async def clear(self) -> None:
        """Deletes every message of this chat (all branches); its settings stay."""
        await self.stop()
        if self.conversation is not None:
            try:
                self.host.history.clear_conversation(self.conversation.id)
            except Exception as e:  # noqa: BLE001
                self.notify(f"Could not clear the chat: {e}", severity="error")
                return
        await self._clear_transients()
        for old in self.messages.query(".context-divider"):
            await old.remove()
        await self._drop_views_from(0)
        self.context_start = 0
        self._warned_full = False
        self._changed()

