#!/usr/bin/env python
"""A long prompt beside one streaming chat, in process (issue 33, item 3): the chat's gaps
between tokens while the prompt prefills, and what each engine step held.

    python bench/prefill_gap.py                          # ~8,000-token prompt on the default model
    python bench/prefill_gap.py --prompt-tokens 3000 --json gap.json
    nice -n 10 python bench/prefill_gap.py               # beside other work: compare step counts

One run, on one engine (the default model unless ``--model``; the compiled decode loaded before
the first step, as ``localllm bench`` does):

1. the long prompt alone (random token ids, no prefix hit, ``max_tokens`` 1): its prefill time
   and steps, with nothing else running;
2. one chat streams (greedy, ``ignore_eos``); after ``--warm-steps`` decode steps the same
   number of fresh random ids is added as a second prompt; the chat keeps streaming until that
   prompt has its token, then a few steps more.

Every step of run 2 is recorded: decode rows, prompt tokens, the chunk's start position, the
step's wall time, and the limit and predicted cost the prefill budget planned it with. In process a chat's gap between tokens is the
time between two steps that carry it (the engine's own loop, no server or client), so the
longest gap over the median gap while the prompt prefills is the issue's figure. It prints a
summary and, with ``--json``, writes every step. A benchmark, never a timed test.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402

from localllm.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from localllm.engine.sequence import SamplingParams  # noqa: E402


@dataclass(slots=True)
class StepRecord:
    t_end: float  # monotonic, after the step
    seconds: float
    decodes: int
    prompt_tokens: int
    prompt_start: int  # where the first prompt chunk starts (-1: none)
    limit_s: float | None  # the step's limit beside decodes (engine/step_budget.py; None: none)
    predicted_s: float | None  # the budget's cost model for this step when planned (None: none)
    chat_token: bool  # the streaming chat got a token in this step


def _random_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(n)]


def _step(engine: LLMEngine, chat_id: str | None) -> StepRecord | None:
    sched = engine.scheduler
    batch_box: list = []
    schedule = sched.schedule

    def spy():
        b = schedule()
        batch_box.append(b)
        return b

    sched.schedule = spy  # type: ignore[method-assign]
    seen = len(sched.prefill_budget.history)
    try:
        t0 = time.monotonic()
        outs = engine.step()
        t1 = time.monotonic()
    finally:
        del sched.schedule
    if not batch_box or not batch_box[0].seqs:
        return None
    b = batch_box[0]
    chunks = [(s, n) for s, n in zip(b.seqs, b.num_new_tokens) if n > 1 and not s.spec_token_ids]
    start = -1
    if chunks:
        s, n = chunks[0]
        start = s.num_computed_tokens - n  # update() advanced it already
    history = sched.prefill_budget.history
    sample = history[-1] if len(history) > seen or len(history) == history.maxlen else None
    return StepRecord(t1, t1 - t0, b.num_decodes, sum(n for _, n in chunks), start,
                      sample.limit_s if sample else None, sample.predicted_s if sample else None,
                      any(o.request_id == chat_id and o.outputs and o.outputs[0].token_ids for o in outs))


def run(opts: argparse.Namespace) -> dict[str, object]:
    engine = LLMEngine(EngineConfig(model=opts.model, compile_in_background=False))
    limit = engine.context_limit
    n = min(opts.prompt_tokens, limit - 2)
    greedy1 = SamplingParams(temperature=0.0, max_tokens=1)
    # warm-up: a short prompt and a few decode steps (the eager and compiled paths' first calls)
    engine.add_request(_random_ids(64, 1), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()

    # 1. the prompt alone
    alone: list[StepRecord] = []
    engine.add_request(_random_ids(n, 2), greedy1)
    t0 = time.monotonic()
    while engine.has_unfinished():
        r = _step(engine, None)
        if r is not None:
            alone.append(r)
    alone_s = time.monotonic() - t0

    # 2. beside a chat
    steps: list[StepRecord] = []
    chat = engine.add_request("Once upon a time", SamplingParams(temperature=0.0, max_tokens=opts.chat_tokens_max,
                                                                  ignore_eos=True))
    for _ in range(opts.warm_steps):
        r = _step(engine, chat)
        if r is not None:
            steps.append(r)
    first_during = len(steps)
    sent = time.monotonic()
    long_id = engine.add_request(_random_ids(n, 3), greedy1)
    done_at: float | None = None
    extra = 0
    while extra < opts.after_steps and engine.has_unfinished():
        r = _step(engine, chat)
        if r is None:
            break
        steps.append(r)
        if done_at is None and long_id not in engine.requests:
            done_at = r.t_end
            last_during = len(steps)
        elif done_at is not None:
            extra += 1
    engine.abort_request(chat)
    assert done_at is not None, "the long prompt did not finish"
    stamps = [r.t_end for r in steps if r.chat_token]
    before = [b - a for a, b in zip(stamps, stamps[1:]) if b <= sent]
    during = [b - a for a, b in zip(stamps, stamps[1:]) if b > sent and a < done_at]
    during_steps = steps[first_during:last_during]
    med = statistics.median(during)
    return {
        "cpu": _cpu(), "load_before": os.getloadavg(), "prompt_tokens": n,
        "alone_s": round(alone_s, 2), "alone_steps": len(alone),
        "beside_s": round(done_at - sent, 2), "beside_steps": len(during_steps),
        "slowdown": round((done_at - sent) / alone_s, 2),
        "gap_before_median_s": round(statistics.median(before), 4),
        "gap_during_median_s": round(med, 4), "gap_during_max_s": round(max(during), 4),
        "max_over_median_during": round(max(during) / med, 2),
        "max_over_median_before": round(max(during) / statistics.median(before), 1),
        "steps_without_chat": sum(1 for r in during_steps if not r.chat_token),
        "load_after": os.getloadavg(),
        "steps": [asdict(r) for r in steps], "alone": [asdict(r) for r in alone],
    }


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} x{os.cpu_count()}"
    except OSError:
        pass
    return f"unknown x{os.cpu_count()}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model name or path (default: the default model)")
    p.add_argument("--prompt-tokens", type=int, default=8000, help="the long prompt's length (capped by the context)")
    p.add_argument("--chat-tokens-max", type=int, default=4000, help="the chat's max_tokens (it must outlast the prefill)")
    p.add_argument("--warm-steps", type=int, default=20, help="chat decode steps before the long prompt")
    p.add_argument("--after-steps", type=int, default=5, help="chat steps after the prompt's token")
    p.add_argument("--json", default=None, help="write every figure and step here")
    p.add_argument("--steps", action="store_true", help="print every step of the run beside the chat")
    opts = p.parse_args(argv)
    r = run(opts)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(r, f, indent=1)
    if opts.steps:
        for s in r["steps"]:  # type: ignore[union-attr]
            print(f"{s['seconds']*1000:8.1f} ms  decodes {s['decodes']}  prompt {s['prompt_tokens']:4d} @ {s['prompt_start']:5d}"
                  f"  limit {s['limit_s'] and round(s['limit_s']*1000, 1)}"
                  f"  predicted {s['predicted_s'] and round(s['predicted_s']*1000, 1)}")
    for k, v in r.items():
        if k not in ("steps", "alone"):
            print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
