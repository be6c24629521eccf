"""The chat app against the real engine on the default model (fp32, loaded once for the module),
and against that engine behind a real ``localllm serve`` app (remote mode).

Replies are short and greedy, so the module stays well under a minute of generation."""

from __future__ import annotations

import gc
import re
import time
import weakref
from pathlib import Path

import pytest

from localllm.history import History
from localllm.tui.app import ChatApp
from localllm.tui.backend import LocalChatEngine
from tests.tui.conftest import send, wait_until

SIZE = (100, 30)
SHORT = {"temperature": 0.0, "max_tokens": 8}
# ignore_eos keeps a reply going for as long as a test needs it to.
LONG = {"temperature": 0.0, "max_tokens": 200, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(default_model_path: Path):
    from localllm.engine.async_engine import AsyncEngine
    from localllm.engine.engine import EngineConfig, LLMEngine

    # A small KV pool: plenty for these chats, and a cheap allocation.
    llm = LLMEngine(EngineConfig(model=str(default_model_path), dtype="float32", device="cpu", num_kv_blocks=256))
    eng = LocalChatEngine(AsyncEngine(llm))
    yield eng
    eng.shutdown()


def _all_blocks_free(engine: LocalChatEngine) -> bool:
    llm = engine.engine.engine
    bm = llm.block_manager
    return not llm.requests and bm.num_free_blocks == bm.num_blocks


async def test_two_tabs_stream_at_once_in_one_batch(engine):
    app = ChatApp(engine, probe=False, default_params={"temperature": 0.0, "max_tokens": 32, "ignore_eos": True})
    async with app.run_test(size=SIZE) as pilot:
        first = app.active_chat
        await pilot.press("ctrl+t")
        await wait_until(pilot, lambda: len(app.chats()) == 2, what="a second tab")
        second = app.active_chat
        assert second is not first
        # Both prompts go out back to back. Through pilot.press they would be seconds apart
        # on a loaded machine (each press waits for the UI to go idle), and a short reply
        # could end before the other tab's request arrives.
        first.prompt.text = "Tell me a story about a cat."
        second.prompt.text = "Tell me a story about a dog."
        first.prompt.action_submit()
        second.prompt.action_submit()
        await wait_until(pilot, lambda: first.turns and second.turns, what="both messages sent")

        batch_seen, status_batch_2 = 0, False
        deadline = time.monotonic() + 90
        while (first.generating or second.generating) and time.monotonic() < deadline:
            stats = engine.stats()
            if stats.num_running:
                batch_seen = max(batch_seen, stats.batch_size)
            status_batch_2 |= "batch 2" in app.status_text().plain
            await pilot.pause(0.05)
        assert not first.generating and not second.generating
        assert batch_seen >= 2, f"the two tabs never ran in one engine step (largest batch {batch_seen})"
        assert status_batch_2, "the status bar never showed the two tabs batched together"
        for chat in (first, second):
            assert [t.role for t in chat.turns] == ["user", "assistant"]
            assert chat.turns[-1].content and chat.turns[-1].finish_reason == "length"
        assert _all_blocks_free(engine)


async def test_escape_stops_and_keeps_the_partial_reply(engine, home):
    app = ChatApp(engine, probe=False, default_params=LONG)
    async with app.run_test(size=SIZE) as pilot:
        chat = app.active_chat
        await send(pilot, chat, "Count from one to one hundred.")
        await wait_until(pilot, lambda: chat.reply is not None and len(chat.reply.text) > 5, what="some text")
        await pilot.press("escape")
        await wait_until(pilot, lambda: not chat.generating, timeout=10, what="the stop")
        last = chat.turns[-1]
        assert last.role == "assistant" and last.finish_reason == "abort" and last.content
        assert last.meta["tokens"] < LONG["max_tokens"]
        await wait_until(pilot, lambda: _all_blocks_free(engine), timeout=10, what="the KV blocks to be freed")
        view = chat.messages.children[-1]
        assert view.content == last.content and view.finish_reason == "abort"
        stored = History(home / "data" / "history.sqlite3").messages(chat.conversation.id)
        assert [(m.role, m.finish_reason) for m in stored] == [("user", None), ("assistant", "abort")]
        assert stored[-1].content == last.content


async def test_closing_a_tab_aborts_its_request_and_frees_its_blocks(engine, home):
    app = ChatApp(engine, probe=False, default_params=LONG)
    async with app.run_test(size=SIZE) as pilot:
        chat = app.active_chat
        await send(pilot, chat, "Write a long poem about the sea.")
        await wait_until(pilot, lambda: chat.reply is not None and chat.reply.text, what="the reply to stream")
        assert engine.engine.engine.requests
        await pilot.press("ctrl+w")
        await wait_until(pilot, lambda: chat not in app.chats(), timeout=10, what="the tab to close")
        await wait_until(pilot, lambda: _all_blocks_free(engine), timeout=10, what="the KV blocks to be freed")
        assert len(app.chats()) == 1 and app.active_chat is not chat  # a fresh tab replaces the last one
        stored = History(home / "data" / "history.sqlite3").messages(chat.conversation.id)
        assert stored[-1].role == "assistant" and stored[-1].finish_reason == "abort" and stored[-1].content


async def test_history_survives_a_restart_and_the_second_turn_hits_the_prefix_cache(engine, home):
    app = ChatApp(engine, probe=False, default_params=SHORT)
    async with app.run_test(size=SIZE) as pilot:
        chat = app.active_chat
        await send(pilot, chat, "What is the capital of France?")
        await wait_until(pilot, lambda: not chat.generating, what="the first reply")
        await send(pilot, chat, "And of Italy?")
        await wait_until(pilot, lambda: not chat.generating, what="the second reply")
        # The second prompt starts with the first turn, whose KV blocks are still cached.
        assert chat.last_cached_tokens > 0
        hit = re.search(r"prefix hit (\d+)", app.status_text().plain)
        assert hit and int(hit.group(1)) == chat.last_cached_tokens
        before = [(t.role, t.content) for t in chat.turns]
        title = chat.title

    restarted = ChatApp(engine, probe=False, default_params=SHORT)
    async with restarted.run_test(size=SIZE) as pilot:
        await pilot.pause()
        chats = restarted.chats()
        assert len(chats) == 1
        again = chats[0]
        assert again.title == title
        assert [(t.role, t.content) for t in again.turns] == before
        shown = [v.content for v in again.views]
        assert shown == [c for _, c in before]


async def test_an_error_stays_in_its_tab(engine):
    app = ChatApp(engine, probe=False, default_params=SHORT)
    async with app.run_test(size=SIZE) as pilot:
        broken = app.active_chat
        broken.prompt.text = "word " * 5000  # longer than the context
        await pilot.press("enter")
        await wait_until(pilot, lambda: broken.messages.query(".error"), what="the error")
        errors = broken.messages.query(".error")
        assert "context limit of 4,096" in errors.first().content and "shorten it" in errors.first().content
        assert not broken.turns and broken.prompt.text.startswith("word word")  # nothing sent, nothing lost
        await pilot.press("ctrl+t")
        await wait_until(pilot, lambda: len(app.chats()) == 2)
        fine = app.active_chat
        await send(pilot, fine, "Hi!")
        await wait_until(pilot, lambda: not fine.generating, what="the reply")
        assert fine.turns[-1].role == "assistant" and fine.turns[-1].content


async def test_a_gguf_without_chat_template_is_noted_and_still_chats(tmp_path: Path):
    from localllm.engine.async_engine import AsyncEngine
    from localllm.engine.engine import EngineConfig, LLMEngine
    from tests.models.gguf_files import random_llama_weights, spm_vocab, train_sentencepiece, write_llama_gguf

    vocab = spm_vocab(train_sentencepiece("bpe"))
    path = write_llama_gguf(tmp_path / "plain.gguf", *vocab, random_llama_weights(len(vocab[0])))[0]

    def factory(model, progress):
        return LocalChatEngine(AsyncEngine(LLMEngine(
            EngineConfig(model=str(path), dtype="float32", device="cpu", max_model_len=128), progress=progress)))

    app = ChatApp(engine_factory=factory, probe=False, default_params=SHORT)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.engine is not None, what="the load")
        assert any("no chat template" in n.message for n in app._notifications)
        chat = app.active_chat
        await send(pilot, chat, "Hi!")
        await wait_until(pilot, lambda: not chat.generating, what="the reply")
        assert chat.turns[-1].role == "assistant" and not chat.messages.query(".error")
async def test_continuing_an_interrupted_reply_goes_on_from_its_tokens(engine, home):
    """A reply a crash cut short: the model is given the chat and the partial reply's own
    tokens, and its continuation is appended to the same message."""
    h = History(home / "data" / "history.sqlite3")
    c = h.create_conversation("Interrupted", tab_position=0)
    h.add_message(c.id, "user", "What is the capital of France?")
    partial = h.add_message(c.id, "assistant", "The capital of France")  # finish_reason NULL: was streaming
    h.close()
    app = ChatApp(engine, probe=False, default_params=SHORT)
    async with app.run_test(size=SIZE) as pilot:
        chat = app.active_chat
        assert chat.turns[-1].finish_reason == "interrupted"
        await pilot.press("ctrl+g")
        await wait_until(pilot, lambda: not chat.generating, what="the continuation")
        reply = chat.turns[-1]
        assert reply.message_id == partial.id and reply.finish_reason == "stop"
        assert reply.content == "The capital of France is Paris."  # greedy, as if never cut
    assert [m.content for m in History(home / "data" / "history.sqlite3").messages(c.id)][-1] == reply.content


async def test_a_model_switch_frees_the_old_model(default_model_path):
    """Even when the switch stops a reply mid-stream (the case that kept the old model)."""
    from localllm.engine.async_engine import AsyncEngine
    from localllm.engine.engine import EngineConfig, LLMEngine

    built: list[weakref.ref] = []

    def factory(model, progress):
        llm = LLMEngine(EngineConfig(model=str(default_model_path), dtype="float32", device="cpu",
                                     num_kv_blocks=64), progress=progress)
        built.append(weakref.ref(llm))
        return LocalChatEngine(AsyncEngine(llm))

    app = ChatApp(engine_factory=factory, probe=False, default_params=LONG)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.engine is not None, timeout=120, what="the first load")
        chat = app.active_chat
        await send(pilot, chat, "Count from one to one hundred.")
        await wait_until(pilot, lambda: chat.reply is not None and len(chat.reply.text) > 5, what="some text")
        await app.switch_model(None)
        await wait_until(pilot, lambda: app.engine is not None, timeout=120, what="the second load")
        gc.collect()
        assert built[0]() is None, "the old model is still referenced"
        assert built[1]() is not None
        assert chat.turns[-1].finish_reason == "abort" and chat.turns[-1].content  # the stopped reply is kept


@pytest.fixture(scope="module")
def server(engine):
    from localllm.server.app import create_app
    from localllm.server.serving import start_server_thread

    running = start_server_thread(create_app(engine.engine, model_name="served-smollm"))
    yield running
    running.stop()


async def test_remote_mode_lists_the_servers_models_and_shows_only_what_it_knows(server, home):
    from localllm.server.remote import RemoteEngine

    endpoint = f"{server.url}/v1"
    app = ChatApp(engine_factory=lambda model, progress: RemoteEngine(endpoint, model=model), endpoint=endpoint,
                  default_params=SHORT)
    async with app.run_test(size=(140, 30)) as pilot:
        await wait_until(pilot, lambda: app.engine is not None, what="the connection")
        chat = app.active_chat
        await send(pilot, chat, "What is the capital of France?")
        await wait_until(pilot, lambda: not chat.generating, what="the reply")
        assert chat.turns[-1].content == "The capital of France is Paris."
        status = app.status_text().plain
        assert status.startswith(" served-smollm") and endpoint in status
        # Nothing this client cannot know: no KV use, no RAM (its own), no "prefix hit 0".
        assert "KV" not in status and "RAM" not in status and "prefix hit 0" not in status
        assert re.search(r"ctx \d+/[\d,]+", status)  # the server reports its context limit
        titles = [title for title, _, _ in _palette_commands(app)]
        assert "Switch model: served-smollm" in titles and "Switch model" not in titles
        assert not any(t.startswith("Pull model") for t in titles)
        assert f"Reconnect to {endpoint}" in titles


async def test_remote_mode_connection_errors_point_at_the_server(home):
    from localllm.server.remote import RemoteEngine

    endpoint = "http://127.0.0.1:9/v1"  # discard port: nothing listens
    app = ChatApp(engine_factory=lambda model, progress: RemoteEngine(endpoint, model=model), endpoint=endpoint)
    async with app.run_test(size=SIZE) as pilot:
        chat = app.active_chat
        await wait_until(pilot, lambda: chat.messages.query(".error"), what="the error")
        error = chat.messages.query(".error").first().content
        assert "cannot reach" in error and "Reconnect" in error and "Pull model" not in error
        assert "Pull" not in app.status_text().plain


def _palette_commands(app):
    from localllm.tui.commands import ChatCommands

    return ChatCommands(app.screen)._commands()  # what the palette lists


def _header(view) -> str:
    return str(view.query_one(".header").render())


async def test_token_counts_are_the_engines_own(engine):
    """Each count is what the message adds to the prompt the engine runs, so the counts
    shown add up to the gauge; the system prompt has its own."""
    from localllm.tui.backend import ChatConfig

    app = ChatApp(engine, probe=False, default_params=SHORT, config=ChatConfig(system_prompt="Answer briefly."))
    async with app.run_test(size=SIZE) as pilot:
        chat = app.active_chat
        await send(pilot, chat, "What is the capital of France?")
        await wait_until(pilot, lambda: not chat.generating, what="the first reply")
        await send(pilot, chat, "And of Italy?")
        await wait_until(pilot, lambda: not chat.generating, what="the second reply")
        tok = engine.tokenizer
        msgs = chat.prompt_messages()
        system = len(tok.encode_chat(msgs[:1], add_generation_prompt=False))
        first, second = len(tok.encode_chat(msgs[:2])), len(tok.encode_chat(msgs[:4]))
        u1, a1, u2, a2 = chat.turns
        # what the engine itself counted for each prompt (prompt_token_ids)
        assert a1.meta["prompt_tokens"] == first and a2.meta["prompt_tokens"] == second
        assert u1.meta == {"tokens": first - system}
        assert u2.meta == {"tokens": second - first - a1.meta["tokens"]}
        assert a2.meta["tokens"] <= SHORT["max_tokens"] and "estimated" not in a2.meta
        assert chat.context() == (second + a2.meta["tokens"], False)
        assert system + sum(t.meta["tokens"] for t in chat.turns) == chat.context_used()
        system_view = chat.messages.query(".system").first()
        assert f"{system} tok" in _header(system_view)
        assert _header(chat.views[0]).endswith(f"{first - system} tok")
        assert not any("~" in _header(v) for v in chat.views)
        assert f"ctx {chat.context_used():,}/4,096" in app.status_text().plain


async def test_remote_counts_come_from_the_servers_usage(engine, server, home):
    from localllm.server.remote import RemoteEngine
    from localllm.tui.backend import ChatConfig

    endpoint = f"{server.url}/v1"
    app = ChatApp(engine_factory=lambda model, progress: RemoteEngine(endpoint, model=model), endpoint=endpoint,
                  default_params=SHORT, config=ChatConfig(system_prompt="Answer briefly."))
    async with app.run_test(size=(140, 30)) as pilot:
        await wait_until(pilot, lambda: app.engine is not None, what="the connection")
        chat = app.active_chat
        await send(pilot, chat, "What is the capital of France?")
        # (before the usage arrives the count is a guess, marked "~": how long that lasts is the
        # server's speed, so test_counts_without_a_servers_usage_are_marked_as_guesses checks it)
        await wait_until(pilot, lambda: not chat.generating, what="the reply")
        u1, a1 = chat.turns
        prompt = len(engine.tokenizer.encode_chat(  # the server's engine's tokenizer
            chat.prompt_messages()[:2]))
        # The server counts the system prompt and the first message as one prompt.
        assert u1.meta == {"tokens": prompt, "with_system": True}
        assert a1.meta["prompt_tokens"] == prompt and "estimated" not in a1.meta
        assert _header(chat.views[0]).endswith(f"{prompt} tok with the system prompt")
        assert "~" not in _header(chat.views[1])
        assert f"ctx {prompt + a1.meta['tokens']:,}/" in app.status_text().plain
