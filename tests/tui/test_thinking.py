"""The chat shows a thinking model's reasoning as a folded block beside the reply, keeps it in
its own history column, and does not send it back in the next prompt unless the template
asks for it.

The real default model (SmolLM2) under Pilot. It does not think on its own, so the tab's
settings carry a ``guided_regex`` under which the model writes its own "<think>...</think>"
reply, token by token, and the engine is told (as ``localllm chat --reasoning-parser qwen3``
tells it) that this model's replies mark reasoning that way. (tests/server/test_reasoning.py
checks the same split against the raw reply; here the regex's two parts tell the sides apart.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from textual.widgets._collapsible import CollapsibleTitle

from localllm.history import History
from localllm.tui.app import ChatApp
from localllm.tui.backend import LocalChatEngine
from localllm.tui.widgets import ThinkingBlock
from tests.tui.conftest import send, wait_until

SIZE = (100, 40)
REASONING, ANSWER = r"[a-z][a-z ]{20,50}", r"[A-Z][a-z ,]{3,30}\."
THINK = rf"<think>\n{REASONING}\n</think>\n\n{ANSWER}"
PARAMS = {"temperature": 0.0, "max_tokens": 80, "guided_regex": THINK}


@pytest.fixture(scope="module")
def engine(default_model_path: Path):
    from localllm.engine.async_engine import AsyncEngine
    from localllm.engine.engine import EngineConfig, LLMEngine

    # eager: a background compile would only compete for the CPU during these few short replies
    llm = LLMEngine(EngineConfig(model=str(default_model_path), dtype="float32", device="cpu", num_kv_blocks=256,
                                 compile=False))
    eng = LocalChatEngine(AsyncEngine(llm), reasoning_parser="qwen3")
    yield eng
    eng.shutdown()


async def test_thinking_is_a_folded_block_beside_the_reply_and_stays_out_of_the_next_prompt(engine, home):
    assert engine.reasoning is not None and engine.reasoning.name == "qwen3"
    app = ChatApp(engine, probe=False, default_params=PARAMS)
    async with app.run_test(size=SIZE) as pilot:
        chat = app.active_chat
        await send(pilot, chat, "What is the capital of France?")
        titles: set[str] = set()
        while chat.generating:  # the block shows up while the reply is still thinking
            titles |= {b.title for b in chat.query(ThinkingBlock)}
            await pilot.pause(0.01)
        await wait_until(pilot, lambda: not chat.generating, timeout=120, what="the reply")

        turn, view = chat.turns[-1], chat.views[-1]
        answer = turn.content
        # each side holds the model's own text of its part of the regex, and no tag
        assert re.fullmatch(REASONING, turn.reasoning) and turn.reasoning == turn.reasoning.strip(), turn.reasoning
        assert re.fullmatch(ANSWER, answer), answer
        assert view.content == answer
        # the engine's tokens are the whole reply: tags, reasoning and answer
        assert turn.meta["tokens"] > len(engine.tokenizer.encode(turn.reasoning + answer, add_special_tokens=False))
        # the titles seen mid-reply (how many depends on the machine's speed) were "Thinking…" ones
        assert all(t.startswith(("Thinking…", "Thought for")) for t in titles), titles

        block = view.query_one(ThinkingBlock)
        assert block.collapsed and block.reasoning == turn.reasoning
        assert block.title == f"Thought for {len(turn.reasoning.split())} words"
        assert str(block.query_one(".thinking-body").render()) == turn.reasoning
        await pilot.click(CollapsibleTitle)  # the folded block opens on a click
        await pilot.pause()
        assert not block.collapsed
        assert chat.last_reply() == answer  # copying the reply copies the answer alone

        stored = History(home / "data" / "history.sqlite3").messages(chat.conversation.id)
        assert [(m.role, m.content, m.reasoning) for m in stored] == [
            ("user", "What is the capital of France?", ""), ("assistant", answer, turn.reasoning)]

        # the next prompt: the reasoning goes to the template as reasoning_content, and SmolLM2's
        # ChatML template leaves it out; the engine's own count of the prompt agrees
        await send(pilot, chat, "And of Italy?")
        await wait_until(pilot, lambda: not chat.generating, timeout=120, what="the second reply")
        sent = chat.prompt_messages(len(chat.turns) - 1)
        assert sent[-2] == {"role": "assistant", "content": answer, "reasoning_content": turn.reasoning}
        rendered = engine.tokenizer.apply_chat_template(sent)
        assert turn.reasoning not in rendered and answer in rendered
        assert chat.turns[-1].meta["prompt_tokens"] == len(engine.tokenizer.encode_rendered(rendered))

    restarted = ChatApp(engine, probe=False, default_params=PARAMS)
    async with restarted.run_test(size=SIZE) as pilot:
        await pilot.pause()
        again = restarted.chats()[0]
        first_reply = again.views[1]
        block = first_reply.query_one(ThinkingBlock)
        assert block.collapsed and block.reasoning == turn.reasoning and first_reply.content == answer
