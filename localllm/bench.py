"""``localllm bench``: throughput and latency of the engine (or of any OpenAI-compatible
server, with ``--endpoint``) on the workloads that matter for chat.

Workloads:

- ``chats``: N concurrent chats (N = 1, 4, 16, 64) served from a shared queue of
  ``rounds * N`` requests, each chat sending its next request as soon as its reply ends.
  The default 16 rounds keep the queue busy past the first stragglers: with 4, most of a
  straggler run is four lone long replies after the queue has drained, which measures the
  workload's end, not the batching. The report prints each ratio beside its bound at equal
  step cost (``step_bounds``), which tells one case from the other.
  Two output-length mixes: ``mixed`` (deterministic spread from 32 to 1,024 tokens) and
  ``straggler`` (one 2,000-token reply per max(N, 4) requests, the rest 50 tokens).
- ``rag``: a shared 3,000-token system prompt, then short questions one at a time;
  TTFT of the later questions against the first (which pays the prefill).
- ``multiturn``: one 10-turn chat; TTFT of turn 10 against turn 2.
- ``guided`` (only when asked for): structured output's cost per decode step. N = 1 and 16
  chats decode the same number of tokens, once free and once under a JSON schema that cannot
  end sooner; inter-token latency (one step) and throughput of each, and the ratio (target:
  the grammar costs at most 10% of decode throughput).
- ``spec`` (only when asked for; local engine): speculative decoding (n-gram proposals, or
  the draft model of ``--draft-model`` / ``--speculative-config``) on and off, trials alternating so that load drift falls on both: single-stream decode speed
  on a code file repeated and a RAG quote (replies that copy long spans of the prompt) and on sampled
  prose, and 16 concurrent chats' throughput; with each case's acceptance rate.

``--compare static,sequential`` reruns the chat requests with static batching (batches of N
start together, every row is padded to the batch's longest reply, and the next batch waits
for the slowest of the last) and one at a time;
``nocache`` reruns rag and multiturn with prefix caching off (local engine only). Output
lengths are fixed with ``ignore_eos``; ``--scale`` shrinks them for quick runs.

Timings come from the request metrics the engine (or ``RemoteEngine``) records; a request's
TTFT counts from when the benchmark hands it over. Every run gets fresh prompt text (a run
nonce), and the local prefix cache is reset between modes, so no mode inherits another's
cache. The local run also measures batch-1 decode against a plain greedy loop over the same
model runner, with no scheduler, block manager or detokenizer in the way.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import math
import random
import re
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from localllm.cli_common import positive_int

if TYPE_CHECKING:
    import httpx

    from localllm.engine.async_engine import AsyncEngine
    from localllm.engine.engine import LLMEngine, Prompt
    from localllm.engine.spec_decode import SpeculativeConfig
    from localllm.server.remote import RemoteEngine
    from localllm.tokenizer import Tokenizer

T = TypeVar("T")
WORKLOADS = ("chats", "rag", "multiturn")
EXTRA_WORKLOADS = ("guided", "spec")  # run only when named
GUIDED_BATCHES = (1, 16)
GUIDED_TOKENS = 128
# JSON strings are where a mask is dearest (most of the vocabulary is allowed); 1,000 items
# cannot be written within the run, so every request decodes all its tokens under the grammar
GUIDED_SCHEMA = {"type": "object", "properties": {"notes": {
    "type": "array", "items": {"type": "string", "maxLength": 48}, "minItems": 1000}}, "required": ["notes"]}
MIXES = ("mixed", "straggler")
COMPARE_MODES = ("static", "sequential", "nocache")
MIXED_LENGTHS = (32, 64, 128, 256, 512, 1024)
STRAGGLER_LONG, STRAGGLER_SHORT = 2000, 50
MIN_TOKENS = 4

TOPICS = ["a lighthouse keeper", "the first train to the coast", "a lost umbrella", "bees in winter",
          "a chess club", "the night market", "an old radio", "a mountain rescue", "bread at dawn",
          "a robot gardener", "the flooded library", "a jazz trio", "a desert well", "two rival bakers",
          "the moon base", "a paper boat"]
QUESTIONS = ["What does the document say about the harbor?", "Summarize the second paragraph.",
             "Which city is mentioned most often?", "What is the budget for the bridge?",
             "Who wrote the report?", "List three risks the document names.",
             "What happens in winter?", "Is the factory still open?", "What is the main conclusion?",
             "Which station is closest to the valley?"]
TURN_MESSAGES = ["Let's plan a trip to the mountains.", "What should I pack?", "How about food?",
                 "Which trail is best for beginners?", "What if it rains?", "How long should we stay?",
                 "Can we bring a dog?", "What about the budget?", "Any safety tips?",
                 "Summarize the plan in three lines.", "Thanks, anything else?", "Goodbye!"]
_DOC_WORDS = ("river market engine garden report city winter signal budget forest harbor metal paper "
              "window system battery valley rocket museum lesson farmer weather bridge circuit planet "
              "doctor kitchen island station meeting orange silver desert library theory network "
              "factory highway village").split()


# ---- options and results ----

@dataclass(slots=True)
class BenchOptions:
    workloads: tuple[str, ...] = WORKLOADS
    chats: tuple[int, ...] = (1, 4, 16, 64)
    mixes: tuple[str, ...] = MIXES
    compare: tuple[str, ...] = ()
    rounds: int = 16  # chat requests per chat slot
    scale: float = 1.0  # output lengths are multiplied by this
    rag_tokens: int = 3000
    questions: int = 8
    turns: int = 10
    plain_tokens: int = 64  # batch-1 decode tokens against the plain loop; 0 skips it
    progress: Callable[[str], None] | None = None


@dataclass(slots=True)
class BenchRequest:
    prompt: Prompt  # chat messages, text, or token ids
    max_tokens: int
    guided_json: dict[str, Any] | None = None  # constrain the reply to this schema
    temperature: float = 0.0  # greedy unless a workload samples (seed 0 then: the same reply each time)


@dataclass(slots=True)
class RequestResult:
    ttft_s: float | None
    latency_s: float
    itls: list[float]
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int
    text: str


@dataclass(slots=True)
class RunMetrics:
    mode: str
    requests: int
    output_tokens: int
    wall_s: float
    output_tok_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None
    latency_p50_s: float | None
    latency_p99_s: float | None
    peak_kv_usage: float | None  # fraction of the KV pool held by running requests
    peak_kv_blocks: int | None
    prefix_hit_rate: float | None  # cached prompt tokens / prompt tokens
    prompt_tokens: int
    cached_tokens: int
    max_batch: int | None
    preemptions: int | None
    slot_utilization: float | None = None  # static only: real tokens / (slots x slowest reply)


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


# ---- the engine under test ----

class _Target:
    """What the benchmark needs from a local ``AsyncEngine`` or a ``RemoteEngine``."""

    def __init__(self, engine: AsyncEngine | RemoteEngine) -> None:
        from localllm.server.remote import RemoteEngine

        self.engine = engine
        # the local engine: driven through its API on its own thread (AsyncEngine.call)
        self.local_engine: AsyncEngine | None = None if isinstance(engine, RemoteEngine) else engine
        self.llm: LLMEngine | None = None if self.local_engine is None else self.local_engine.engine  # reads only
        self.endpoint: str | None = engine.endpoint if isinstance(engine, RemoteEngine) else None
        self._metrics_ok = self.endpoint is not None

    @property
    def local(self) -> bool:
        return self.llm is not None

    def count_tokens(self, text: str) -> int | None:
        return len(self.llm.tokenizer.encode(text, add_special_tokens=False)) if self.llm else None

    async def reset_cache(self) -> None:
        """Forgets the local engine's cached prefixes, on its thread (a remote server keeps its
        own: each mode's nonce keeps their prompts apart)."""
        if self.local_engine is not None:
            await self.local_engine.call(lambda e: e.reset_prefix_cache())

    @asynccontextmanager
    async def _setting(self, set_: Callable[[LLMEngine, T], T], value: T) -> AsyncIterator[None]:
        """``set_(engine, value)`` on the local engine's thread for the block, then the value it
        returned (the one before) set back the same way; a remote server keeps its own."""
        engine = self.local_engine
        if engine is None:
            yield
            return
        before = await engine.call(lambda e: set_(e, value))
        try:
            yield
        finally:
            await engine.call(lambda e: set_(e, before))

    def speculating(self, config: SpeculativeConfig | None) -> AbstractAsyncContextManager[None]:
        """Speculative decoding with ``config`` (None: off) in the local engine for the block."""
        return self._setting(lambda e, v: e.set_speculative(v), config)

    def caching(self, enabled: bool) -> AbstractAsyncContextManager[None]:
        """Prefix caching on or off in the local engine for the block."""
        return self._setting(lambda e, v: e.set_prefix_caching(v), enabled)

    async def kv_sample(self, client: httpx.AsyncClient | None) -> tuple[float | None, int | None, int | None, int | None]:
        """(KV usage, KV blocks used, batch size, preemptions so far), None where unknown."""
        if self.llm is not None:
            s = self.engine.stats()
            # the peaks since ``measure`` began (a short request can start and end between
            # polls); an idle engine's snapshot still shows its last step's batch, from before
            batch = max(s.batch_size if s.num_running else 0, s.batch_size_peak) or None
            blocks = max(s.kv_blocks_used, s.kv_blocks_peak)
            return blocks / s.kv_blocks_total if s.kv_blocks_total else 0.0, blocks, batch, s.num_preemptions
        if not self._metrics_ok or client is None:
            return None, None, None, None
        return await self._scrape(client), None, None, None

    async def _scrape(self, client: httpx.AsyncClient) -> float | None:
        """KV usage from a Prometheus /metrics page: vLLM's, SGLang's and ours."""
        assert self.endpoint is not None
        url = re.sub(r"/v1$", "", self.endpoint) + "/metrics"
        try:
            r = await client.get(url)
        except Exception:  # noqa: BLE001 - any failure means "this server has no metrics"
            self._metrics_ok = False
            return None
        if r.status_code != 200:
            self._metrics_ok = False
            return None
        best: float | None = None
        for line in r.text.splitlines():
            if line.startswith("#"):
                continue
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name.endswith(("kv_cache_usage_perc", "gpu_cache_usage_perc")) or name == "sglang:token_usage":
                try:
                    value = float(line.rsplit(" ", 1)[1])
                except (IndexError, ValueError):
                    continue
                best = value if best is None else max(best, value)
        return best


async def _one(target: _Target, req: BenchRequest, rid: str, pad_to: int | None = None) -> RequestResult:
    """Runs one request to its end. With ``pad_to`` the request keeps decoding to that many
    tokens, as a padded row of a static batch does, but only its own ``max_tokens`` count as
    output; its latency still runs to the padded end, when a static batch hands results back."""
    from localllm.engine.sequence import SamplingParams

    params = SamplingParams(temperature=req.temperature, max_tokens=max(req.max_tokens, pad_to or 0), ignore_eos=True,
                            guided_json=req.guided_json, seed=0 if req.temperature else None)
    t0 = time.monotonic()
    final = None
    async for out in target.engine.generate(req.prompt, params, rid):
        final = out
    assert final is not None and final.finished
    m = final.metrics
    end = m.finished_time or m.last_token_time or time.monotonic()
    useful = final.outputs[0].token_ids[: req.max_tokens]
    return RequestResult(
        ttft_s=None if m.first_token_time is None else m.first_token_time - t0,
        latency_s=end - t0,
        itls=list(m.inter_token_latencies)[: max(len(useful) - 1, 0)],
        output_tokens=len(useful),
        prompt_tokens=len(final.prompt_token_ids),
        cached_tokens=final.num_cached_tokens,
        text=final.outputs[0].text,  # read by multiturn only, which never pads
    )


class _Run:
    """One measured run: samples KV use while it lasts and sums up its requests."""

    def __init__(self, target: _Target, mode: str) -> None:
        self.target = target
        self.mode = mode
        self.results: list[RequestResult] = []
        self.peak_usage: float | None = None
        self.peak_blocks: int | None = None
        self.max_batch: int | None = None
        self.preempt0: int | None = None
        self.preempt1: int | None = None
        self._ids = 0

    def rid(self) -> str:
        self._ids += 1
        return f"bench-{self.mode}-{self._ids}-{random.getrandbits(32):08x}"

    async def measure(self, work: Callable[[], Awaitable[None]]) -> float:
        import httpx

        key = getattr(self.target.engine, "api_key", None)
        client = None if self.target.local else httpx.AsyncClient(
            timeout=5.0, headers={"Authorization": f"Bearer {key}"} if key else None)
        stop = asyncio.Event()

        async def sampler() -> None:
            interval = 0.01 if self.target.local else 0.25
            while True:
                usage, blocks, batch, preempt = await self.target.kv_sample(client)
                if usage is not None:
                    self.peak_usage = max(self.peak_usage or 0.0, usage)
                if blocks is not None:
                    self.peak_blocks = max(self.peak_blocks or 0, blocks)
                if batch is not None:
                    self.max_batch = max(self.max_batch or 0, batch)
                if preempt is not None:
                    self.preempt0 = preempt if self.preempt0 is None else self.preempt0
                    self.preempt1 = preempt
                if stop.is_set():
                    return
                try:
                    await asyncio.wait_for(stop.wait(), interval)
                except asyncio.TimeoutError:
                    pass

        if self.target.local_engine is not None:
            await self.target.local_engine.call(lambda e: e.reset_peaks())
        task = asyncio.create_task(sampler())
        t0 = time.monotonic()
        try:
            await work()
        finally:
            wall = time.monotonic() - t0
            stop.set()
            await task
            if client is not None:
                await client.aclose()
        return wall

    def metrics(self, wall: float, slot_utilization: float | None = None) -> RunMetrics:
        rs = self.results
        out = sum(r.output_tokens for r in rs)
        prompt = sum(r.prompt_tokens for r in rs)
        cached = sum(r.cached_tokens for r in rs)
        ttfts = [r.ttft_s for r in rs if r.ttft_s is not None]
        itls = [x for r in rs for x in r.itls]
        lat = [r.latency_s for r in rs]

        def rnd(x: float | None, nd: int = 4) -> float | None:
            return None if x is None else round(x, nd)

        return RunMetrics(
            mode=self.mode, requests=len(rs), output_tokens=out, wall_s=round(wall, 3),
            output_tok_s=round(out / wall, 2) if wall > 0 else 0.0,
            ttft_p50_s=rnd(percentile(ttfts, 50)), ttft_p99_s=rnd(percentile(ttfts, 99)),
            itl_p50_s=rnd(percentile(itls, 50), 5), itl_p99_s=rnd(percentile(itls, 99), 5),
            latency_p50_s=rnd(percentile(lat, 50)), latency_p99_s=rnd(percentile(lat, 99)),
            peak_kv_usage=rnd(self.peak_usage), peak_kv_blocks=self.peak_blocks,
            prefix_hit_rate=round(cached / prompt, 4) if prompt else None,
            prompt_tokens=prompt, cached_tokens=cached, max_batch=self.max_batch,
            preemptions=None if self.preempt0 is None else (self.preempt1 or 0) - self.preempt0,
            slot_utilization=rnd(slot_utilization),
        )


# ---- serving disciplines over one request list ----

Measured = tuple[RunMetrics, list[RequestResult]]


async def run_continuous(target: _Target, reqs: list[BenchRequest], concurrency: int) -> Measured:
    """``concurrency`` chats pull from one queue; the engine batches whatever is in flight."""
    run = _Run(target, "continuous")
    queue = list(reversed(reqs))

    async def chat() -> None:
        while queue:
            req = queue.pop()
            run.results.append(await _one(target, req, run.rid()))

    async def work() -> None:
        await asyncio.gather(*(chat() for _ in range(min(concurrency, len(reqs)))))

    return run.metrics(await run.measure(work)), run.results


async def run_static(target: _Target, reqs: list[BenchRequest], batch_size: int) -> Measured:
    """Static batching as HF ``generate`` does it: batches of ``batch_size`` start together,
    every row decodes until the batch's longest reply is done (the padding is computed, not
    skipped), and the next batch starts only then. Only the tokens each request asked for
    count as output."""
    run = _Run(target, "static")
    used = slots = 0

    async def work() -> None:
        nonlocal used, slots
        for i in range(0, len(reqs), batch_size):
            batch = reqs[i : i + batch_size]
            longest = max(r.max_tokens for r in batch)
            results = await asyncio.gather(*(_one(target, r, run.rid(), pad_to=longest) for r in batch))
            run.results.extend(results)
            used += sum(r.output_tokens for r in results)
            slots += len(batch) * longest

    wall = await run.measure(work)
    return run.metrics(wall, used / slots if slots else None), run.results


async def run_sequential(target: _Target, reqs: list[BenchRequest], mode: str = "sequential") -> Measured:
    run = _Run(target, mode)

    async def work() -> None:
        for req in reqs:
            run.results.append(await _one(target, req, run.rid()))

    return run.metrics(await run.measure(work)), run.results


# ---- workloads ----

def _scaled(tokens: int, scale: float) -> int:
    return max(MIN_TOKENS, round(tokens * scale))


def chat_lengths(n: int, mix: str, rounds: int, scale: float) -> list[int]:
    total = rounds * n
    if mix == "straggler":
        period = max(n, 4)  # at N = 1 every reply would be the straggler
        raw = [STRAGGLER_LONG if i % period == 0 else STRAGGLER_SHORT for i in range(total)]
    else:
        # a fixed shuffle of the length ladder: every run and every mode gets the same lengths
        raw = [MIXED_LENGTHS[i % len(MIXED_LENGTHS)] for i in range(total)]
        random.Random(1234 + n).shuffle(raw)
    return [_scaled(t, scale) for t in raw]


def step_bounds(lengths: list[int], n: int) -> dict[str, int]:
    """Decode steps each discipline needs for these replies if every step cost the same:
    the ratios any engine can reach at most, whatever its speed. Continuous: ``n`` chats pull
    from the queue in order, and a reply holds its chat for one step per token."""
    free_at = [0] * min(n, len(lengths))
    for length in lengths:
        heapq.heappush(free_at, heapq.heappop(free_at) + length)
    return {
        "continuous": max(free_at, default=0),
        "static": sum(max(lengths[i : i + n]) for i in range(0, len(lengths), n)),
        "sequential": sum(lengths),
    }


def chat_requests(n: int, mix: str, rounds: int, scale: float, nonce: str) -> list[BenchRequest]:
    return [BenchRequest([{"role": "user", "content": f"[{nonce}-{i}] Write a long story about "
                                                      f"{TOPICS[i % len(TOPICS)]}."}], length)
            for i, length in enumerate(chat_lengths(n, mix, rounds, scale))]


def document(target: _Target, tokens: int, nonce: str) -> str:
    """Pseudo-prose of about ``tokens`` tokens; exact when the tokenizer is at hand."""
    return prose(tokens, nonce, target.llm.tokenizer if target.llm is not None else None)


def prose(tokens: int, nonce: str, tokenizer: Tokenizer | None = None) -> str:
    """``document``'s text for a caller that holds a tokenizer but no engine (bench/peers.py)."""
    rng = random.Random(42)
    sentences = []
    words = 0
    while words * 1.1 < tokens * 1.05:  # ~1.1 tokens a word with this vocabulary and punctuation
        k = rng.randint(6, 14)
        sentences.append(" ".join(rng.choice(_DOC_WORDS) for _ in range(k)).capitalize() + ".")
        words += k
    text = f"Document {nonce}. " + " ".join(sentences)
    if tokenizer is not None:
        return tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)[:tokens])
    return " ".join(text.split()[: int(tokens / 1.1)])


def _say(opts: BenchOptions, message: str) -> None:
    if opts.progress is not None:
        opts.progress(message)


async def bench_chats(target: _Target, opts: BenchOptions, nonce: str) -> list[dict[str, Any]]:
    rows = []
    modes = ["continuous"] + [m for m in ("static", "sequential") if m in opts.compare]
    for n in opts.chats:
        for mix in opts.mixes:
            row: dict[str, Any] = {"n": n, "mix": mix, "modes": {}}
            for mode in modes:
                # a fresh nonce per mode: no mode reuses another's cached prompts on a remote server
                reqs = chat_requests(n, mix, opts.rounds, opts.scale, f"{nonce}-{mode}")
                row["requests"] = len(reqs)
                row["output_lengths"] = sorted({r.max_tokens for r in reqs})
                _say(opts, f"chats N={n} {mix}: {mode} ({len(reqs)} requests, "
                           f"{sum(r.max_tokens for r in reqs):,} output tokens)")
                await target.reset_cache()
                if mode == "continuous":
                    m, _ = await run_continuous(target, reqs, n)
                elif mode == "static":
                    m, _ = await run_static(target, reqs, n)
                else:
                    m, _ = await run_sequential(target, reqs)
                row["modes"][mode] = asdict(m)
            cont = row["modes"]["continuous"]["output_tok_s"]
            row["ratios"] = {f"continuous/{m}": _ratio(cont, row["modes"][m]["output_tok_s"]) for m in modes[1:]}
            steps = step_bounds(chat_lengths(n, mix, opts.rounds, opts.scale), n)
            row["step_bound_ratios"] = {f"continuous/{m}": _ratio(steps[m], steps["continuous"]) for m in modes[1:]}
            rows.append(row)
    return rows


def _cache_modes(target: _Target, opts: BenchOptions) -> list[str]:
    return ["continuous"] + (["nocache"] if "nocache" in opts.compare and target.local else [])


async def bench_rag(target: _Target, opts: BenchOptions, nonce: str) -> dict[str, Any]:
    """Questions go one at a time, so each later TTFT is its own prefill, not a queue."""
    result: dict[str, Any] = {"modes": {}}
    for mode in _cache_modes(target, opts):
        system = "Answer the user's question from this document.\n\n" + document(
            target, opts.rag_tokens, f"{nonce}-{mode}")
        reqs = [BenchRequest([{"role": "system", "content": system},
                              {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                             _scaled(32, opts.scale)) for i in range(opts.questions)]
        _say(opts, f"rag: {mode} ({opts.rag_tokens:,}-token document, {len(reqs)} questions)")
        await target.reset_cache()
        async with target.caching(mode != "nocache"):
            m, results = await run_sequential(target, reqs, mode)
        first = results[0].ttft_s
        later = percentile([r.ttft_s for r in results[1:] if r.ttft_s is not None], 50)
        result["modes"][mode] = {
            **asdict(m), "system_prompt_tokens": target.count_tokens(system),
            "ttft_first_s": None if first is None else round(first, 4),
            "ttft_later_p50_s": None if later is None else round(later, 4),
            "ttft_later_over_first": _ratio(later, first),
        }
    return result


async def bench_multiturn(target: _Target, opts: BenchOptions, nonce: str) -> dict[str, Any]:
    result: dict[str, Any] = {"modes": {}}
    for mode in _cache_modes(target, opts):
        _say(opts, f"multiturn: {mode} ({opts.turns} turns)")
        await target.reset_cache()
        run = _Run(target, mode)
        reply_tokens = _scaled(64, opts.scale)

        async def work(run: _Run = run, mode: str = mode, reply_tokens: int = reply_tokens) -> None:
            messages: list[dict[str, str]] = []
            for turn in range(opts.turns):
                text = TURN_MESSAGES[turn % len(TURN_MESSAGES)]
                if turn == 0:
                    text = f"[{nonce}-{mode}] {text}"
                messages.append({"role": "user", "content": text})
                r = await _one(target, BenchRequest(list(messages), reply_tokens), run.rid())
                run.results.append(r)
                messages.append({"role": "assistant", "content": r.text})

        async with target.caching(mode != "nocache"):
            m = run.metrics(await run.measure(work))
        ttfts = [r.ttft_s for r in run.results]
        second = ttfts[1] if len(ttfts) > 1 else None
        result["modes"][mode] = {
            **asdict(m), "ttft_by_turn_s": [None if t is None else round(t, 4) for t in ttfts],
            "prompt_tokens_by_turn": [r.prompt_tokens for r in run.results],
            "cached_tokens_by_turn": [r.cached_tokens for r in run.results],
            "ttft_last_over_turn2": _ratio(ttfts[-1], second),
        }
    return result


# ---- constrained against free decoding ----

async def bench_guided(target: _Target, opts: BenchOptions, nonce: str) -> list[dict[str, Any]]:
    """Per batch size: the same chats free and constrained, alternated twice so that load
    drift hits both modes; the best run of each. The grammar is compiled (and its lexer
    warmed) by a short request first, as a server's cache would hold it."""
    tokens = _scaled(GUIDED_TOKENS, opts.scale)
    await _one(target, BenchRequest([{"role": "user", "content": f"[{nonce}] notes"}], 4, GUIDED_SCHEMA),
               f"bench-guided-warmup-{nonce}")
    rows = []
    for n in GUIDED_BATCHES:
        best: dict[str, RunMetrics] = {}
        for rnd in range(2):
            for mode, schema in (("free", None), ("guided", GUIDED_SCHEMA)):
                reqs = [BenchRequest([{"role": "user", "content": f"[{nonce}-{rnd}-{mode}-{i}] Take notes about "
                                                                  f"{TOPICS[i % len(TOPICS)]}, as JSON."}],
                                     tokens, schema) for i in range(n)]
                _say(opts, f"guided N={n}: {mode} ({n} requests x {tokens} tokens, run {rnd + 1} of 2)")
                await target.reset_cache()
                m, _ = await run_continuous(target, reqs, n)
                if mode not in best or m.output_tok_s > best[mode].output_tok_s:
                    best[mode] = m
        free, guided = best["free"], best["guided"]
        rows.append({
            "n": n, "tokens": tokens, "free": asdict(free), "guided": asdict(guided),
            "itl_guided_over_free": _ratio(guided.itl_p50_s, free.itl_p50_s),
            "throughput_guided_over_free": _ratio(guided.output_tok_s, free.output_tok_s),
        })
    return rows


# ---- batch-1 decode: the engine against a plain loop ----

PLAIN_RUNS = 4

def code_file(functions: int, nonce: str) -> str:
    """A Python module of ``functions`` small functions, different for each nonce."""
    rng = random.Random(nonce)
    parts = [f"# inventory tools, build {nonce}\nimport math\n"]
    for i in range(functions):
        a, b = rng.sample(_DOC_WORDS, 2)
        op = rng.choice(["+", "-", "*"])
        parts.append(f"\ndef {a}_{b}_{i}(items, factor={rng.randint(2, 9)}):\n"
                     f"    \"\"\"Returns the {a} total of the {b} items.\"\"\"\n"
                     f"    total = 0\n    for item in items:\n        total = total {op} item.{a} * factor\n"
                     f"    return math.floor(total) if total > {rng.randint(10, 99)} else total\n")
    return "".join(parts)


SPEC_TRIALS = 3
SPEC_STREAM_PAIRS = 8  # 16-chat bursts with speculation off and on, in pairs


async def bench_spec(target: _Target, opts: BenchOptions, nonce: str) -> dict[str, Any]:
    """Speculative decoding on against off, on one engine: the median single-stream decode
    speed (tokens after the first over the time after it) of ``SPEC_TRIALS`` trials each,
    alternating, per case; then 16 chats at once (where it should step aside). A remote
    server runs as it was started (one mode, "served"): start it with and without its own
    speculation to compare."""
    from localllm.engine.spec_decode import SpeculativeConfig

    config = (target.llm.speculative if target.llm is not None else None) or SpeculativeConfig()
    modes = ("off", "on") if target.local else ("served",)
    code = code_file(8, nonce)
    doc = document(target, 600, nonce)
    cases = {
        # the default 135M model explains a file it is asked to edit; asked to repeat it, it copies
        "code_copy": BenchRequest([{"role": "user", "content": f"Repeat this file exactly.\n\n```python\n{code}```"}],
                                  _scaled(320, opts.scale)),
        "rag_quote": BenchRequest([{"role": "system", "content": f"Answer from this document.\n\n{doc}"},
                                   {"role": "user", "content": "Quote the document's first paragraph word for word."}],
                                  _scaled(200, opts.scale)),
        "prose": BenchRequest([{"role": "user", "content": f"[{nonce}] Write a short story about a lighthouse keeper."}],
                              _scaled(200, opts.scale), temperature=0.7),
    }
    result: dict[str, Any] = {"config": asdict(config) if target.local else None, "modes": list(modes), "cases": {}}
    for name, req in cases.items():
        speeds: dict[str, list[float]] = {m: [] for m in modes}
        drafted = accepted = 0
        for trial in range(SPEC_TRIALS):
            for mode in (modes if trial % 2 == 0 else modes[::-1]):
                _say(opts, f"spec {name}: trial {trial + 1}/{SPEC_TRIALS}, speculation {mode}")
                await target.reset_cache()
                before = target.engine.stats()
                async with target.speculating(config if mode == "on" else None):
                    r = await _one(target, req, f"bench-spec-{name}-{mode}-{trial}-{nonce}")
                after = target.engine.stats()
                drafted += after.spec_num_draft_tokens - before.spec_num_draft_tokens
                accepted += after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
                decode_s = r.latency_s - (r.ttft_s or 0.0)
                speeds[mode].append((r.output_tokens - 1) / decode_s if decode_s > 0 else 0.0)
        median = {m: percentile(v, 50) for m, v in speeds.items()}
        result["cases"][name] = {
            **{f"decode_tok_s_{m}": round(v or 0.0, 2) for m, v in median.items()},
            "on_over_off": _ratio(median.get("on"), median.get("off")),
            "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
            "draft_tokens": drafted, "tokens": req.max_tokens,
        }
    # many chats: compute-bound steps, where speculation must step aside. Paired bursts in the
    # one engine, the same requests, the order alternating: two servers' 16-stream rates moved
    # 3-10% between bursts (how the requests join: one mixed step or two), more than any
    # difference speculation makes where it steps aside, so the measure is the median of the
    # per-pair ratios, and the tokens proposed while on show whether it stepped aside at all.
    # One wave of 16 long replies (greedy, the same tokens in both modes): 32 short ones through
    # 16 slots joined in two waves, and how each wave joined moved a burst by up to 5%
    streams = [BenchRequest([{"role": "user", "content": f"[{nonce}-{i}] Tell me about {QUESTIONS[i % len(QUESTIONS)]}"}],
                            _scaled(256, opts.scale)) for i in range(16)]
    rates: dict[str, list[float]] = {m: [] for m in modes}
    pairs: list[float] = []
    bursts: list[float] = []  # in the order run: off on on off off on ...
    drafted = 0
    for pair in range(SPEC_STREAM_PAIRS if target.local else 1):
        got: dict[str, float] = {}
        for mode in (modes if pair % 2 == 0 else modes[::-1]):
            _say(opts, f"spec: 16 chats, pair {pair + 1}, speculation {mode}")
            await target.reset_cache()
            before = target.engine.stats()
            async with target.speculating(config if mode == "on" else None):
                m, _ = await run_continuous(target, streams, 16)
            drafted += target.engine.stats().spec_num_draft_tokens - before.spec_num_draft_tokens
            got[mode] = m.output_tok_s
            rates[mode].append(m.output_tok_s)
            bursts.append(m.output_tok_s)
        if "on" in got and "off" in got and got["off"] > 0:
            pairs.append(got["on"] / got["off"])
    result["chats16"] = {**{f"tok_s_{m}": round(percentile(v, 50) or 0.0, 2) for m, v in rates.items()},
                         "on_over_off": round(percentile(pairs, 50), 4) if pairs else None,
                         "pair_ratios": [round(x, 4) for x in pairs], "draft_tokens": drafted,
                         # the same mode's adjacent bursts (a pair's last, the next pair's first):
                         # how far two bursts of one setting move apart on this machine
                         "same_mode_ratios": [round(bursts[i] / bursts[i + 1], 4) for i in range(1, len(bursts) - 1, 2)]}
    return result


def plain_greedy(llm: LLMEngine, prompt_ids: list[int], n_tokens: int) -> tuple[list[int], float]:
    """Greedy decode straight on the model runner's model (compiled where the engine's is) and
    KV pool: one sequence, argmax; no scheduler, sampler or detokenizer. Returns the tokens and
    the decode rate (tokens after the first, per second). Runs on the engine's thread
    (``AsyncEngine.call``) while it is idle: the blocks are the engine's ``borrowed_blocks``,
    the metadata the KV cache's own (engine/kv_cache.py)."""
    import torch

    from localllm.engine.kv_cache import slot_mapping, varlen_metadata
    from localllm.engine.sampler import argmax_rows
    from localllm.models.llama import AttentionMetadata

    runner = llm.runner
    model = runner.model
    dev = runner.device
    bs = runner.block_size
    total = len(prompt_ids) + n_tokens
    with llm.borrowed_blocks(prompt_ids, total) as seq, torch.inference_mode():
        # the table as wide as the runner's static one, so a compiled decode sees the shapes it
        # was compiled for (another width would make Dynamo compile a graph for this loop)
        row = seq.block_table + [0] * (runner.max_blocks_per_seq - len(seq.block_table))
        p = len(prompt_ids)
        pos, meta = varlen_metadata([0], [p], [row], bs, 0, dev)
        hidden = model(torch.tensor(prompt_ids, dtype=torch.int64, device=dev), pos, meta)
        token = int(model.compute_logits(hidden[-1:]).argmax(-1))
        tokens = [token]
        table = meta.block_tables
        pos = torch.arange(total, dtype=torch.int64, device=dev)
        slots = slot_mapping(table, torch.zeros_like(pos), pos, bs)  # every position's, made once
        qsl = torch.tensor([0, 1], dtype=torch.int32, device=dev)
        t0 = time.monotonic()
        for i in range(p, total - 1):
            meta = AttentionMetadata(slots[i : i + 1], qsl, torch.tensor([i + 1], dtype=torch.int32, device=dev),
                                     table, 1)
            logits = runner.decode_logits(torch.tensor([token], dtype=torch.int64, device=dev), pos[i : i + 1], meta)
            token = int(argmax_rows(logits)[0])  # the engine's greedy pick; int() syncs, as it does
            tokens.append(token)
        elapsed = time.monotonic() - t0
    return tokens, (len(tokens) - 1) / elapsed if elapsed > 0 else 0.0


async def bench_plain(target: _Target, opts: BenchOptions) -> dict[str, Any]:
    """Alternates plain and engine runs (four each) so load drifts hit both; best of each (a
    shared machine's neighbours move a 2 s run by 20%)."""
    from localllm.engine.async_engine import AsyncEngine
    from localllm.engine.sequence import SamplingParams

    assert target.llm is not None and isinstance(target.engine, AsyncEngine)
    llm, engine = target.llm, target.engine
    prompt = llm.tokenizer.encode_chat([{"role": "user", "content": "Tell me about the history of bread."}])
    n = max(opts.plain_tokens, 2)
    _say(opts, f"batch-1 decode: engine against the plain loop ({n} tokens, {PLAIN_RUNS} runs each)")
    plain_rates, engine_rates = [], []
    plain_tokens: list[int] = []
    engine_tokens: list[int] = []
    for _ in range(PLAIN_RUNS):
        await target.reset_cache()
        # on the engine thread, as the engine's own steps: one OpenMP team for both
        plain_tokens, rate = await engine.call(lambda e: plain_greedy(e, prompt, n))
        plain_rates.append(rate)
        await target.reset_cache()
        final = None
        async for out in target.engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=n,
                                                                       ignore_eos=True)):
            final = out
        assert final is not None
        engine_tokens = final.outputs[0].token_ids
        itls = final.metrics.inter_token_latencies
        engine_rates.append(len(itls) / sum(itls) if itls and sum(itls) > 0 else 0.0)
    plain, engine = max(plain_rates), max(engine_rates)
    return {
        "tokens": n, "prompt_tokens": len(prompt),
        "plain_tok_s": round(plain, 2), "engine_tok_s": round(engine, 2),
        "plain_runs_tok_s": [round(r, 2) for r in plain_rates], "engine_runs_tok_s": [round(r, 2) for r in engine_rates],
        "plain_over_engine": _ratio(plain, engine),
        "same_tokens": plain_tokens == engine_tokens,
    }


# ---- the whole benchmark ----

async def run_bench(engine: AsyncEngine | RemoteEngine, opts: BenchOptions) -> dict[str, Any]:
    """Runs the chosen workloads on ``engine`` (an ``AsyncEngine`` or a ``RemoteEngine``),
    which must be idle, and returns the report that ``--json`` prints."""
    target = _Target(engine)
    stats = engine.stats()
    nonce = f"{random.getrandbits(24):06x}"
    report: dict[str, Any] = {
        "model": stats.model, "device": stats.device, "precision": stats.precision,
        "endpoint": target.endpoint,
        "kv_blocks_total": stats.kv_blocks_total or None,
        "options": {k: v for k, v in asdict(opts).items() if k != "progress"},
    }
    # one short request first: lazy initialisation must not land in the first measured run
    await _one(target, BenchRequest([{"role": "user", "content": f"[{nonce}] hi"}], 4), f"bench-warmup-{nonce}")
    started = time.monotonic()
    if target.local and opts.plain_tokens:
        report["batch1_decode"] = await bench_plain(target, opts)
    if "chats" in opts.workloads:
        report["chats"] = await bench_chats(target, opts, nonce)
    if "rag" in opts.workloads:
        report["rag"] = await bench_rag(target, opts, nonce)
    if "multiturn" in opts.workloads:
        report["multiturn"] = await bench_multiturn(target, opts, nonce)
    if "guided" in opts.workloads:
        report["guided"] = await bench_guided(target, opts, nonce)
    if "spec" in opts.workloads:
        report["spec"] = await bench_spec(target, opts, nonce)
    report["bench_wall_s"] = round(time.monotonic() - started, 2)
    return report


# ---- text report ----

def _fmt(x: float | None, unit: str = "", nd: int = 2, scale: float = 1.0) -> str:
    return "-" if x is None else f"{x * scale:.{nd}f}{unit}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _mode_line(name: str, m: dict[str, Any]) -> str:
    return (f"  {name:<11} {m['output_tok_s']:>8.1f}  {_fmt(m['ttft_p50_s'], nd=3):>7} {_fmt(m['ttft_p99_s'], nd=3):>7}"
            f"  {_fmt(m['itl_p50_s'], nd=1, scale=1e3):>6} {_fmt(m['itl_p99_s'], nd=1, scale=1e3):>6}"
            f"  {_pct(m['peak_kv_usage']):>7}  {_pct(m['prefix_hit_rate']):>6}  {m['wall_s']:>7.1f}")


_HEADER = (f"  {'mode':<11} {'tok/s':>8}  {'TTFT p50':>7} {'p99':>7}  {'ITL ms':>6} {'p99':>6}"
           f"  {'peak KV':>7}  {'prefix':>6}  {'wall s':>7}")


def format_report(r: dict[str, Any]) -> str:
    lines = [f"localllm bench: {r['model']} on {r['endpoint'] or r['device']} ({r['precision']})"]
    b1 = r.get("batch1_decode")
    if b1:
        lines.append(f"batch-1 decode: engine {b1['engine_tok_s']:.1f} tok/s, plain loop {b1['plain_tok_s']:.1f} tok/s "
                     f"-> plain/engine {b1['plain_over_engine']}x (target <= 1.1); same tokens: {b1['same_tokens']}")
    for row in r.get("chats", []):
        lengths = row["output_lengths"]
        title = f"chats N={row['n']} {row['mix']}: {row['requests']} requests, output lengths {lengths[0]}..{lengths[-1]}"
        lines += ["", title, _HEADER]
        lines += [_mode_line(name, m) for name, m in row["modes"].items()]
        if row["ratios"]:
            lines.append("  continuous = " + ", ".join(f"{v}x {k.split('/')[1]}" for k, v in row["ratios"].items())
                         + "  (bound at equal step cost: " + ", ".join(
                             f"{v}x {k.split('/')[1]}" for k, v in row["step_bound_ratios"].items()) + ")")
    rag = r.get("rag")
    if rag:
        lines += ["", "rag: shared system prompt, then questions one at a time", _HEADER]
        for name, m in rag["modes"].items():
            lines.append(_mode_line(name, m))
            lines.append(f"    TTFT first {_fmt(m['ttft_first_s'], 's', 3)}, later p50 {_fmt(m['ttft_later_p50_s'], 's', 3)}"
                         f" -> later/first {m['ttft_later_over_first']} (target <= 0.1)")
    mt = r.get("multiturn")
    if mt:
        lines += ["", "multiturn: one chat, turn after turn", _HEADER]
        for name, m in mt["modes"].items():
            lines.append(_mode_line(name, m))
            lines.append("    TTFT by turn (s): " + " ".join(_fmt(t, nd=3) for t in m["ttft_by_turn_s"])
                         + f" -> last/turn 2 {m['ttft_last_over_turn2']} (target <= 1.5)")
    for row in r.get("guided", []):
        f, g = row["free"], row["guided"]
        lines += ["", f"guided N={row['n']}: JSON-schema decoding against free, {row['tokens']} tokens each", _HEADER,
                  _mode_line("free", f), _mode_line("guided", g),
                  f"    step (ITL p50) guided/free {row['itl_guided_over_free']}x, throughput guided/free "
                  f"{row['throughput_guided_over_free']}x (target >= 0.9)"]
    spec = r.get("spec")
    if spec:
        cfg = spec["config"]
        how = f"{cfg['method']}, k <= {cfg['num_speculative_tokens']}" if cfg else "as the server was started"
        if cfg and cfg.get("model"):
            how += f", draft {cfg['model']}"
        modes = spec["modes"]
        lines += ["", f"spec: speculative decoding ({how}), single-stream decode tok/s, median of {SPEC_TRIALS} trials",
                  f"  {'case':<11} " + " ".join(f"{m + ' tok/s':>12}" for m in modes) + f" {'on/off':>7} {'accepted':>9}"]
        for name, c in spec["cases"].items():
            lines.append(f"  {name:<11} " + " ".join(f"{c['decode_tok_s_' + m]:>12.1f}" for m in modes)
                         + f" {_fmt(c['on_over_off']):>7} {_pct(c['acceptance_rate']):>9}")
        c16 = spec["chats16"]
        pairs = c16.get("pair_ratios") or []
        lines.append("  16 chats    " + " ".join(f"{c16['tok_s_' + m]:>12.1f}" for m in modes)
                     + f" {_fmt(c16['on_over_off']):>7}  (aggregate tok/s, medians"
                     + (f"; on/off the median of {len(pairs)} paired bursts: {', '.join(f'{x:.3f}' for x in pairs)};"
                        f" {c16.get('draft_tokens', 0)} tokens proposed while on; two bursts of one mode moved"
                        f" {', '.join(f'{x:.3f}' for x in c16.get('same_mode_ratios', []))})" if pairs else ")"))
    lines.append(f"\n(bench wall time {r['bench_wall_s']:.0f} s; TTFT in s; peak KV = share of the pool held)")
    return "\n".join(lines)


# ---- CLI ----

def _csv(kind: Callable[[str], Any], allowed: tuple[str, ...] | None = None) -> Callable[[str], tuple[Any, ...]]:
    def parse(text: str) -> tuple[Any, ...]:
        items = tuple(kind(x.strip()) for x in text.split(",") if x.strip())
        if allowed is not None:
            bad = [x for x in items if x not in allowed]
            if bad:
                raise argparse.ArgumentTypeError(f"unknown {', '.join(bad)} (choose from {', '.join(allowed)})")
        return items

    return parse


def _positive_ints(text: str) -> tuple[int, ...]:
    items = _csv(positive_int)(text)
    if not items:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated whole numbers like 1,4,16")
    return items


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from localllm.cli_common import add_engine_args, add_model_arg

    p = sub.add_parser(
        "bench", help="throughput and latency: concurrent chats, shared-prefix RAG, multi-turn",
        description="Benchmarks the local engine, or any OpenAI-compatible server with --endpoint.",
        # peers.py lives in the source tree, not the wheel: it builds llama.cpp with cmake
        epilog="Against llama.cpp on the same GGUF, in one run with ratios: python bench/peers.py "
               "(in a source checkout; --help there).",
    )
    add_model_arg(p)
    p.add_argument("--endpoint", default=None, help="benchmark this OpenAI-compatible server instead")
    p.add_argument("--api-key", default=None, help="bearer token for --endpoint")
    p.add_argument("--workload", type=_csv(str, WORKLOADS + EXTRA_WORKLOADS), default=WORKLOADS,
                   help="default chats,rag,multiturn; guided (constrained against free decoding) and spec (speculative"
                        " decoding on against off) when named")
    p.add_argument("--chats", type=_positive_ints, default=(1, 4, 16, 64), help="concurrent chats N (default 1,4,16,64)")
    p.add_argument("--mix", type=_csv(str, MIXES), default=MIXES, help="chat output-length mixes (default mixed,straggler)")
    p.add_argument("--compare", type=_csv(str, COMPARE_MODES), default=(),
                   help="also run static batching, one-at-a-time, and/or prefix cache off: static,sequential,nocache")
    p.add_argument("--rounds", type=int, default=16, help="chat requests per concurrent chat (default 16)")
    p.add_argument("--scale", "--max-tokens-scale", dest="scale", type=float, default=1.0,
                   help="multiply every output length (default 1: the 2,000/50-token straggler mix)")
    p.add_argument("--rag-tokens", type=int, default=3000, help="shared system prompt length (default 3000)")
    p.add_argument("--questions", type=int, default=8, help="rag questions (default 8)")
    p.add_argument("--turns", type=int, default=10, help="multiturn turns (default 10)")
    p.add_argument("--plain-tokens", type=int, default=64, help="batch-1 decode tokens against the plain loop (0 skips)")
    p.add_argument("--json", action="store_true", help="print the full report as JSON")
    add_engine_args(p)
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks (default: the plan's)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from localllm.errors import LocalLLMError

    for name in ("rounds", "turns", "questions", "rag_tokens"):
        if getattr(args, name) < 1:
            raise LocalLLMError(f"--{name.replace('_', '-')} must be at least 1")
    if args.turns < 2 and "multiturn" in args.workload:
        raise LocalLLMError("--turns must be at least 2 (turn 2 is the reference)")
    if not args.scale > 0:
        raise LocalLLMError("--scale must be > 0")
    opts = BenchOptions(
        workloads=args.workload, chats=args.chats, mixes=args.mix, compare=args.compare, rounds=args.rounds,
        scale=args.scale, rag_tokens=args.rag_tokens, questions=args.questions, turns=args.turns,
        plain_tokens=max(args.plain_tokens, 0),
        progress=lambda msg: print(f"bench: {msg}", file=sys.stderr, flush=True),
    )
    if args.endpoint:
        from localllm.server.remote import RemoteEngine

        engine: AsyncEngine | RemoteEngine = RemoteEngine(args.endpoint, api_key=args.api_key, model=args.model)
    else:
        from localllm.cli_common import engine_config_from_args, progress_printer
        from localllm.engine.async_engine import AsyncEngine
        from localllm.engine.engine import LLMEngine

        # a benchmark measures the steady state: the compiled decode step is ready before it starts
        config = engine_config_from_args(args, num_kv_blocks=args.num_kv_blocks, max_num_seqs=max(max(args.chats), 1),
                                         compile_in_background=False)
        engine = AsyncEngine(lambda: LLMEngine(config, progress=progress_printer()))  # built on its own thread

    async def go() -> dict[str, Any]:
        try:
            return await run_bench(engine, opts)
        finally:
            await engine.aclose()

    try:
        report = asyncio.run(go())
    finally:
        engine.shutdown()
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0
