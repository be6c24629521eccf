"""One peers run: the measures in order, trials interleaved (localllm, then the peer), each
server started fresh per trial; one failed trial costs its own figures only.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .build import LlamaCpp, llama_cpp_version
from .client import CHAT_SAMPLING, exact_ids, load_tokenizer, prompt_of, server_concurrent, server_prefix, \
    server_sequential, server_spec, stream_chat
from .environment import OPENMP_VARS, USER_OPENMP, PeerError, llama_cpp_env, machine
from .processes import DECODE_PROMPT, OurEngine, Server, free_port, llama_bench_cmd, llama_cpp_python_available, \
    localllm_cmd, run_llama_bench, run_llama_cpp_python, wait_decode_graphs
from .report import Row

if TYPE_CHECKING:
    from localllm.tokenizer import Tokenizer

MEASURES = ("single", "prefill", "sampled", "seq8", "server8", "server16", "prefix")
# run only when named in --only: each side's n-gram speculation (issue 31)
EXTRA_MEASURES = ("spec",)
# our n-gram speculation's most proposals a step (the adaptive k picks at or below it);
# llama-server's ngram-simple runs with its own defaults (a 12-token lookup, up to 48 drafted)
SPEC_K = 10
SPEC_BURSTS = 3  # 16-stream bursts per server in the spec measure (the median is kept)
SPEC_OFF_SIDE = "localllm_nospec"  # the spec measure's third side: our server without speculation
SERVER_SLOTS, SERVER_CONTEXT = 16, 32768


@dataclass(slots=True)
class Options:
    gguf: Path
    only: tuple[str, ...]
    trials: int
    threads: int
    tokens: int
    prefill_tokens: int
    prefix_tokens: int
    dtype: str
    quant: str | None
    ready_timeout_s: float
    llama: LlamaCpp
    say: Callable[[str], None]


def our_server_argv(o: Options, port: int, spec: bool = False) -> list[str]:
    argv = [*localllm_cmd(), "serve", "--model", str(o.gguf), "--host", "127.0.0.1", "--port", str(port),
            "--max-num-seqs", str(SERVER_SLOTS), "--dtype", o.dtype]
    argv += ["--speculative-ngram", str(SPEC_K)] if spec else []
    return argv + (["--quant", o.quant] if o.quant else [])


def their_server_argv(o: Options, port: int, spec: bool = False) -> list[str]:
    assert o.llama.server is not None
    argv = [str(o.llama.server), "-m", str(o.gguf), "--host", "127.0.0.1", "--port", str(port),
            "-np", str(SERVER_SLOTS), "-c", str(SERVER_CONTEXT), "-t", str(o.threads)]
    return argv + (["--spec-type", "ngram-simple"] if spec else [])


def _show(argv: list[str], env: dict[str, str] | None = None) -> str:
    prefix = " ".join(f"{k}={v}" for k, v in (env or {}).items())
    return (prefix + " " if prefix else "") + shlex.join(argv)


class Bench:
    def __init__(self, o: Options) -> None:
        self.o = o
        self.rows: dict[str, Row] = {}
        self.commands: dict[str, dict[str, str]] = {}
        self.notes: list[str] = []
        self.engine: OurEngine | None = None
        self.ours: dict[str, Any] = {}
        self._tokenizer: Tokenizer | None = None
        self.lcp_skip = llama_cpp_python_available() if {"single", "prefill"} & set(o.only) else None
        if self.lcp_skip:
            self.notes.append(self.lcp_skip)

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            self._tokenizer = self.engine.tokenizer if self.engine else load_tokenizer(self.o.gguf)
        return self._tokenizer

    def row(self, key: str, label: str, unit: str, peer: str = "llama.cpp") -> Row:
        return self.rows.setdefault(key, Row(key, label, unit, peer))

    def our_env(self) -> dict[str, str]:
        return {"OMP_NUM_THREADS": str(self.o.threads), **{k: os.environ[k] for k in OPENMP_VARS if k in os.environ}}

    def their_env(self) -> dict[str, str]:
        return dict(USER_OPENMP)

    def skip(self, message: str) -> None:
        if message not in self.notes:
            self.notes.append(message)
            self.o.say(message)

    def our_engine(self) -> OurEngine:
        if self.engine is None:
            self.o.say("loading localllm's engine in-process")
            self.engine = OurEngine(self.o.gguf, self.o.dtype, self.o.quant, self.o.threads)
            self.ours = self.engine.describe()
        return self.engine

    # -- in-process measures: single and prefill --

    def single(self, trial: int) -> None:
        o = self.o
        row = self.row("single", f"single-stream decode, {o.tokens} tokens", "tok/s")
        engine = self.our_engine()
        cmds = self.commands["single"] = {
            "localllm": f"in-process LLMEngine.generate({DECODE_PROMPT!r} raw, temperature=0, max_tokens={o.tokens}, "
                        f"ignore_eos=True), torch threads {o.threads}; the CLI equivalent: "
                        + shlex.join([*localllm_cmd(), "run", "--model", str(o.gguf), "--json", "--raw",
                                      "--temperature", "0", "--max-tokens", str(o.tokens), DECODE_PROMPT]),
        }
        row.ours.append(engine.decode(o.tokens))
        if o.llama.bench:
            cmd = llama_bench_cmd(o.llama.bench, o.gguf, 0, o.tokens, o.threads)
            cmds["llama.cpp"] = _show(cmd, self.their_env())
            row.theirs.append(run_llama_bench(cmd))
        else:
            self.skip(o.llama.missing("llama-bench"))
        if not self.lcp_skip:
            lcp = self.row("single_lcp", "  llama-cpp-python in-process", "tok/s", "llama-cpp-python")
            lcp.ours.append(row.ours[-1])
            job = {"model": str(o.gguf), "threads": o.threads, "mode": "decode", "prompt": DECODE_PROMPT,
                   "tokens": o.tokens}
            self.commands["single_lcp"] = {"llama-cpp-python": f"{sys.executable} -c <bench/peers/processes.py LLAMA_CPP_PYTHON> "
                                                               f"<<< {json.dumps(job)}"}
            lcp.theirs.append(run_llama_cpp_python(job))

    def prefill(self, trial: int) -> None:
        o = self.o
        row = self.row("prefill", f"cold prefill, {o.prefill_tokens} tokens", "tok/s")
        engine = self.our_engine()
        ids = exact_ids(self.tokenizer, o.prefill_tokens, f"{random.getrandbits(24):06x}")
        cmds = self.commands["prefill"] = {
            "localllm": f"in-process: {o.prefill_tokens} / TTFT of LLMEngine.generate(<{o.prefill_tokens} prompt "
                        "token ids>, max_tokens=1) after reset_prefix_cache()",
        }
        row.ours.append(engine.prefill(ids))
        if o.llama.bench:
            cmd = llama_bench_cmd(o.llama.bench, o.gguf, o.prefill_tokens, 0, o.threads)
            cmds["llama.cpp"] = _show(cmd, self.their_env())
            row.theirs.append(run_llama_bench(cmd))
        else:
            self.skip(o.llama.missing("llama-bench"))
        if not self.lcp_skip:
            lcp = self.row("prefill_lcp", "  llama-cpp-python in-process", "tok/s", "llama-cpp-python")
            lcp.ours.append(row.ours[-1])
            job = {"model": str(o.gguf), "threads": o.threads, "mode": "prefill", "ids": ids}
            self.commands["prefill_lcp"] = {"llama-cpp-python": f"{sys.executable} -c <bench/peers/processes.py LLAMA_CPP_PYTHON>"
                                                                f" (Llama.eval of the {len(ids)} ids)"}
            lcp.theirs.append(run_llama_cpp_python(job))

    # -- through the servers --

    async def on_servers(self, measure: str, trial: int) -> None:
        o = self.o
        if o.llama.server is None:
            self.skip(o.llama.missing("llama-server"))
        spec = measure == "spec"
        ours_env = {**os.environ, **self.our_env()}
        sides = [("localllm", our_server_argv, ours_env, self.our_env(), spec)]
        if spec:  # our own decode without speculation: what the speed-up is over
            sides.append((SPEC_OFF_SIDE, our_server_argv, ours_env, self.our_env(), False))
        if o.llama.server is not None:
            sides.append(("llama.cpp", their_server_argv, llama_cpp_env(), self.their_env(), spec))
        if spec and trial % 2:  # load drift falls on every side alike
            sides.reverse()
        # one nonce per trial, the same for both sides: the same prompts, token for token
        nonce = f"{random.getrandbits(24):06x}"
        prefix_messages = prompt_of(self.tokenizer, o.prefix_tokens, nonce) if measure == "prefix" else None
        for side, argv_of, env, shown_env, spec_on in sides:
            port = free_port()
            argv = argv_of(o, port, spec_on)
            name = "llama-server" if side == "llama.cpp" else "localllm serve"
            shown = _show(argv, shown_env).replace(f" {port}", " PORT")
            self.commands.setdefault("spec_servers" if spec else "servers", {})[side] = shown
            o.say(f"{measure} trial {trial + 1}/{o.trials}: {name}" + (f" (speculation {'on' if spec_on else 'off'})" if spec else ""))
            async with Server(name, argv, port, env, o.ready_timeout_s) as server:
                value = await self._measure_server(measure, server.base, nonce, prefix_messages, side)
            if server.uncompiled:
                self.skip(f"{measure} trial {trial + 1}: {side}'s decode step could not be compiled (eager)")
            if server.recompiled:
                self.skip(f"{measure} trial {trial + 1}: {side} rebuilt a saved decode graph (its guards refused it: "
                          "another thread count or changed code) before it was measured")
            value["side"] = side
            self._record(measure, side, value)

    async def _measure_server(self, measure: str, base: str, nonce: str,
                              prefix_messages: list[dict[str, str]] | None, side: str) -> dict[str, Any]:
        from openai import AsyncOpenAI

        o = self.o
        async with AsyncOpenAI(base_url=f"{base}/v1", api_key="peers", max_retries=0, timeout=1800.0) as client:
            model = (await client.models.list()).data[0].id
            await stream_chat(client, model, [{"role": "user", "content": f"[{nonce}] hi"}], 4)  # warm-up
            if side != "llama.cpp":  # the steady state: the saved decode graphs loaded (after a first step)
                waited = await wait_decode_graphs(base, o.ready_timeout_s)
                if waited > 1.0:
                    o.say(f"{measure}: {side} loaded its decode graphs {waited:.1f} s after the warm-up")
            if measure == "seq8":
                return await server_sequential(client, model, 8, o.tokens, nonce)
            if measure == "sampled":
                return await server_sequential(client, model, 1, o.tokens, nonce, CHAT_SAMPLING)
            if measure == "spec":
                value = await server_spec(client, model, o.tokens, nonce)
                if side != "llama.cpp":  # many streams: where our speculation must step aside
                    # three bursts in the one server, their median: a 2% difference between
                    # two servers was below one burst's spread (how its requests join: one
                    # mixed step or two, 25-40 ms either way)
                    rates = [(await server_concurrent(client, model, 16, o.tokens, f"{nonce}{r}"))["tok_s"]
                             for r in range(SPEC_BURSTS)]
                    value["server16_tok_s"] = statistics.median(rates)
                    value["server16_bursts_tok_s"] = rates
                return value
            if measure in ("server8", "server16"):
                return await server_concurrent(client, model, int(measure.removeprefix("server")), o.tokens, nonce)
            assert prefix_messages is not None
            return await server_prefix(client, model, prefix_messages)

    def _record(self, measure: str, side: str, value: dict[str, Any]) -> None:
        o = self.o
        if measure == "spec":
            self._record_spec(side, value)
            return
        if measure == "prefix":
            rows = [(self.row("prefix_cold", f"{o.prefix_tokens:,}-token prompt, cold TTFT", "s"), "cold_ttft_s"),
                    (self.row("prefix_hit", "  same prompt again (prefix cache hit), TTFT", "s"), "hit_ttft_s")]
        else:
            label = {"sampled": f"server: 1 stream x {o.tokens} tokens, sampled (T 0.8, top-p/k/min-p)",
                     "seq8": f"server: 8 requests in sequence x {o.tokens} tokens",
                     "server8": f"server: 8 concurrent streams x {o.tokens} tokens",
                     "server16": f"server: 16 concurrent streams x {o.tokens} tokens"}[measure]
            rows = [(self.row(measure, label, "tok/s"), "tok_s")]
            if value["short_streams"]:
                self.skip(f"{measure}: {side} wrote other than {o.tokens} tokens in {value['short_streams']} "
                          f"stream(s) ({value['tokens']} in all): ignore_eos was not honoured")
        for row, key in rows:
            if value[key] is None:
                raise PeerError(f"{measure}: {side} streamed no content")
            (row.ours if side == "localllm" else row.theirs).append(value[key])
            row.details.append({k: v for k, v in value.items() if k != "tok_s"})

    def _record_spec(self, side: str, value: dict[str, Any]) -> None:
        """Each side's figures go to two kinds of rows: ours with speculation against
        llama.cpp with its own (``spec_code``, ``spec_prose``), and ours with it against ours
        without it (``spec_*_self``, peer ``SPEC_OFF_SIDE``), so both ratios of the issue come
        from the same trials."""
        o = self.o
        off = "localllm, no speculation"
        rows = {  # key: (label, value key, peer, which side is "ours", which the peer)
            "spec_code": (f"server: 1 stream, code copy, {o.tokens} tokens, decode (both n-gram)",
                          "code_tok_s", "llama.cpp", "localllm", "llama.cpp"),
            "spec_prose": ("  same, prose (a story), decode", "prose_tok_s", "llama.cpp", "localllm", "llama.cpp"),
            "spec_code_self": ("  code copy: speculation on over off (ours)", "code_tok_s", off, "localllm", SPEC_OFF_SIDE),
            "spec_prose_self": ("  prose: speculation on over off (ours)", "prose_tok_s", off, "localllm", SPEC_OFF_SIDE),
            # two server processes: their bursts move 3-10% apart whatever the setting, so this
            # row has no target; the measure is `localllm bench --workload spec`'s paired bursts
            # in one engine (docs/benchmarks.md)
            "spec_server16_self": (f"  16 concurrent streams x {o.tokens}: on over off (ours; two servers,"
                                   " no target: see `bench --workload spec`)", "server16_tok_s", off,
                                   "localllm", SPEC_OFF_SIDE),
        }
        for key, (label, vkey, peer, ours, theirs) in rows.items():
            if side not in (ours, theirs):
                continue
            if value.get(vkey) is None:
                raise PeerError(f"spec: {side} streamed no content ({vkey})")
            row = self.row(key, label, "tok/s", peer)
            (row.ours if side == ours else row.theirs).append(value[vkey])
            row.details.append(value)

    async def run(self) -> None:
        o = self.o
        for measure in o.only:
            for trial in range(o.trials):
                # one failed trial costs its own figures only, not the rest of a long run
                try:
                    if measure in ("single", "prefill"):
                        o.say(f"{measure} trial {trial + 1}/{o.trials}")
                        getattr(self, measure)(trial)
                    else:
                        self.engine = None  # the in-process measures are done: give its memory back
                        await self.on_servers(measure, trial)
                except PeerError as e:
                    self.skip(f"{measure} trial {trial + 1} failed: {e}")
                except OSError as e:  # a server went away mid-trial (httpx/openai connection errors)
                    self.skip(f"{measure} trial {trial + 1} failed: {type(e).__name__}: {e}")
                except Exception as e:  # noqa: BLE001 - the openai client's own errors
                    if type(e).__module__.split(".")[0] not in ("openai", "httpx", "httpcore"):
                        raise
                    self.skip(f"{measure} trial {trial + 1} failed: {type(e).__name__}: {e}")
        self.check_prompts()

    def check_prompts(self) -> None:
        """Both servers should have seen prompts of the same length; say so where not."""
        for row in self.rows.values():
            seen: dict[str, set[int]] = {}
            for d in row.details:
                lengths = d.get("prompt_tokens")
                lengths = lengths if isinstance(lengths, list) else [lengths] if lengths is not None else []
                seen.setdefault(d["side"], set()).update(lengths)
            if {"localllm", "llama.cpp"} <= set(seen) and seen["localllm"] != seen["llama.cpp"]:
                self.notes.append(f"{row.key}: prompt lengths differ: localllm {sorted(seen['localllm'])}, "
                                  f"llama.cpp {sorted(seen['llama.cpp'])} tokens")


def run_peers(o: Options) -> dict[str, Any]:
    start = machine()
    bench = Bench(o)
    t0 = time.monotonic()
    asyncio.run(bench.run())
    end = machine()
    return {
        "model": str(o.gguf),
        "machine": {**start, "load_average_end": end["load_average"], "threads": o.threads},
        "localllm": {"dtype": o.dtype, "quant": o.quant, **bench.ours},
        "llama_cpp": {"bin_dir": str(o.llama.bin_dir) if o.llama.bin_dir else None,
                      "version": llama_cpp_version(o.llama)},
        "trials": o.trials,
        "rows": [r.summary() for r in bench.rows.values()],
        "commands": bench.commands,
        "notes": bench.notes,
        "wall_s": round(time.monotonic() - t0, 1),
    }
