"""Engine behaviour on the real default model: batching invariance under preemption and
aborts, prefix caching, stragglers, seeded sampling, failure isolation and the async API."""

from __future__ import annotations

import asyncio
import os
import random
import threading

import pytest

from localllm.engine import engine as engine_module
from localllm.engine.async_engine import AsyncEngine
from localllm.engine.engine import EngineConfig, LLMEngine
from localllm.engine.sequence import SamplingParams
from localllm.tokenizer import IncrementalDetokenizer

TOPICS = ["the ocean", "a red bicycle", "mountains", "bread baking", "the moon", "chess", "rainy days",
          "a library", "trains", "volcanoes", "honey bees", "winter", "jazz music", "deserts", "robots", "tea"]


def _engine(path, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu", **kw))


@pytest.fixture(scope="module")
def small_pool_engine(default_model_path) -> LLMEngine:
    # 24 blocks x 16 tokens: 16 requests of up to ~50 tokens cannot all fit, so the scheduler
    # must preempt; a 48-token step budget forces chunked prefill mixed with decodes.
    return _engine(default_model_path, num_kv_blocks=24, max_num_batched_tokens=48)


def _run_alone(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list[int]:
    rid = engine.add_request(prompt, params)
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                final = out
    assert final is not None
    return final.outputs[0].token_ids


def test_batched_outputs_equal_solo_runs_under_preemption_and_aborts(small_pool_engine: LLMEngine) -> None:
    engine = small_pool_engine
    rng = random.Random(7)
    tok = engine.tokenizer
    requests = []
    for i, topic in enumerate(TOPICS):
        words = " ".join(rng.choice(["Tell", "me", "a", "short", "story", "about", "please", "now"])
                         for _ in range(rng.randint(2, 14)))
        prompt = tok.encode(f"{words} Here is a sentence about {topic}:")
        params = SamplingParams(temperature=0.0, max_tokens=rng.randint(8, 24), ignore_eos=True)
        arrival = rng.randint(0, 6)
        abort_at = arrival + rng.randint(1, 10) if i % 5 == 4 else None
        requests.append((f"r{i}", prompt, params, arrival, abort_at))

    results: dict[str, list[int]] = {}
    step = 0
    preemptions_before = engine.scheduler.num_preemptions
    while step < 400:
        for rid, prompt, params, arrival, abort_at in requests:
            if arrival == step:
                engine.add_request(prompt, params, rid)
            if abort_at == step and rid in engine.requests:
                engine.abort_request(rid)
                results[rid] = None  # type: ignore[assignment]
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        step += 1
        if step > 30 and not engine.has_unfinished():
            break
    assert not engine.has_unfinished()
    assert engine.scheduler.num_preemptions > preemptions_before, "the pool was meant to force preemption"
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # no leak: every block is free (cached or not)
    assert all(b.ref_count == 0 for b in bm.blocks)
    for rid, prompt, params, _, abort_at in requests:
        if results.get(rid) is None:
            assert abort_at is not None
            continue
        assert results[rid] == _run_alone(engine, prompt, params), rid


def test_seeded_sampling_is_reproducible_inside_a_busy_batch(small_pool_engine: LLMEngine) -> None:
    engine = small_pool_engine
    prompt = engine.tokenizer.encode("My favourite animal is")
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = _run_alone(engine, prompt, seeded)
    for i in range(5):
        engine.add_request(engine.tokenizer.encode(f"Busy request {i} about {TOPICS[i]}"),
                           SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True))
    busy = _run_alone(engine, prompt, seeded)
    assert busy == alone
    other_seed = _run_alone(engine, prompt, SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=16,
                                                           ignore_eos=True))
    assert other_seed != alone


def test_straggler_does_not_hold_back_short_requests(default_model_path) -> None:
    # A pool that holds them all: this is about scheduling, not preemption.
    engine = _engine(default_model_path, num_kv_blocks=256, max_model_len=2048)
    tok = engine.tokenizer
    engine.add_request(tok.encode("Write a very long essay."), SamplingParams(temperature=0, max_tokens=2000,
                                                                             ignore_eos=True), "long")
    for i in range(15):
        engine.add_request(tok.encode(f"Q{i}:"), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), f"s{i}")
    finished: set[str] = set()
    max_batch = 0
    while len(finished) < 15:
        for out in engine.step():
            if out.finished:
                finished.add(out.request_id)
        max_batch = max(max_batch, engine.stats().batch_size)
    assert "long" not in finished and "long" in engine.requests  # still running
    assert max_batch > 1
    engine.abort_request("long")
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_shared_prefix_is_reused_and_output_unchanged(default_model_path) -> None:
    # 128-token steps: the prompts below are prefilled in chunks, as a long prompt is; a pool of
    # 96 blocks holds every prompt's blocks below at once (none is evicted before it is reused)
    engine = _engine(default_model_path, max_num_batched_tokens=128, num_kv_blocks=96)
    tok = engine.tokenizer
    # 20 full blocks and half of one: the shared part ends inside a block
    prefix = tok.encode(" ".join(f"Fact {i}: the number {i} is {'even' if i % 2 == 0 else 'odd'}." for i in range(60)))
    prefix = prefix[:328]
    assert len(prefix) == 328
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = engine.generate([prefix + tok.encode(" Question one: is 7 odd?")], params)[0]
    second = engine.generate([prefix + tok.encode(" Question two: is 12 even?")], params)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens >= 320
    cold = _engine(default_model_path, enable_prefix_caching=False, max_num_batched_tokens=128, num_kv_blocks=96)
    reference = cold.generate([prefix + tok.encode(" Question two: is 12 even?")], params)[0]
    assert reference.num_cached_tokens == 0
    assert second.outputs[0].token_ids == reference.outputs[0].token_ids
    # the same prompt again: everything but its last token comes from the cache, the tokens
    # inside the last partial block too (copied from the block the first run left)
    repeat = prefix + tok.encode(" Question three: is the number 12 odd or even?")
    assert len(repeat) % engine.block_manager.block_size > 1  # a partial last block to reuse
    once, again = (engine.generate([repeat], params)[0] for _ in range(2))
    assert again.num_cached_tokens == len(repeat) - 1 > once.num_cached_tokens
    assert again.outputs[0].token_ids == once.outputs[0].token_ids == cold.generate([repeat], params)[0].outputs[0].token_ids
    # the next turn of the first chat: its prompt, its reply, a new question
    turn = list(first.prompt_token_ids) + list(first.outputs[0].token_ids) + tok.encode(" And 9?")
    nxt = engine.generate([turn], params)[0]
    assert nxt.num_cached_tokens == len(first.prompt_token_ids) + len(first.outputs[0].token_ids) - 1
    assert nxt.outputs[0].token_ids == cold.generate([turn], params)[0].outputs[0].token_ids


async def test_async_engine_builds_its_engine_on_its_own_thread(default_model_path) -> None:
    """The engine thread builds the engine it steps (see AsyncEngine's constructor), and a
    build that fails raises in the caller's thread."""
    built_on: list[str] = []

    def make() -> LLMEngine:
        built_on.append(threading.current_thread().name)
        return _engine(default_model_path, max_model_len=256, num_kv_blocks=32)

    engine = AsyncEngine(make)
    try:
        assert built_on == ["localllm-engine"] and engine.stats().kv_blocks_total == 32
        final = None
        async for final in engine.generate("One, two,", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)):
            pass
        assert final is not None and final.finished and len(final.outputs[0].token_ids) == 4
    finally:
        engine.shutdown()

    def broken() -> LLMEngine:
        raise ValueError("no such model: nowhere")

    with pytest.raises(ValueError, match="no such model"):
        AsyncEngine(broken)


async def test_async_engine_streams_and_aborts_on_cancel(small_pool_engine: LLMEngine) -> None:
    engine = AsyncEngine(small_pool_engine)
    try:
        chat = [{"role": "user", "content": "Count from one to ten."}]
        deltas = []
        async for out in engine.generate(chat, SamplingParams(temperature=0, max_tokens=12)):
            deltas.append(out.outputs[0].delta_text)
            final = out
        assert final.finished and "".join(deltas) == final.outputs[0].text

        async def consume_two() -> None:
            n = 0
            async for _ in engine.generate(chat, SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)):
                n += 1
                if n == 2:
                    break  # the consumer walks away: the request must be aborted

        await consume_two()
        for _ in range(100):
            await asyncio.sleep(0.02)
            if not small_pool_engine.requests and not small_pool_engine.has_unfinished():
                break
        bm = small_pool_engine.block_manager
        assert not small_pool_engine.requests
        assert bm.num_free_blocks == bm.num_blocks
    finally:
        engine.shutdown()


async def test_async_engine_joins_a_fast_steps_outputs_without_losing_any(small_pool_engine: LLMEngine) -> None:
    """With a hold longer than any step, every output but a first or last one waits one step
    and goes out joined with the next: no output carries more than two tokens, the first
    carries one, and the deltas of each stream, ids and text, add up to its final output,
    also for streams that start while others are held. Without a hold, one token each."""
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)

    async def stream(engine: AsyncEngine, prompt: str, delay: float) -> tuple[list[list[int]], str, object]:
        await asyncio.sleep(delay)
        ids, text, final = [], "", None
        async for final in engine.generate(prompt, params):
            ids.append(list(final.outputs[0].delta_token_ids))
            text += final.outputs[0].delta_text
        return ids, text, final

    for hold, most in ((60.0, 2), (0.0, 1)):
        engine = AsyncEngine(small_pool_engine, stream_hold_s=hold)
        try:
            runs = await asyncio.gather(*(stream(engine, f"Topic {i}: {t}.", 0.05 * i)
                                          for i, t in enumerate(TOPICS[:3])))
        finally:
            engine.shutdown()
        for i, (ids, text, final) in enumerate(runs):
            assert final.finished and text == final.outputs[0].text
            assert [t for d in ids for t in d] == list(final.outputs[0].token_ids)
            assert len(ids[0]) == 1 and max(len(d) for d in ids) == most
            assert list(final.outputs[0].token_ids) == _run_alone(
                small_pool_engine, small_pool_engine.tokenizer.encode(f"Topic {i}: {TOPICS[i]}."), params)


class _FailingDetokenizer(IncrementalDetokenizer):
    """The real detokenizer, until its ``after``-th token."""

    def __init__(self, tokenizer, after: int) -> None:  # noqa: ANN001
        super().__init__(tokenizer)
        self.left = after

    def add(self, new_ids):  # noqa: ANN001, ANN201
        self.left -= 1
        if self.left < 0:
            raise UnicodeError("injected detokenizer fault")
        return super().add(new_ids)


def _sampler_failing_for(request_id: str, after: int):  # noqa: ANN202
    """The real sampler, failing once ``request_id`` has ``after`` tokens. It fails after the
    batched draw, so a seeded neighbour's generator has moved and must be rewound."""
    real = engine_module.sample

    def sample(logits, seqs, grammars=()):  # noqa: ANN001, ANN202
        out = real(logits, seqs, grammars)
        if any(s.request_id == request_id and s.num_output_tokens >= after for s in seqs):
            raise IndexError("injected sampler fault")
        return out

    return sample


def test_one_failing_request_leaves_the_rest_of_the_batch_alone(small_pool_engine: LLMEngine, monkeypatch) -> None:
    engine = small_pool_engine
    tok = engine.tokenizer
    prompts = [tok.encode(f"Here is a sentence about {t}:") for t in TOPICS[:4]]
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    params = [greedy, greedy, greedy, SamplingParams(temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)]
    alone = [_run_alone(engine, p, sp) for p, sp in zip(prompts, params)]

    monkeypatch.setattr(engine_module, "sample", _sampler_failing_for("bad-sample", after=2))
    engine.add_request(prompts[0], greedy, "bad-sample")
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(p, sp, f"ok{i}")
    engine.add_request(prompts[1], greedy, "bad-text")
    engine.requests["bad-text"].detokenizer = _FailingDetokenizer(tok, after=3)
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out

    bad = finals["bad-sample"]
    assert isinstance(bad.error, RuntimeError) and "sampling" in str(bad.error) and "injected" in str(bad.error)
    assert bad.outputs[0].finish_reason == "error" and len(bad.outputs[0].token_ids) == 2
    text = finals["bad-text"]
    assert "detokenizing" in str(text.error) and text.outputs[0].finish_reason == "error"
    for i in range(4):
        assert finals[f"ok{i}"].error is None
        assert finals[f"ok{i}"].outputs[0].token_ids == alone[i], i
    bm = engine.block_manager
    assert not engine.requests and bm.num_free_blocks == bm.num_blocks


def test_a_failing_forward_pass_fails_its_batch_and_the_engine_goes_on(small_pool_engine: LLMEngine,
                                                                       monkeypatch) -> None:
    engine = small_pool_engine
    tok = engine.tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = tok.encode("The weather today is")
    want = _run_alone(engine, prompt, params)
    engine.add_request(prompt, params, "a")
    engine.add_request(tok.encode("My favourite book is"), params, "b")
    engine.step()

    def broken(batch):  # noqa: ANN001, ANN202
        raise RuntimeError("injected forward fault")

    monkeypatch.setattr(engine.runner, "execute", broken)
    outs = engine.step()
    assert sorted(o.request_id for o in outs) == ["a", "b"]
    assert all(o.finished and "forward pass" in str(o.error) for o in outs)
    bm = engine.block_manager
    assert not engine.requests and bm.num_free_blocks == bm.num_blocks
    monkeypatch.undo()
    assert _run_alone(engine, prompt, params) == want  # the next steps run as before


async def test_async_engine_raises_on_the_failing_stream_only(small_pool_engine: LLMEngine, monkeypatch) -> None:
    monkeypatch.setattr(engine_module, "sample", _sampler_failing_for("bad", after=1))
    engine = AsyncEngine(small_pool_engine)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    async def collect(prompt: str, request_id: str) -> list[int] | BaseException:
        try:
            async for out in engine.generate(prompt, params, request_id):
                final = out
            return list(final.outputs[0].token_ids)
        except Exception as e:  # noqa: BLE001
            return e

    try:
        results = await asyncio.gather(*(collect(f"Topic {i}: {t}.", f"r{i}") for i, t in enumerate(TOPICS[:3])),
                                       collect("Topic x: failure.", "bad"))
    finally:
        engine.shutdown()
    assert isinstance(results[-1], RuntimeError) and "injected sampler fault" in str(results[-1])
    for i, r in enumerate(results[:3]):
        assert r == _run_alone(small_pool_engine, small_pool_engine.tokenizer.encode(f"Topic {i}: {TOPICS[i]}."),
                               params)


async def test_the_engine_thread_stays_bound_and_a_callers_thread_gets_its_affinity_back(
        small_pool_engine: LLMEngine) -> None:
    """A step binds the stepping thread's OpenMP team one thread per core; the engine's own
    thread keeps that binding, a caller's thread (here the test's) gets its affinity back."""
    cpus = small_pool_engine.runner.thread_cpus
    if cpus is None:
        pytest.skip("one core or one thread here: nothing to bind")
    before = os.sched_getaffinity(0)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    alone = _run_alone(small_pool_engine, small_pool_engine.tokenizer.encode("Once upon a time"), params)
    assert os.sched_getaffinity(0) == before and len(alone) == 3
    engine = AsyncEngine(small_pool_engine)
    try:
        final = None
        async for final in engine.generate("Once upon a time", params):
            pass
        assert final is not None and list(final.outputs[0].token_ids) == alone  # bound or not, the same tokens
        assert await engine.call(lambda e: os.sched_getaffinity(0)) == {cpus[0]}
    finally:
        engine.shutdown()
    assert os.sched_getaffinity(0) == before
