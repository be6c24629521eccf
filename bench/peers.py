#!/usr/bin/env python
"""localllm against llama.cpp on the same GGUF file, in one run, as ratios (issue 13, item 6).

    python bench/peers.py                          # every measure, 3 interleaved trials
    python bench/peers.py --only single,prefill --trials 5
    python bench/peers.py --only server16,prefix --json
    python bench/peers.py --build                  # build llama.cpp into the user cache first

Measures (``--only``, default all):

- ``single``: single-stream greedy decode, 128 tokens. llama.cpp: ``llama-bench -p 0 -n 128``
  (tg128); localllm: the engine in-process (what ``localllm run --json --raw --temperature 0
  --max-tokens 128`` runs), EOS ignored; llama-cpp-python in-process too, where it is installed.
- ``prefill``: cold prefill of 512 tokens. llama.cpp: ``llama-bench -p 512 -n 0`` (pp512);
  localllm: 512 / TTFT of a 512-token raw prompt with the prefix cache empty.
- ``sampled``: one stream through the servers, 128 tokens, sampled as a chat app samples:
  ``temperature=0.8, top_p=0.95, top_k=40, min_p=0.05`` (llama-server's own defaults, sent
  explicitly to both), EOS ignored. What a person chatting gets, sampler included.
- ``seq8``: 8 requests one after another, 128 tokens each, through the servers.
- ``server8``, ``server16``: 8 and 16 concurrent streams, 128 tokens each, aggregate output tok/s.
- ``prefix``: a 1,516-token prompt, cold TTFT, then the same prompt again (prefix cache hit).

Servers: ``llama-server -np 16 -c 32768 -t T`` and ``localllm serve --max-num-seqs 16``, each
started fresh for every trial and measured once ``/health`` answers 200 (llama-server answers
503 while it loads), after one short warm-up request. One client for both: the official
``openai`` package, ``stream=True``, ``temperature=0`` and ``ignore_eos`` so both write the same
number of tokens (checked against ``usage``). TTFT is taken at the first chunk that carries
content: both servers send a role-only chunk first, as OpenAI does.

Trials interleave, localllm then llama.cpp, and the table shows medians; ``--json`` has every
trial. A ratio is a speed, localllm's over llama.cpp's: tok/s over tok/s, and llama.cpp's TTFT
over ours, so above 1 means localllm is faster. The header gives the CPU model, its ISA flags,
the load average and the date, and the report lists the exact commands.

llama.cpp: ``llama-bench`` and ``llama-server`` built from the sources that the llama-cpp-python
sdist vendors, in the user cache and never in the repository. They are looked for in
``--llama-cpp-dir``, ``$LOCALLLM_LLAMA_CPP_DIR`` or ``<cache>/build/bin`` (``<cache>`` is
``~/.cache/localllm-peers``, or ``$LOCALLLM_HOME/peers``); ``--build`` downloads the sdist with
pip and builds them there with cmake (a few minutes on 2 cores). Where they cannot be found
or built, the llama.cpp measures are skipped with a one-line message.
"""

from __future__ import annotations

import os

from localllm.cli import set_openmp_defaults  # noqa: E402 - torch-free

# What the user's shell had, before this process sets our CLI's default for the children it
# starts: llama.cpp runs with the user's environment, not with our tuning.
OPENMP_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
USER_OPENMP = {k: os.environ[k] for k in OPENMP_VARS if k in os.environ}
set_openmp_defaults(os.environ)  # must precede the torch import

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import shlex  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tarfile  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from datetime import datetime, timezone  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING, Any  # noqa: E402

from localllm.bench import TOPICS, percentile, prose  # noqa: E402

if TYPE_CHECKING:
    from openai import AsyncOpenAI
    from openai.types.chat import ChatCompletionChunk

    from localllm.engine.engine import LLMEngine
    from localllm.tokenizer import Tokenizer

MEASURES = ("single", "prefill", "sampled", "seq8", "server8", "server16", "prefix")
# llama-server's defaults, sent to both servers for the ``sampled`` measure
CHAT_SAMPLING = {"temperature": 0.8, "top_p": 0.95, "top_k": 40, "min_p": 0.05}
ENV_DIR = "LOCALLLM_LLAMA_CPP_DIR"
SYSTEM = "You are a helpful assistant."
DECODE_PROMPT = "Once upon a time"
SERVER_SLOTS, SERVER_CONTEXT = 16, 32768
# ggml's AMX kernels die with SIGILL (tilezero) on the AMX Xeons these sessions get: the tile
# config and per-thread XFD permission bug of ggml-org/llama.cpp PR 26954. Built without them,
# llama.cpp keeps its AVX-512 VNNI kernels.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


class PeerError(Exception):
    """A problem a user can act on, said in one line."""


# ---- the machine ----

def machine(cpuinfo: str | None = None) -> dict[str, Any]:
    """CPU model, its vector ISA flags (avx2, avx512*, amx*), threads, load average, date."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
    flags_line = re.search(r"^flags\s*:\s*(.+)$", cpuinfo, re.M)
    flags = flags_line.group(1).split() if flags_line else []
    isa = sorted({f for f in flags if f == "avx2" or f.startswith(("avx512", "amx"))})
    return {
        "cpu": model.group(1).strip() if model else "unknown",
        "isa": isa,
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


# ---- finding and building llama.cpp ----

def peers_cache() -> Path:
    """Where the llama.cpp sdist and build live: outside the repository, beside our model cache."""
    from localllm.paths import home_dir

    home = home_dir()
    if home:
        return home / "peers"
    import platformdirs

    return Path(platformdirs.user_cache_dir("localllm-peers"))


@dataclass(frozen=True, slots=True)
class LlamaCpp:
    """The llama.cpp binaries found; either may be missing."""

    bin_dir: Path | None
    bench: Path | None
    server: Path | None
    searched: tuple[Path, ...]

    def missing(self, tool: str) -> str:
        where = ", ".join(str(p) for p in self.searched)
        return (f"llama.cpp skipped: no {tool} in {where} (run bench/peers.py --build to build it there, "
                f"or point --llama-cpp-dir or ${ENV_DIR} at a llama.cpp build)")


def find_llama_cpp(explicit: Path | None = None, env: dict[str, str] | None = None) -> LlamaCpp:
    """Looks in ``explicit``, else ``$LOCALLLM_LLAMA_CPP_DIR``, else the cache's build; each root
    may hold the binaries itself, in ``bin/`` or in ``build/bin/``. The first folder that has
    either binary wins."""
    env = os.environ if env is None else env
    if explicit is not None:
        roots = [explicit]
    elif env.get(ENV_DIR):
        roots = [Path(env[ENV_DIR]).expanduser()]
    else:
        roots = [peers_cache() / "build" / "bin"]
    searched = tuple(d for r in roots for d in (r, r / "bin", r / "build" / "bin"))

    def tool(d: Path, name: str) -> Path | None:
        p = d / name
        return p if p.is_file() and os.access(p, os.X_OK) else None

    for d in searched:
        bench, server = tool(d, "llama-bench"), tool(d, "llama-server")
        if bench or server:
            return LlamaCpp(d, bench, server, searched)
    return LlamaCpp(None, None, None, searched)


def _sdist_source(cache: Path, say: Callable[[str], None]) -> Path:
    """The llama.cpp tree vendored by the llama-cpp-python sdist, downloaded and unpacked once."""
    def found() -> Path | None:
        trees = sorted(cache.glob("llama_cpp_python-*/vendor/llama.cpp/CMakeLists.txt"))
        return trees[-1].parent if trees else None

    tree = found()
    if tree is not None:
        return tree
    tarballs = sorted(cache.glob("llama_cpp_python-*.tar.gz"))
    if not tarballs:
        say("downloading the llama-cpp-python sdist (about 77 MB) with pip")
        cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
               "llama-cpp-python", "-d", str(cache)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        tarballs = sorted(cache.glob("llama_cpp_python-*.tar.gz"))
        if r.returncode != 0 or not tarballs:
            last = (r.stderr.strip().splitlines() or ["no output"])[-1]
            raise PeerError(f"could not download the llama-cpp-python sdist: {last}")
    say(f"unpacking {tarballs[-1].name}")
    with tarfile.open(tarballs[-1]) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(cache, filter="data")
        else:  # Python < 3.11.4: no extraction filters; the sdist comes from PyPI
            tar.extractall(cache)  # noqa: S202
    tree = found()
    if tree is None:
        raise PeerError(f"{tarballs[-1]} holds no vendor/llama.cpp tree")
    return tree


def build_flags(isa: Sequence[str]) -> list[str]:
    flags = ["-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DCMAKE_BUILD_TYPE=Release"]
    if any(f.startswith("amx") for f in isa):
        flags += [f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]
    return flags


def build_llama_cpp(cache: Path, isa: Sequence[str], say: Callable[[str], None]) -> Path:
    """Builds llama-server and llama-bench under ``cache`` with cmake; returns the bin folder.
    Progress goes through ``say``; the full output goes to ``cache/build.log``."""
    if not shutil.which("cmake"):
        raise PeerError("cannot build llama.cpp: cmake is not installed (apt-get install cmake g++, "
                        "or pip install cmake)")
    if not (shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")):
        raise PeerError("cannot build llama.cpp: no C++ compiler (apt-get install g++)")
    cache.mkdir(parents=True, exist_ok=True)
    src = _sdist_source(cache, say)
    build = cache / "build"
    log_path = cache / "build.log"
    flags = build_flags(isa)
    if any("amx" in f for f in flags):
        say("AMX off in this build: ggml's AMX kernels die with an illegal instruction on these CPUs "
            "(ggml-org/llama.cpp PR 26954); the AVX-512 kernels stay")
    jobs = str(os.cpu_count() or 2)
    steps = [
        ("configuring", ["cmake", "-S", str(src), "-B", str(build), *flags]),
        ("building", ["cmake", "--build", str(build), "-j", jobs, "--target", "llama-server", "llama-bench"]),
    ]
    t0 = time.monotonic()
    with log_path.open("w") as log:
        for stage, cmd in steps:
            say(f"{stage} llama.cpp: {shlex.join(cmd)} (log: {log_path})")
            log.write(f"$ {shlex.join(cmd)}\n")
            log.flush()
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            assert proc.stdout is not None
            shown, shown_at = -10, 0.0
            last = ""
            for line in proc.stdout:
                log.write(line)
                log.flush()  # for whoever tails it
                last = line.strip() or last
                m = re.match(r"\[\s*(\d+)%\]", line)
                # cmake's percentage counts finished targets: it can sit still for minutes
                if m and (int(m.group(1)) >= shown + 10 or time.monotonic() - shown_at > 30):
                    shown, shown_at = int(m.group(1)), time.monotonic()
                    say(f"building llama.cpp: {shown}% ({shown_at - t0:.0f} s)")
            if proc.wait() != 0:
                raise PeerError(f"the llama.cpp build failed while {stage} (exit {proc.returncode}): "
                                f"{last[:200]}; full log: {log_path}")
    say(f"built llama.cpp in {time.monotonic() - t0:.0f} s: {build / 'bin'}")
    return build / "bin"


def llama_cpp_env() -> dict[str, str]:
    """The user's environment, without the OpenMP tuning this script set for ours."""
    env = {k: v for k, v in os.environ.items() if k not in OPENMP_VARS}
    return env | USER_OPENMP


def _died(what: str, rc: int, tail: str) -> PeerError:
    if rc == -signal.SIGILL or rc == 128 + signal.SIGILL:
        return PeerError(f"{what} died of an illegal instruction (SIGILL): the build uses an instruction this "
                         "CPU refuses; rebuild with bench/peers.py --build (it turns AMX off)")
    return PeerError(f"{what} exited with {rc}: {tail[:300]}")


# ---- llama-bench ----

def parse_llama_bench(text: str) -> float:
    """tok/s of the one test in ``llama-bench -o json`` output."""
    try:
        rows = json.loads(text)
        return float(rows[0]["avg_ts"])
    except (ValueError, LookupError, TypeError) as e:
        raise PeerError(f"unexpected llama-bench output ({type(e).__name__}): {text[:200]!r}") from None


def llama_bench_cmd(bench: Path, gguf: Path, n_prompt: int, n_gen: int, threads: int) -> list[str]:
    # -r 1: one measured run per trial (after llama-bench's own warm-up run), as for ours
    return [str(bench), "-m", str(gguf), "-p", str(n_prompt), "-n", str(n_gen), "-t", str(threads),
            "-r", "1", "-o", "json"]


def run_llama_bench(cmd: list[str]) -> float:
    r = subprocess.run(cmd, capture_output=True, text=True, env=llama_cpp_env())
    if r.returncode != 0:
        raise _died("llama-bench", r.returncode, (r.stderr.strip().splitlines() or [""])[-1])
    return parse_llama_bench(r.stdout)


# ---- llama-cpp-python, in its own process (its OpenMP and ours stay apart) ----

LLAMA_CPP_PYTHON = r"""
import json, sys, time
from llama_cpp import Llama
job = json.load(sys.stdin)
llm = Llama(model_path=job["model"], n_threads=job["threads"], n_threads_batch=job["threads"],
            n_ctx=2048, n_batch=512, verbose=False)
if job["mode"] == "decode":
    times = []
    for _ in llm.generate(llm.tokenize(job["prompt"].encode(), add_bos=False), temp=0.0, top_k=1):
        times.append(time.perf_counter())
        if len(times) == job["tokens"]:
            break
    print(json.dumps({"tok_s": (len(times) - 1) / (times[-1] - times[0])}))
else:
    ids = job["ids"]
    t0 = time.perf_counter()
    llm.eval(ids)
    print(json.dumps({"tok_s": len(ids) / (time.perf_counter() - t0)}))
"""


def llama_cpp_python_available() -> str | None:
    """None when ``llama_cpp`` imports in this Python, else why not."""
    r = subprocess.run([sys.executable, "-c", "import llama_cpp"], capture_output=True, text=True,
                       env=llama_cpp_env())
    if r.returncode == 0:
        return None
    return "llama-cpp-python skipped: it is not installed in this Python (optional: pip install llama-cpp-python)"


def run_llama_cpp_python(job: dict[str, Any]) -> float:
    r = subprocess.run([sys.executable, "-c", LLAMA_CPP_PYTHON], input=json.dumps(job), capture_output=True,
                       text=True, env=llama_cpp_env())
    if r.returncode != 0:
        raise _died("llama-cpp-python", r.returncode, (r.stderr.strip().splitlines() or [""])[-1])
    return float(json.loads(r.stdout.strip().splitlines()[-1])["tok_s"])


# ---- our engine, in-process ----

class OurEngine:
    """The engine ``localllm run`` drives, loaded once for the single and prefill measures."""

    def __init__(self, gguf: Path, dtype: str, quant: str | None, threads: int) -> None:
        import torch

        from localllm.cli_common import progress_printer
        from localllm.engine.engine import EngineConfig, LLMEngine

        torch.set_num_threads(threads)
        # the steady state: the compiled decode step ready (loaded or built) before trial 1
        self.llm: LLMEngine = LLMEngine(EngineConfig(model=str(gguf), dtype=dtype, quant=quant, chats=1,
                                                     compile_in_background=False), progress=progress_printer())
        self.tokenizer: Tokenizer = self.llm.tokenizer
        self._generate(self.tokenizer.encode(DECODE_PROMPT), 8)  # lazy initialisation stays out of trial 1

    def _generate(self, ids: list[int], max_tokens: int) -> Any:
        from localllm.engine.sequence import SamplingParams

        self.llm.block_manager.reset_prefix_cache()
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return self.llm.generate([ids], params)[0]

    def decode(self, tokens: int) -> float:
        """tok/s after the first token, as llama-bench's tg counts a context that grows from ~0."""
        out = self._generate(self.tokenizer.encode(DECODE_PROMPT), tokens)
        m = out.metrics
        n = len(out.outputs[0].token_ids)
        return (n - 1) / (m.last_token_time - m.first_token_time)

    def prefill(self, ids: list[int]) -> float:
        out = self._generate(ids, 1)
        if out.num_cached_tokens:
            raise PeerError(f"the prefix cache was not cold: {out.num_cached_tokens} tokens hit")
        return len(ids) / out.metrics.ttft

    def describe(self) -> dict[str, Any]:
        plan = self.llm.plan
        return {"precision": self.llm.precision, "quant": getattr(plan, "quant", None),
                "device": str(self.llm.device)}


def load_tokenizer(gguf: Path) -> Tokenizer:
    from localllm.models.loader import open_checkpoint

    return open_checkpoint(gguf).tokenizer


def exact_ids(tokenizer: Tokenizer, tokens: int, nonce: str) -> list[int]:
    ids = tokenizer.encode(prose(tokens + 16, nonce, tokenizer), add_special_tokens=False)[:tokens]
    if len(ids) != tokens:
        raise PeerError(f"could not build a {tokens}-token prompt")
    return ids


def prompt_of(tokenizer: Tokenizer, tokens: int, nonce: str) -> list[dict[str, str]]:
    """System + user messages whose chat prompt is ``tokens`` tokens long by our tokenizer
    (llama-server applies the same template from the GGUF; usage.prompt_tokens checks it)."""
    def messages(doc_tokens: int) -> list[dict[str, str]]:
        doc = prose(max(doc_tokens, 1), nonce, tokenizer)
        return [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"{doc}\n\nSummarize the document in one line."}]

    overhead = len(tokenizer.encode_chat(messages(1))) - 1
    doc_tokens = tokens - overhead
    for _ in range(8):  # BPE merges at the seams move the count by a token or two
        n = len(tokenizer.encode_chat(messages(doc_tokens)))
        if n == tokens:
            break
        doc_tokens += tokens - n
    return messages(doc_tokens)


# ---- the servers ----

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _optimizing(health: Any) -> bool:
    """Whether a ``/health`` answer says the server still compiles its decode step (ours
    does in the background on a first start); llama-server's answer never says so."""
    try:
        return bool(health.json().get("optimizing", False))
    except (ValueError, AttributeError):
        return False


class Server:
    """One server process for one trial: started, ready once ``/health`` answers 200 (not
    the 503 llama-server sends while it loads), stopped at exit. Output goes to a log file
    whose last line explains an early exit."""

    def __init__(self, name: str, argv: list[str], port: int, env: dict[str, str], timeout_s: float) -> None:
        self.name, self.argv, self.port, self.env, self.timeout_s = name, argv, port, env, timeout_s
        self.base = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile(prefix=f"peers-{name}-", suffix=".log", delete=False)
        self.proc: subprocess.Popen[bytes] | None = None

    def _tail(self) -> str:
        lines = Path(self.log.name).read_text(errors="replace").strip().splitlines()
        return lines[-1] if lines else "no output"

    async def __aenter__(self) -> Server:
        import httpx

        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + self.timeout_s
        async with httpx.AsyncClient(timeout=5.0) as http:
            while True:
                rc = self.proc.poll()
                if rc is not None:
                    raise _died(self.name, rc, self._tail())
                try:
                    health = await http.get(f"{self.base}/health")
                    # ours answers while it still compiles its decode step (eager meanwhile): wait
                    if health.status_code == 200 and not _optimizing(health):
                        return self
                except httpx.TransportError:
                    pass  # not listening yet
                if time.monotonic() > deadline:
                    await self.__aexit__()
                    raise PeerError(f"{self.name} was not ready after {self.timeout_s:.0f} s: {self._tail()}")
                await asyncio.sleep(0.2)

    async def __aexit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                await asyncio.to_thread(self.proc.wait, 30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        if exc and exc[0] is None:
            Path(self.log.name).unlink(missing_ok=True)  # keep the log of a failed trial


@dataclass(slots=True)
class StreamResult:
    """One streamed reply, timed from just before the request was sent."""

    ttft_s: float | None  # first chunk that carries content
    first_chunk_s: float | None  # first chunk of any kind (often role-only): not a TTFT
    end_s: float
    output_tokens: int  # usage.completion_tokens where the server sent it, else content chunks
    prompt_tokens: int | None
    content_chunks: int
    text: str


def summarize_stream(t0: float, events: Sequence[tuple[float, ChatCompletionChunk]]) -> StreamResult:
    """``events`` are (arrival time, chunk) in order."""
    ttft = first = None
    chunks = 0
    text: list[str] = []
    usage = None
    for t, chunk in events:
        if first is None:
            first = t - t0
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                if ttft is None:
                    ttft = t - t0
                chunks += 1
                text.append(choice.delta.content)
    return StreamResult(
        ttft_s=ttft, first_chunk_s=first, end_s=(events[-1][0] - t0) if events else 0.0,
        output_tokens=usage.completion_tokens if usage is not None else chunks,
        prompt_tokens=usage.prompt_tokens if usage is not None else None,
        content_chunks=chunks, text="".join(text),
    )


async def stream_chat(client: AsyncOpenAI, model: str, messages: list[dict[str, str]], max_tokens: int,
                      clock: Callable[[], float] = time.monotonic,
                      sampling: dict[str, float] | None = None) -> StreamResult:
    """``sampling``: temperature, top_p, top_k, min_p; default greedy."""
    t0 = clock()
    sampling = sampling or {"temperature": 0.0}
    extra = {k: v for k, v in sampling.items() if k in ("top_k", "min_p")}
    stream = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=sampling["temperature"],  # type: ignore[arg-type]
        top_p=sampling.get("top_p", 1.0), stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True, **extra},
    )
    events = []
    async for chunk in stream:
        events.append((clock(), chunk))
    return summarize_stream(t0, events)


def aggregate(results: Sequence[StreamResult], wall_s: float, asked: int) -> dict[str, Any]:
    """Output tok/s over the wall time of the whole set, plus what tells a fair run: the TTFT
    median, the prompt lengths, and streams that wrote other than ``asked`` tokens."""
    tokens = sum(r.output_tokens for r in results)
    ttfts = [r.ttft_s for r in results if r.ttft_s is not None]
    return {
        "tok_s": tokens / wall_s if wall_s > 0 else 0.0,
        "tokens": tokens, "wall_s": round(wall_s, 3),
        "ttft_p50_s": percentile(ttfts, 50),
        "prompt_tokens": sorted({r.prompt_tokens for r in results if r.prompt_tokens is not None}),
        "short_streams": sum(r.output_tokens != asked for r in results),
    }


def story(nonce: str, i: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"[{nonce}-{i}] Write a long story about {TOPICS[i % len(TOPICS)]}."}]


async def server_sequential(client: AsyncOpenAI, model: str, n: int, tokens: int, nonce: str,
                            sampling: dict[str, float] | None = None) -> dict[str, Any]:
    t0 = time.monotonic()
    results = [await stream_chat(client, model, story(nonce, i), tokens, sampling=sampling) for i in range(n)]
    return aggregate(results, time.monotonic() - t0, tokens)


async def server_concurrent(client: AsyncOpenAI, model: str, n: int, tokens: int, nonce: str) -> dict[str, Any]:
    t0 = time.monotonic()
    results = await asyncio.gather(*(stream_chat(client, model, story(nonce, i), tokens) for i in range(n)))
    return aggregate(results, time.monotonic() - t0, tokens)


async def server_prefix(client: AsyncOpenAI, model: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    cold = await stream_chat(client, model, messages, 4)
    hit = await stream_chat(client, model, messages, 4)
    return {"cold_ttft_s": cold.ttft_s, "hit_ttft_s": hit.ttft_s, "prompt_tokens": cold.prompt_tokens}


# ---- rows of the report ----

# The targets, as speed ratios (localllm over llama.cpp).
TARGETS = {"single": 1.0, "prefill": 1.5, "server16": 2.0, "prefix_hit": 1.0}


@dataclass(slots=True)
class Row:
    key: str
    label: str
    unit: str  # "tok/s" (higher is faster) or "s" (a TTFT: lower is faster)
    peer: str = "llama.cpp"
    ours: list[float] = field(default_factory=list)
    theirs: list[float] = field(default_factory=list)
    details: list[dict[str, Any]] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        ours, theirs = percentile(self.ours, 50), percentile(self.theirs, 50)
        ratio = speed_ratio(ours, theirs, self.unit)
        target = TARGETS.get(self.key)
        return {
            "key": self.key, "label": self.label, "unit": self.unit, "peer": self.peer,
            "ours": ours, "theirs": theirs, "speed_ratio": ratio, "target": target,
            "met": None if target is None or ratio is None else ratio >= target,
            "ours_trials": [round(x, 4) for x in self.ours], "theirs_trials": [round(x, 4) for x in self.theirs],
            "details": self.details,
        }


def speed_ratio(ours: float | None, theirs: float | None, unit: str) -> float | None:
    """Above 1: localllm is faster. tok/s over tok/s; for a time, theirs over ours."""
    if ours is None or theirs is None or ours <= 0 or theirs <= 0:
        return None
    return round(ours / theirs if unit != "s" else theirs / ours, 3)


# ---- the run ----

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


def localllm_cmd() -> list[str]:
    exe = Path(sys.executable).with_name("localllm")
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "localllm.cli"]


def our_server_argv(o: Options, port: int) -> list[str]:
    argv = [*localllm_cmd(), "serve", "--model", str(o.gguf), "--host", "127.0.0.1", "--port", str(port),
            "--max-num-seqs", str(SERVER_SLOTS), "--dtype", o.dtype]
    return argv + (["--quant", o.quant] if o.quant else [])


def their_server_argv(o: Options, port: int) -> list[str]:
    assert o.llama.server is not None
    return [str(o.llama.server), "-m", str(o.gguf), "--host", "127.0.0.1", "--port", str(port),
            "-np", str(SERVER_SLOTS), "-c", str(SERVER_CONTEXT), "-t", str(o.threads)]


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
            self.commands["single_lcp"] = {"llama-cpp-python": f"{sys.executable} -c <bench/peers.py LLAMA_CPP_PYTHON> "
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
            self.commands["prefill_lcp"] = {"llama-cpp-python": f"{sys.executable} -c <bench/peers.py LLAMA_CPP_PYTHON>"
                                                                f" (Llama.eval of the {len(ids)} ids)"}
            lcp.theirs.append(run_llama_cpp_python(job))

    # -- through the servers --

    async def on_servers(self, measure: str, trial: int) -> None:
        o = self.o
        if o.llama.server is None:
            self.skip(o.llama.missing("llama-server"))
        sides = [("localllm", our_server_argv, {**os.environ, **self.our_env()}, self.our_env())]
        if o.llama.server is not None:
            sides.append(("llama.cpp", their_server_argv, llama_cpp_env(), self.their_env()))
        # one nonce per trial, the same for both sides: the same prompts, token for token
        nonce = f"{random.getrandbits(24):06x}"
        prefix_messages = prompt_of(self.tokenizer, o.prefix_tokens, nonce) if measure == "prefix" else None
        for side, argv_of, env, shown_env in sides:
            port = free_port()
            argv = argv_of(o, port)
            name = "localllm serve" if side == "localllm" else "llama-server"
            self.commands.setdefault("servers", {})[side] = _show(argv, shown_env).replace(f" {port}", " PORT")
            o.say(f"{measure} trial {trial + 1}/{o.trials}: {name}")
            async with Server(name, argv, port, env, o.ready_timeout_s) as server:
                value = await self._measure_server(measure, server.base, nonce, prefix_messages)
            value["side"] = side
            self._record(measure, side, value)

    async def _measure_server(self, measure: str, base: str, nonce: str,
                              prefix_messages: list[dict[str, str]] | None) -> dict[str, Any]:
        from openai import AsyncOpenAI

        o = self.o
        async with AsyncOpenAI(base_url=f"{base}/v1", api_key="peers", max_retries=0, timeout=1800.0) as client:
            model = (await client.models.list()).data[0].id
            await stream_chat(client, model, [{"role": "user", "content": f"[{nonce}] hi"}], 4)  # warm-up
            if measure == "seq8":
                return await server_sequential(client, model, 8, o.tokens, nonce)
            if measure == "sampled":
                return await server_sequential(client, model, 1, o.tokens, nonce, CHAT_SAMPLING)
            if measure in ("server8", "server16"):
                return await server_concurrent(client, model, int(measure.removeprefix("server")), o.tokens, nonce)
            assert prefix_messages is not None
            return await server_prefix(client, model, prefix_messages)

    def _record(self, measure: str, side: str, value: dict[str, Any]) -> None:
        o = self.o
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
            if len(seen) == 2 and seen["localllm"] != seen["llama.cpp"]:
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


def llama_cpp_version(llama: LlamaCpp) -> str | None:
    tool = llama.server or llama.bench
    if tool is None:
        return None
    r = subprocess.run([str(tool), "--version"], capture_output=True, text=True, env=llama_cpp_env())
    line = next((ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith("version")), None)
    return line.removeprefix("version:").strip() if line else None


# ---- the table ----

def _num(x: float | None, unit: str) -> str:
    if x is None:
        return "-"
    return f"{x:.3f} s" if unit == "s" else f"{x:.1f}"


def format_report(r: dict[str, Any]) -> str:
    m = r["machine"]
    lines = [
        f"localllm against llama.cpp on {Path(r['model']).name}, {m['date']}",
        f"CPU: {m['cpu']}; {', '.join(m['isa']) or 'no AVX2'}; {m['threads']} threads of {m['cpus']}",
        f"load average {' '.join(map(str, m['load_average']))} at the start, "
        f"{' '.join(map(str, m['load_average_end']))} at the end",
        f"localllm: {r['localllm'].get('precision') or 'the plan (--dtype ' + r['localllm']['dtype'] + ')'}"
        + (f", quant {r['localllm']['quant']}" if r["localllm"].get("quant") else "")
        + f"; llama.cpp {r['llama_cpp']['version'] or '(not found)'}",
        f"{r['trials']} trial(s) each, interleaved (localllm, then the peer), medians; "
        "speed = localllm / peer (TTFT: peer / localllm), above 1 means localllm is faster",
        "",
        f"{'measure':<52} {'localllm':>10} {'peer':>10} {'speed':>7}  target",
    ]
    for row in r["rows"]:
        target = "" if row["target"] is None else f">= {row['target']}x: " + ("met" if row["met"] else "not met")
        if row["target"] is not None and row["met"] is None:
            target = f">= {row['target']}x: -"
        ratio = "-" if row["speed_ratio"] is None else f"{row['speed_ratio']:.2f}x"
        unit = " (tok/s)" if row["unit"] == "tok/s" else ""
        lines.append(f"{row['label'] + unit:<52} {_num(row['ours'], row['unit']):>10} "
                     f"{_num(row['theirs'], row['unit']):>10} {ratio:>7}  {target}")
    if r["commands"]:
        lines += ["", "commands:"]
        for measure, cmds in r["commands"].items():
            for side, cmd in cmds.items():
                lines.append(f"  {measure} / {side}: {cmd}")
    if r["notes"]:
        lines += ["", "notes:"] + [f"  {n}" for n in r["notes"]]
    lines.append(f"\n(wall time {r['wall_s']:.0f} s)")
    return "\n".join(lines)


# ---- CLI ----

def _measures(text: str) -> tuple[str, ...]:
    items = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [x for x in items if x not in MEASURES]
    if bad or not items:
        raise argparse.ArgumentTypeError(f"unknown measure {', '.join(bad) or repr(text)} "
                                         f"(choose from {', '.join(MEASURES)})")
    return tuple(m for m in MEASURES if m in items)  # the documented order, whatever the order given


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be at least 1")
    return n


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench/peers.py", description=__doc__.split("\n\n")[0],
        epilog="Measures: " + ", ".join(MEASURES) + ". See the module docstring for what each one runs.",
    )
    p.add_argument("--model", "-m", default=None,
                   help="a GGUF file or a pulled GGUF model's name (default: the default model's file in the store)")
    p.add_argument("--only", type=_measures, default=MEASURES, help="comma-separated measures (default: all)")
    p.add_argument("--trials", type=_positive, default=3, help="interleaved trials per measure (default 3)")
    p.add_argument("--threads", "-t", type=_positive, default=None,
                   help="threads for both (llama.cpp -t, our OMP_NUM_THREADS; default: the CPUs this process may use)")
    p.add_argument("--tokens", type=_positive, default=128, help="tokens per decode and per stream (default 128)")
    p.add_argument("--prefill-tokens", type=_positive, default=512, help="cold prefill length (default 512)")
    p.add_argument("--prefix-tokens", type=_positive, default=1516, help="prefix-cache prompt length (default 1516)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto", help="ours")
    p.add_argument("--quant", default=None, help="ours: int8, rtn4, ... (default: the plan's)")
    p.add_argument("--llama-cpp-dir", type=Path, default=None,
                   help=f"a llama.cpp build (default: ${ENV_DIR}, else the user cache's build/bin)")
    p.add_argument("--build", action="store_true",
                   help="build llama-server and llama-bench into the user cache from the llama-cpp-python sdist")
    p.add_argument("--ready-timeout", type=_positive, default=600, help="seconds a server may take to load (default 600)")
    p.add_argument("--json", action="store_true", help="print the full report as JSON")
    return p


def resolve_gguf(model: str | None) -> Path:
    from localllm import store

    path = store.resolve(model)
    if path.suffix != ".gguf":
        raise PeerError(f"{model or 'the default model'} is {path}, not a .gguf file: llama.cpp needs GGUF; "
                        "pass --model FILE.gguf")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from localllm.errors import LocalLLMError

    def say(msg: str) -> None:
        print(f"peers: {msg}", file=sys.stderr, flush=True)

    try:
        if args.llama_cpp_dir is not None and not args.llama_cpp_dir.is_dir():
            raise PeerError(f"--llama-cpp-dir {args.llama_cpp_dir}: no such folder")
        gguf = resolve_gguf(args.model)
        llama = find_llama_cpp(args.llama_cpp_dir)
        if args.build:
            bin_dir = build_llama_cpp(peers_cache(), machine()["isa"], say)
            llama = find_llama_cpp(bin_dir)
        needs_bench = {"single", "prefill"} & set(args.only)
        if llama.bench is None and llama.server is None and not (needs_bench and llama_cpp_python_available() is None):
            print(f"peers: {llama.missing('llama-bench or llama-server')}", file=sys.stderr)
            return 0
        threads = args.threads or machine()["cpus"] or 2
        o = Options(gguf=gguf, only=args.only, trials=args.trials, threads=threads, tokens=args.tokens,
                    prefill_tokens=args.prefill_tokens, prefix_tokens=args.prefix_tokens, dtype=args.dtype,
                    quant=args.quant, ready_timeout_s=float(args.ready_timeout), llama=llama, say=say)
        report = run_peers(o)
    except (PeerError, LocalLLMError) as e:
        print(f"peers: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
