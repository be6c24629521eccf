"""A gpt-oss reply that calls a tool, in the chat: the call is neither the answer nor the
reasoning (the chat runs no tools), and is shown apart as a labelled note with its arguments.
A scripted engine streams the harmony text word by word, as a harmony model's detokenized
reply with its special tokens kept arrives; localllm.reasoning's HarmonyParser splits it."""

from __future__ import annotations

from localllm.reasoning import HARMONY_PARSER, ReasoningFormat
from localllm.tui.app import ChatApp
from localllm.tui.widgets import MessageView
from tests.tui.conftest import send, wait_until
from tests.tui.fakes import FakeEngine

ARGS = '{"location": "Paris", "days": 2}'
REPLY = ("<|channel|>analysis<|message|>Need the forecast for Paris.<|end|><|start|>assistant to=functions.get_weather"
         f"<|channel|>commentary json<|message|>{ARGS}")


async def test_a_tool_call_is_a_note_apart_from_the_answer_and_the_reasoning() -> None:
    engine = FakeEngine(REPLY)
    engine.reasoning = ReasoningFormat(HARMONY_PARSER, skip_special_tokens=False)  # type: ignore[misc]
    app = ChatApp(engine, probe=False)
    async with app.run_test(size=(100, 40)) as pilot:
        chat = app.active_chat
        await send(pilot, chat, "Weather in Paris?")
        await wait_until(pilot, lambda: not chat.generating, what="the reply")
        turn = chat.turns[-1]
        assert (turn.content, turn.reasoning, turn.finish_reason) == ("", "Need the forecast for Paris.", "stop")
        await wait_until(pilot, lambda: any(v.role == "note" for v in chat.query(MessageView)), what="the note")
        (note,) = [v for v in chat.query(MessageView) if v.role == "note"]
        assert "`functions.get_weather`" in note.content and f"```json\n{ARGS}\n```" in note.content
        assert engine.params[-1].skip_special_tokens is False  # the markers reach the parser
