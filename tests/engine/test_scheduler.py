"""The scheduler on hand-built sequences (no model): the token budget, chunked prefill,
admission, preemption order, abort, and ``update`` as the one writer of progress."""

from __future__ import annotations

from localllm.engine.block_manager import BlockManager
from localllm.engine.scheduler import ScheduledBatch, Scheduler
from localllm.engine.sequence import SamplingParams, Sequence, SequenceStatus

BS = 4  # tokens per block


def _seq(rid: str, n_prompt: int, max_tokens: int = 100, eos: tuple[int, ...] = (), **kw: object) -> Sequence:
    return Sequence(rid, list(range(100, 100 + n_prompt)), SamplingParams(max_tokens=max_tokens, **kw),  # type: ignore[arg-type]
                    eos, 1000)


def _scheduler(num_blocks: int = 64, budget: int = 8, max_seqs: int = 4) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BS), budget, max_seqs)


def _run(sched: Scheduler, token: int = 7) -> ScheduledBatch:
    """One step: schedule, then update as if every finished prompt sampled ``token``."""
    batch = sched.schedule()
    sampled = [(s, token) for s, n in zip(batch.seqs, batch.num_new_tokens) if s.num_computed_tokens + n == s.num_tokens]
    sched.update(batch, sampled)
    return batch


def _plan(batch: ScheduledBatch) -> list[tuple[str, int]]:
    return [(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)]


def test_decodes_first_then_a_prefill_chunk_in_what_is_left() -> None:
    sched = _scheduler(budget=8)
    a, b = _seq("a", 3), _seq("b", 2)
    sched.add(a)
    sched.add(b)
    assert _plan(_run(sched)) == [("a", 3), ("b", 2)]  # both prompts fit in one step
    c = _seq("c", 10)
    sched.add(c)
    batch = _run(sched)
    assert _plan(batch) == [("a", 1), ("b", 1), ("c", 6)] and batch.num_decodes == 2
    assert c.num_computed_tokens == 6 and c.num_output_tokens == 0  # mid-prefill: no token yet
    assert _plan(_run(sched)) == [("a", 1), ("b", 1), ("c", 4)]
    assert c.num_output_tokens == 1
    assert _plan(_run(sched)) == [("a", 1), ("b", 1), ("c", 1)]


def test_a_long_prompt_is_chunked_to_the_budget() -> None:
    sched = _scheduler(budget=8)
    s = _seq("long", 21)
    sched.add(s)
    chunks = []
    while s.num_output_tokens == 0:
        chunks.append(_plan(_run(sched))[0][1])
    assert chunks == [8, 8, 5]
    assert s.num_computed_tokens == 21 and s.num_tokens == 22


def test_admission_stops_at_max_num_seqs_and_at_the_free_blocks() -> None:
    sched = _scheduler(budget=64, max_seqs=2)
    for i in range(3):
        sched.add(_seq(f"s{i}", 4))
    assert [r for r, _ in _plan(_run(sched))] == ["s0", "s1"]
    assert [s.request_id for s in sched.waiting] == ["s2"]

    sched = _scheduler(num_blocks=4, budget=64)
    big, small = _seq("big", 13), _seq("small", 2)  # 13 tokens need all 4 blocks
    first = _seq("first", 5)  # takes 2 blocks
    for s in (first, big, small):
        sched.add(s)
    # big does not fit beside first, and first come first served keeps small behind it
    assert _plan(_run(sched)) == [("first", 5)]
    assert [s.request_id for s in sched.waiting] == ["big", "small"]


def test_preemption_takes_the_newest_and_requeues_it_first() -> None:
    sched = _scheduler(num_blocks=4, budget=16)
    a, b, c = _seq("a", 4), _seq("b", 3), _seq("c", 3)
    for s in (a, b, c):
        sched.add(s)
    _run(sched)  # one block each
    _run(sched)  # a's fifth token takes the last block
    assert sched.block_manager.num_free_blocks == 0
    batch = _run(sched)  # b's fifth token needs a block: the newest request, c, gives way
    assert [s.request_id for s in batch.preempted] == ["c"]
    assert _plan(batch) == [("a", 1), ("b", 1)]
    assert c.status is SequenceStatus.WAITING and c.num_computed_tokens == 0 and not c.block_table
    assert c.num_preemptions == 1 and sched.num_preemptions == 1
    assert sched.waiting[0] is c
    assert c.num_output_tokens == 2  # its tokens are kept: the recompute continues from them


def test_abort_frees_blocks_whether_waiting_or_running() -> None:
    sched = _scheduler(budget=4)
    running, waiting = _seq("running", 4), _seq("waiting", 9)
    sched.add(running)
    sched.add(waiting)
    _run(sched)
    assert running.status is SequenceStatus.RUNNING and waiting.status is SequenceStatus.WAITING
    sched.finish(running, "abort")
    sched.finish(waiting, "abort")
    assert running.finished and running.finish_reason == "abort" and not running.block_table
    assert waiting.finished and not sched.waiting and not sched.running
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert not sched.has_unfinished()


def test_update_hashes_full_blocks_and_finishes_on_tokens() -> None:
    sched = _scheduler(budget=64)
    s = _seq("s", 9)
    sched.add(s)
    _run(sched)
    assert s.num_computed_tokens == 9 and len(s.block_hashes) == 2  # 9 computed tokens: 2 full blocks
    _run(sched)
    assert len(s.block_hashes) == 2  # the 10th token is computed, block 3 is not full yet

    eos, stop, length = _seq("eos", 3, eos=(7,)), _seq("stop", 3, stop_token_ids=[7]), _seq("len", 3, max_tokens=2)
    for x in (eos, stop, length):
        sched.add(x)
    _run(sched, token=7)
    assert (eos.finish_reason, eos.stop_reason) == ("stop", None)
    assert (stop.finish_reason, stop.stop_reason) == ("stop", 7)
    assert not length.finished
    _run(sched, token=7)
    assert (length.finish_reason, length.num_output_tokens) == ("length", 2)
    assert all(x.finished and not x.block_table for x in (eos, stop, length))
    assert sched.running == [s]

    near = Sequence("ctx", [1, 2, 3], SamplingParams(max_tokens=None), (), 5)
    sched.add(near)
    _run(sched)
    assert not near.finished
    _run(sched)
    assert near.finish_reason == "length" and near.num_tokens == 5  # the context limit


def test_finishing_again_replaces_the_reason_only() -> None:
    sched = _scheduler()
    s = _seq("s", 3, max_tokens=1)
    sched.add(s)
    _run(sched)
    assert s.finish_reason == "length"
    sched.finish(s, "stop", "###")  # a stop string in the last token's text wins
    assert (s.finish_reason, s.stop_reason) == ("stop", "###")
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_beside_decodes_a_prompt_takes_what_its_measured_cost_allows() -> None:
    """Without decodes a prompt takes the whole budget; beside one, a small first chunk until a
    step with prompt tokens was measured, then what the cost model (``step_budget``) keeps
    within the step's limit, from the chunk's start position in its prompt."""
    sched = _scheduler(num_blocks=128, budget=64)
    budget = sched.prefill_budget
    budget.min_tokens, budget.first_tokens = 4, 8
    alone = _seq("alone", 100)
    sched.add(alone)
    assert _plan(_run(sched)) == [("alone", 64)]  # no decodes: the budget
    budget.observe(0.010 + 64 * 0.001, prompt_tokens=64, decodes=0)
    assert _plan(_run(sched)) == [("alone", 36)]
    budget.observe(0.010 + 36 * 0.001 + 0.002, prompt_tokens=36, decodes=0)
    assert [s.start for s in budget.history] == [0, 64]  # the scheduler told the budget where chunks start
    assert _plan(_run(sched)) == [("alone", 1)]
    budget.observe(0.005, prompt_tokens=0, decodes=1)
    late = Sequence("late", list(range(300, 400)), SamplingParams(max_tokens=100), (), 1000)  # no prefix hit
    sched.add(late)
    batch = _run(sched)
    n = batch.num_new_tokens[1]
    assert _plan(batch)[0] == ("alone", 1) and 2 <= n <= budget.min_tokens * budget.growth  # ramps up from small
    assert budget.limit_s is not None and budget.predict(1, [(0, n)]) <= budget.limit_s or n == budget.min_tokens
    budget.observe(budget.predict(1, [(0, n)]), prompt_tokens=n, decodes=1)
    assert budget.history[-1].start == 0 and budget.history[-1].limit_s is not None
    sched.finish(alone, "abort")  # no decode left beside it: the prompt takes the whole budget again
    assert _plan(_run(sched)) == [("late", 64)]

def test_a_burst_of_short_prompts_beside_a_decode_is_admitted_in_one_step() -> None:
    """Chats opened together (16 streams of ~40-token prompts): the first is alone in its
    prefill, the others arrive while it runs. Beside its decode they all join the next step
    whole (a burst), not over a ramp of chunks that grows 2x a step from ``first_tokens``."""
    sched = _scheduler(num_blocks=512, budget=512, max_seqs=16)
    first = _seq("s0", 40)
    sched.add(first)
    assert _plan(_run(sched)) == [("s0", 40)]  # alone: the whole budget
    sched.prefill_budget.observe(0.040, prompt_tokens=40, decodes=0)
    others = [Sequence(f"s{i}", list(range(1000 * i, 1000 * i + 38 + i % 3)), SamplingParams(max_tokens=100), (), 1000)
              for i in range(1, 16)]  # no shared prefix with s0 or with each other
    for s in others:
        sched.add(s)
    batch = _run(sched)  # nothing measured beside decodes yet: fit alone would give 32 tokens
    # 15 x ~39 tokens exceed the 511 left: the 13 that fit, whole, and the rest the next step
    assert _plan(batch) == [("s0", 1)] + [(s.request_id, s.num_prompt_tokens) for s in others[:13]]
    assert all(s.num_output_tokens == 1 for s in others[:13])  # prompts done: each sampled its first token
    sched.prefill_budget.observe(0.5, prompt_tokens=batch.num_tokens - 1, decodes=1)
    batch = _run(sched)
    assert _plan(batch) == [(s.request_id, 1) for s in [first, *others[:13]]] + [
        (s.request_id, s.num_prompt_tokens) for s in others[13:]]
    assert _plan(_run(sched)) == [(s.request_id, 1) for s in [first, *others]]  # then 16 decodes


def test_a_burst_stays_within_the_token_budget_and_a_lone_short_prompt_is_not_one() -> None:
    sched = _scheduler(num_blocks=512, budget=100, max_seqs=16)
    sched.add(_seq("run", 4))
    _run(sched)
    sched.prefill_budget.observe(0.02, prompt_tokens=4, decodes=0)
    shorts = [Sequence(f"b{i}", list(range(1000 * i, 1000 * i + 30)), SamplingParams(max_tokens=10), (), 1000)
              for i in range(1, 5)]
    for s in shorts:
        sched.add(s)
    plan = _plan(_run(sched))
    # 99 tokens left beside the decode: three whole prompts, the fourth a chunk of what is left
    # that fits the ramp (or nothing); never over the budget
    assert plan[:4] == [("run", 1), ("b1", 30), ("b2", 30), ("b3", 30)]
    assert sum(n for _, n in plan) <= 100
    lone = _scheduler(num_blocks=512, budget=512, max_seqs=16)
    lone.add(_seq("run", 4))
    _run(lone)
    lone.prefill_budget.observe(0.02, prompt_tokens=4, decodes=0)
    lone.add(Sequence("one", list(range(5000, 5040)), SamplingParams(max_tokens=10), (), 1000))
    # one short prompt beside a decode is chunked as before (issue 33's gap bound): first_tokens
    assert _plan(_run(lone)) == [("run", 1), ("one", lone.prefill_budget.first_tokens)]
