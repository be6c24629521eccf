#!/usr/bin/env python
"""A soak of ``localllm serve`` that tells warm-up from leaks (issue 33, item 5).

    python bench/soak.py                        # 48 clients for 600 s, then the checks
    python bench/soak.py --quick                # 8 clients for 30 s (tests/bench/test_soak.py: 10 s, 3+ requests each)
    python bench/soak.py --clients 16 --duration 120 --json soak.json
    python bench/soak.py --duration 0 --prefill-probe        # only the long-prefill probe

One run, in order:

1. starts ``localllm serve --deterministic --port P`` on 127.0.0.1 (never another address) as
   a subprocess, on the default model unless ``--model`` names another;
2. sends each prompt of a fixed set alone (temperature 0, ``--max-tokens``) and keeps the
   replies: the solo replies;
3. runs ``--clients`` clients for ``--duration`` seconds with the official ``openai`` client
   (async, streaming and non-streaming mixed). Each client loops until the deadline, one
   request at a time: mostly greedy requests whose text must equal the solo reply, a few
   sampled ones, some that hang up mid-stream or before a non-streamed answer, and some
   bad bodies (malformed JSON, wrong types, missing fields: a 400/422, never a 5xx). No
   retries: every status the server sends is counted;
4. samples the server's RSS (psutil, its pid and any children), open fds, threads and KV use
   every ``--rss-interval`` seconds, and fits a line to the RSS samples after warm-up (20% of
   the run, and at least the first 60 s in a run of 5 minutes or more): MB/min;
5. once the last client is done, waits for the server to be idle and reads
   ``localllm:kv_blocks_used`` from ``/metrics`` (must be 0);
6. with ``--prefill-probe``: one stream decodes while another request sends a prompt of
   ``--prefill-tokens`` token ids (cold: no prefix hit); the stream's inter-token gaps before
   and during that prefill (median and longest). Measured only; nothing is asserted on it.

It prints a summary and, with ``--json``, writes every figure. The exit code is 1 when a check
fails (a 5xx, a KV block left in use, a greedy reply that differs from solo), 2 when the
server could not start. The load is bounded (the clients stop at the deadline) and goes to
127.0.0.1 only. A benchmark, never a timed test.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/peers.py: the server harness

from peers import PeerError, Server, free_port, localllm_cmd  # noqa: E402  (sets the OpenMP defaults)
from cpu_kernels import cpu_name  # noqa: E402

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402
from datetime import datetime, timezone  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402

import httpx  # noqa: E402

from localllm.bench import TOPICS  # noqa: E402

if TYPE_CHECKING:
    from openai import AsyncOpenAI

SYSTEM = "You are a helpful assistant. Answer briefly."  # shared by every prompt: prefix-cache hits
PROMPT_FORMS = ["Write two lines about {}.", "Describe {} in one sentence.", "Give three words for {}."]
# Bodies a careless or hostile client sends: each must be a 400 or a 422, never a 5xx.
BAD_BODIES: list[tuple[str, bytes]] = [
    ("malformed", b'{"messages": [{"role": "user", "content": "hi"}'),
    ("malformed", b"not json at all"),
    ("malformed", b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}'),
    ("wrong_type", b'{"messages": "hi", "max_tokens": 2}'),
    ("wrong_type", b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "two"}'),
    ("wrong_type", b'{"messages": [{"role": "user", "content": "hi"}], "temperature": [0]}'),
    ("wrong_type", b'{"messages": [{"role": "user", "content": "hi"}], "top_p": NaN}'),
    ("wrong_type", b'[1, 2, 3]'),
    ("missing", b'{"max_tokens": 4}'),
    ("missing", b'{"messages": [{"role": "user"}], "max_tokens": 2}'),
    ("missing", b"{}"),
]
QUICK = {"clients": 8, "duration": 30.0, "prompts": 4, "max_tokens": 16, "rss_interval": 5.0}
FULL = {"clients": 48, "duration": 600.0, "prompts": 12, "max_tokens": 32, "rss_interval": 10.0}


def prompts(n: int) -> list[str]:
    """The fixed prompt set: its first ``n`` entries (the same in every run)."""
    return [PROMPT_FORMS[i % len(PROMPT_FORMS)].format(TOPICS[i % len(TOPICS)]) for i in range(n)]


def messages(prompt: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]


@dataclass(slots=True)
class Tally:
    """What the clients saw. One writer: the event loop (clients never await mid-update)."""

    requests: int = 0
    greedy_ok: int = 0
    greedy_differ: int = 0
    sampled_ok: int = 0
    dropped: int = 0
    bad_sent: int = 0
    statuses: Counter[str] = field(default_factory=Counter)  # every non-2xx, and transport errors
    differ_examples: list[dict[str, str]] = field(default_factory=list)

    def error(self, what: str) -> None:
        self.statuses[what] += 1


@dataclass(slots=True)
class Sample:
    t_s: float  # since the load started
    rss_mb: float
    fds: int
    threads: int
    kv_blocks_used: int | None


def server_memory(pid: int) -> tuple[float, int, int]:
    """RSS in MB (the server and any children, e.g. a kernel build), open fds and threads."""
    import psutil

    proc = psutil.Process(pid)
    procs = [proc, *proc.children(recursive=True)]
    rss = 0
    for p in procs:
        try:
            rss += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return rss / 1e6, proc.num_fds(), proc.num_threads()


async def metrics(http: httpx.AsyncClient, base: str) -> dict[str, float]:
    """``/metrics`` as {name without the ``localllm:`` prefix: value}."""
    text = (await http.get(f"{base}/metrics")).text
    out = {}
    for line in text.splitlines():
        if line.startswith("localllm:"):
            name, _, value = line.partition(" ")
            out[name.split("{")[0].removeprefix("localllm:")] = float(value)
    return out


def slope_mb_per_min(samples: list[Sample], after_s: float) -> float | None:
    """Least-squares slope of RSS against time over the samples at or after ``after_s``."""
    pts = [(s.t_s / 60, s.rss_mb) for s in samples if s.t_s >= after_s]
    if len(pts) < 3:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx else None


def warmup_s(duration: float) -> float:
    """20% of the run, and at least a minute in a run of 5 minutes or more."""
    return max(0.2 * duration, 60.0) if duration >= 300 else 0.2 * duration


async def greedy(client: AsyncOpenAI, prompt: str, max_tokens: int, stream: bool) -> str:
    if not stream:
        r = await client.chat.completions.create(model="any", messages=messages(prompt), max_tokens=max_tokens,
                                                 temperature=0)
        return r.choices[0].message.content or ""
    parts = []
    s = await client.chat.completions.create(model="any", messages=messages(prompt), max_tokens=max_tokens,
                                             temperature=0, stream=True)
    async for chunk in s:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
    return "".join(parts)


async def soak_client(i: int, base: str, plist: list[str], solo: dict[str, str], max_tokens: int, until: float,
                      tally: Tally, min_requests: int = 0) -> None:
    """One client: requests one after another until ``until`` (loop time), and at least
    ``min_requests`` of them however long they take; never retries."""
    import openai

    rng = random.Random(1000 + i)
    loop = asyncio.get_running_loop()
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
    async with httpx.AsyncClient(base_url=base, timeout=300) as http:
        sent = 0
        while loop.time() < until or sent < min_requests:
            sent += 1
            action = rng.random()
            prompt = rng.choice(plist)
            tally.requests += 1
            try:
                if action < 0.12:  # a bad body: a 4xx, and it must not disturb anyone
                    path = rng.choice(["/v1/chat/completions", "/v1/completions"])
                    _, body = rng.choice(BAD_BODIES)
                    r = await http.post(path, content=body, headers={"content-type": "application/json"})
                    tally.bad_sent += 1
                    if r.status_code not in (400, 422):
                        tally.error(f"bad body -> {r.status_code}")
                    else:
                        tally.error(str(r.status_code))
                elif action < 0.24:  # a client that goes away mid-request
                    if rng.random() < 0.6:
                        s = await client.chat.completions.create(
                            model="any", messages=messages(prompt), max_tokens=max_tokens, temperature=0,
                            stream=True)
                        keep = rng.randint(1, 3)
                        async for _ in s:
                            keep -= 1
                            if keep <= 0:
                                break
                        await s.close()
                    else:
                        try:
                            await http.post("/v1/chat/completions", timeout=rng.uniform(0.05, 0.5), json={
                                "model": "any", "messages": messages(prompt), "max_tokens": max_tokens,
                                "temperature": 0})
                        except httpx.TimeoutException:
                            pass
                    tally.dropped += 1
                elif action < 0.32:  # sampled: must complete; its text is not compared
                    r = await client.chat.completions.create(
                        model="any", messages=messages(prompt), max_tokens=max_tokens, temperature=0.8,
                        seed=rng.randrange(1 << 30), stream=rng.random() < 0.5)
                    if hasattr(r, "__aiter__"):
                        async for _ in r:
                            pass
                    tally.sampled_ok += 1
                else:  # greedy: must equal its solo reply
                    text = await greedy(client, prompt, max_tokens, rng.random() < 0.5)
                    tally.greedy_ok += 1
                    if text != solo[prompt]:
                        tally.greedy_differ += 1
                        if len(tally.differ_examples) < 5:
                            tally.differ_examples.append({"prompt": prompt, "solo": solo[prompt], "batch": text})
            except openai.APIStatusError as e:
                tally.error(str(e.status_code))
            except (openai.APIConnectionError, httpx.TransportError) as e:
                tally.error(f"transport: {type(e).__name__}")
    await client.close()


async def sampler(pid: int, base: str, t0: float, interval: float, out: list[Sample], stop: asyncio.Event) -> None:
    async with httpx.AsyncClient(timeout=30) as http:
        while True:
            rss, fds, threads = server_memory(pid)
            try:
                kv = int((await metrics(http, base))["kv_blocks_used"])
            except (httpx.TransportError, KeyError):
                kv = None
            out.append(Sample(round(time.monotonic() - t0, 1), round(rss, 1), fds, threads, kv))
            try:
                await asyncio.wait_for(stop.wait(), interval)
                return
            except asyncio.TimeoutError:
                pass


async def wait_idle(base: str, timeout_s: float) -> dict[str, float]:
    """``/metrics`` once no request runs or waits (or after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=30) as http:
        while True:
            m = await metrics(http, base)
            idle = m["num_requests_running"] == 0 and m["num_requests_waiting"] == 0 and m["kv_blocks_used"] == 0
            if idle or time.monotonic() > deadline:
                return m
            await asyncio.sleep(0.5)


async def prefill_probe(base: str, prompt_tokens: int, baseline_s: float) -> dict[str, object]:
    """One stream's inter-token gaps before and during another request's cold prefill of
    ``prompt_tokens`` token ids. Gaps are counted "during" when they end after the long request
    was sent and start before its first token came back."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=3600)
    async with httpx.AsyncClient(timeout=30) as http:
        limit = int((await http.get(f"{base}/v1/models")).json()["data"][0]["max_model_len"])
    if not 0 < prompt_tokens < limit - 64:
        raise PeerError(f"--prefill-tokens {prompt_tokens} does not fit the model's context of {limit} tokens "
                        f"beside a stream: give 1 to {limit - 65}")
    rng = random.Random(33)
    long_ids = [rng.randrange(1000, 40000) for _ in range(prompt_tokens)]  # random ids: no prefix hit
    stamps: list[float] = []
    stream_done = asyncio.Event()

    async def stream() -> None:
        s = await client.completions.create(model="any", prompt="Once upon a time", max_tokens=limit - 64,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True})
        async for chunk in s:
            if chunk.choices and chunk.choices[0].text:
                stamps.append(time.monotonic())
            if stream_done.is_set():
                break
        await s.close()

    task = asyncio.create_task(stream())
    while len(stamps) < 2:
        await asyncio.sleep(0.05)
    await asyncio.sleep(baseline_s)
    sent = time.monotonic()
    first: float | None = None
    s = await client.completions.create(model="any", prompt=long_ids, max_tokens=1, temperature=0, stream=True)
    async for chunk in s:
        if first is None and chunk.choices and chunk.choices[0].text is not None:
            first = time.monotonic()
    done = time.monotonic()
    first = first or done
    await asyncio.sleep(1.0)
    stream_done.set()
    await task
    await client.close()
    gaps = [(a, b) for a, b in zip(stamps, stamps[1:], strict=False)]
    before = [b - a for a, b in gaps if b <= sent]
    during = [b - a for a, b in gaps if b > sent and a < first]
    return {
        "prompt_tokens": prompt_tokens, "prefill_s": round(first - sent, 2),
        "stream_tokens_before": len(before) + 1, "stream_tokens_during": len(during),
        "gap_before_median_s": round(statistics.median(before), 4) if before else None,
        "gap_during_median_s": round(statistics.median(during), 4) if during else None,
        "gap_during_max_s": round(max(during), 4) if during else None,
        "max_over_median_before": round(max(during) / statistics.median(before), 1) if during and before else None,
        "stream_outlived_prefill": bool(stamps) and stamps[-1] >= first,
    }


async def run(opts: argparse.Namespace) -> dict[str, object]:
    port = free_port()
    argv = [*localllm_cmd(), "serve", *(["--deterministic"] if opts.deterministic else []),
            "--host", "127.0.0.1", "--port", str(port)]
    if opts.model:
        argv += ["--model", opts.model]
    say = print if not opts.quiet else (lambda *a, **k: None)
    report: dict[str, object] = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "cpu": cpu_name(),
        "cores": os.cpu_count(), "load_avg_at_start": os.getloadavg()[0], "command": " ".join(sys.argv),
        "server": " ".join(argv), "clients": opts.clients, "duration_s": opts.duration,
        "prompts": opts.prompts, "max_tokens": opts.max_tokens,
    }
    say(f"soak: starting {' '.join(argv)}")
    t_start = time.monotonic()
    async with Server("localllm", argv, port, dict(os.environ), opts.ready_timeout) as server:
        assert server.proc is not None
        pid, base = server.proc.pid, server.base
        report["ready_s"] = round(time.monotonic() - t_start, 1)
        report["rss_mb_ready"] = round(server_memory(pid)[0], 1)
        if opts.duration > 0:
            plist = prompts(opts.prompts)
            import openai

            client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=600)
            t = time.monotonic()
            solo = {p: await greedy(client, p, opts.max_tokens, False) for p in plist}
            await client.close()
            report["solo_s"] = round(time.monotonic() - t, 1)
            say(f"soak: {len(solo)} solo replies in {report['solo_s']} s; {opts.clients} clients for "
                f"{opts.duration:.0f} s")
            tally, samples, stop = Tally(), [], asyncio.Event()
            loop = asyncio.get_running_loop()
            t0 = time.monotonic()
            sampling = asyncio.create_task(sampler(pid, base, t0, opts.rss_interval, samples, stop))
            until = loop.time() + opts.duration
            await asyncio.gather(*(soak_client(i, base, plist, solo, opts.max_tokens, until, tally,
                                               opts.min_requests) for i in range(opts.clients)))
            load_s = time.monotonic() - t0
            stop.set()
            await sampling
            m = await wait_idle(base, 60)
            rss, fds, threads = server_memory(pid)
            samples.append(Sample(round(time.monotonic() - t0, 1), round(rss, 1), fds, threads,
                                  int(m["kv_blocks_used"])))
            warm = warmup_s(opts.duration)
            fives = sum(n for s, n in tally.statuses.items() if s.split()[-1].startswith("5"))
            report.update({
                "load_s": round(load_s, 1),
                "requests_done": tally.requests, "greedy_ok": tally.greedy_ok, "sampled_ok": tally.sampled_ok,
                "disconnects": tally.dropped, "bad_bodies": tally.bad_sent,
                "errors_by_status": dict(tally.statuses), "status_5xx": fives,
                "greedy_differ_from_solo": tally.greedy_differ, "differ_examples": tally.differ_examples,
                "kv_blocks_used_end": int(m["kv_blocks_used"]), "kv_blocks_total": int(m["kv_blocks_total"]),
                "requests_running_end": int(m["num_requests_running"]),
                "warmup_s": warm,
                "rss_slope_mb_per_min_after_warmup": _r(slope_mb_per_min(samples[:-1], warm)),
                "rss_slope_mb_per_min_second_half": _r(slope_mb_per_min(samples[:-1], opts.duration / 2)),
                "rss_mb_first": samples[0].rss_mb, "rss_mb_at_warmup": _at(samples, warm),
                "rss_mb_peak": max(s.rss_mb for s in samples), "rss_mb_end_idle": samples[-1].rss_mb,
                "rss_samples": [asdict(s) for s in samples],
            })
        if opts.prefill_probe:
            say(f"soak: prefill probe, {opts.prefill_tokens} prompt tokens beside one stream")
            report["prefill_probe"] = await prefill_probe(base, opts.prefill_tokens, opts.probe_baseline)
            await wait_idle(base, 60)
    return report


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def _at(samples: list[Sample], t: float) -> float | None:
    later = [s.rss_mb for s in samples if s.t_s >= t]
    return later[0] if later else None


def summary(r: dict[str, object]) -> list[str]:
    lines = [f"soak: {r['cpu']}, {r['cores']} cores, {r['date']}; server ready in {r['ready_s']} s, "
             f"RSS {r['rss_mb_ready']} MB"]
    if "requests_done" in r:
        lines += [
            f"requests {r['requests_done']} in {r['load_s']} s ({r['clients']} clients): greedy {r['greedy_ok']}, "
            f"sampled {r['sampled_ok']}, disconnects {r['disconnects']}, bad bodies {r['bad_bodies']}",
            f"errors by status {r['errors_by_status']}; 5xx: {r['status_5xx']}",
            f"greedy replies that differ from solo: {r['greedy_differ_from_solo']}",
            f"KV blocks in use at the end: {r['kv_blocks_used_end']} of {r['kv_blocks_total']}",
            f"RSS MB: first {r['rss_mb_first']}, at warm-up ({r['warmup_s']:.0f} s) {r['rss_mb_at_warmup']}, "
            f"peak {r['rss_mb_peak']}, idle at the end {r['rss_mb_end_idle']}",
            f"RSS slope after warm-up: {r['rss_slope_mb_per_min_after_warmup']} MB/min "
            f"(second half: {r['rss_slope_mb_per_min_second_half']} MB/min)",
        ]
    if "prefill_probe" in r:
        p = r["prefill_probe"]
        assert isinstance(p, dict)
        lines.append(f"prefill probe: {p['prompt_tokens']} tokens prefilled in {p['prefill_s']} s; the stream's gap "
                     f"median {p['gap_before_median_s']} s before, {p['gap_during_median_s']} s during, longest "
                     f"{p['gap_during_max_s']} s ({p['max_over_median_before']}x)")
    return lines


def failures(r: dict[str, object]) -> list[str]:
    if "requests_done" not in r:
        return []
    out = []
    if r["status_5xx"]:
        out.append(f"{r['status_5xx']} 5xx answers")
    if r["kv_blocks_used_end"]:
        out.append(f"{r['kv_blocks_used_end']} KV blocks still in use")
    if r["greedy_differ_from_solo"]:
        out.append(f"{r['greedy_differ_from_solo']} greedy replies differ from solo")
    if not r["greedy_ok"]:
        out.append("no greedy reply completed")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="8 clients for 30 s, 4 prompts, 16 tokens (the test's preset)")
    p.add_argument("--clients", type=int, default=None, help="concurrent clients (default 48)")
    p.add_argument("--duration", type=float, default=None, help="seconds of load (default 600; 0: no load phase)")
    p.add_argument("--prompts", type=int, default=None, help="prompts in the fixed set (default 12)")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens per reply (default 32)")
    p.add_argument("--rss-interval", type=float, default=None, help="seconds between RSS samples (default 10)")
    p.add_argument("--min-requests", type=int, default=0,
                   help="requests each client sends at least, past --duration if need be (default 0): the "
                        "clients' seeded mix then holds what a check needs on a machine of any speed")
    p.add_argument("--model", default=None, help="model for the server (default: the default model)")
    p.add_argument("--no-deterministic", dest="deterministic", action="store_false",
                   help="serve without --deterministic (to compare; greedy replies may then differ from solo)")
    p.add_argument("--json", default=None, metavar="PATH", help="write every figure as JSON there")
    p.add_argument("--prefill-probe", action="store_true",
                   help="after the soak, one stream's inter-token gaps while another request prefills a long prompt")
    p.add_argument("--prefill-tokens", type=int, default=7000, help="the probe's prompt length (default 7000)")
    p.add_argument("--probe-baseline", type=float, default=8.0, help="seconds of stream before the long prompt")
    p.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for the server to answer")
    p.add_argument("--quiet", action="store_true")
    opts = p.parse_args(argv)
    preset = QUICK if opts.quick else FULL
    for k, v in preset.items():
        if getattr(opts, k) is None:
            setattr(opts, k, v)
    if (opts.clients < 1 or opts.duration < 0 or opts.prompts < 1 or opts.max_tokens < 1 or opts.rss_interval <= 0
            or opts.min_requests < 0):
        p.error("--clients, --prompts, --max-tokens and --rss-interval must be positive, --duration and "
                "--min-requests at least 0")
    try:
        report = asyncio.run(run(opts))
    except PeerError as e:
        print(f"soak: {e}", file=sys.stderr)
        return 2
    print("\n".join(summary(report)))
    bad = failures(report)
    report["failures"] = bad
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(report, f, indent=1)
    print("checks: " + ("ok" if not bad else "FAILED: " + "; ".join(bad)))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
