"""The chat app's "go on" (ctrl+g) with gpt-oss: the real Textual app on a tiny random
gpt-oss (harmony vocabulary) continues an interrupted reply inside its final message, the
prompt checked id for id against openai-harmony's rendering. The prompt's construction for
every case (reasoning before the answer, a reply cut while thinking) is checked on
``continuation_prompt`` itself in tests/models/test_harmony.py."""

from __future__ import annotations

from typing import Any

from localllm.history import History
from localllm.tui.app import ChatApp
from localllm.tui.backend import LocalChatEngine
from tests.models.test_harmony import _reference, harmony, tokenizer  # noqa: F401
from tests.server.test_harmony_tools import gpt_oss_engine  # noqa: F401
from tests.tui.conftest import wait_until


class RecordingEngine(LocalChatEngine):
    """The in-process engine, keeping each prompt it is sent."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.prompts: list[Any] = []

    def generate(self, prompt, params=None, request_id=None):  # noqa: ANN001, ANN201
        self.prompts.append(prompt)
        return super().generate(prompt, params, request_id)


async def test_go_on_continues_inside_the_final_message(gpt_oss_engine, harmony, home) -> None:  # noqa: F811
    oh, enc, _ = harmony
    ask = "What is 2 + 2?"
    h = History(home / "data" / "history.sqlite3")
    c = h.create_conversation("Interrupted", tab_position=0)
    h.add_message(c.id, "user", ask)
    partial = h.add_message(c.id, "assistant", "The answer is")  # finish_reason NULL: was streaming
    h.close()
    engine = RecordingEngine(gpt_oss_engine)
    app = ChatApp(engine, probe=False, default_params={"temperature": 0.0, "max_tokens": 3})
    async with app.run_test(size=(100, 30)) as pilot:
        chat = app.active_chat
        assert chat.turns[-1].finish_reason == "interrupted"
        await pilot.press("ctrl+g")
        await wait_until(pilot, lambda: not chat.generating and engine.prompts, what="the continuation")
        reply = chat.turns[-1]
        assert reply.message_id == partial.id and reply.content.startswith("The answer is")
    asked = [{"role": "user", "content": ask}]
    want = list(enc.render_conversation_for_completion(oh.Conversation.from_messages(_reference(oh, asked, {})),
                                                       oh.Role.ASSISTANT))
    want += list(enc.encode("<|channel|>final<|message|>The answer is", allowed_special="all"))
    assert engine.prompts == [want]
    assert reply.reasoning == ""  # what the model added went on in the answer
