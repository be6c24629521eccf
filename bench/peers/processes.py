"""The processes a peers run measures: llama-bench, llama-cpp-python in a process of its own,
our engine in-process, and a server (ours or llama-server) started fresh for one trial.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .environment import PeerError, died, llama_cpp_env

if TYPE_CHECKING:
    from localllm.engine.engine import LLMEngine
    from localllm.tokenizer import Tokenizer

DECODE_PROMPT = "Once upon a time"


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
        raise died("llama-bench", r.returncode, (r.stderr.strip().splitlines() or [""])[-1])
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
        raise died("llama-cpp-python", r.returncode, (r.stderr.strip().splitlines() or [""])[-1])
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


def _graphs_pending(metrics_text: str) -> bool:
    """Whether our ``/metrics`` says the compiled decode step is still loaded or built
    (``localllm:decode_graphs_pending 1``); False where the gauge is missing (llama-server)."""
    for line in metrics_text.splitlines():
        if line.startswith("localllm:decode_graphs_pending"):
            return line.rsplit(" ", 1)[-1].strip() not in ("0", "0.0")
    return False


async def wait_decode_graphs(base: str, timeout_s: float) -> float:
    """Waits until our server decodes through its compiled graphs; returns the seconds waited.
    A server loads its saved graphs (or builds missing ones) on a background thread after its
    first step, seconds to minutes on a loaded machine, answering eagerly meanwhile: a trial
    measured then is the eager path (half the speed), not the steady state."""
    import httpx

    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=10.0) as http:
        while True:
            r = await http.get(f"{base}/metrics")
            if r.status_code != 200 or not _graphs_pending(r.text):
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                raise PeerError(f"localllm serve still loaded its decode graphs after {timeout_s:.0f} s")
            await asyncio.sleep(0.2)


class Server:
    """One server process for one trial: started, ready once ``/health`` answers 200 (not
    the 503 llama-server sends while it loads), stopped at exit. Output goes to a log file
    whose last line explains an early exit."""

    def __init__(self, name: str, argv: list[str], port: int, env: dict[str, str], timeout_s: float) -> None:
        self.name, self.argv, self.port, self.env, self.timeout_s = name, argv, port, env, timeout_s
        self.base = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile(prefix=f"peers-{name}-", suffix=".log", delete=False)
        self.proc: subprocess.Popen[bytes] | None = None
        self.uncompiled = False  # set at exit: the log says the decode step ran eager
        self.recompiled = False  # set at exit: the log says a saved decode graph was rebuilt

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
                    raise died(self.name, rc, self._tail())
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
        # a decode step that could not be compiled runs eager: its figures are not the steady state
        lines = Path(self.log.name).read_text(errors="replace").splitlines()
        self.uncompiled = any("decoding without it" in line for line in lines)
        # a saved graph refused (another torch thread count, changed code): rebuilt in the
        # background before the trial was measured (``wait_decode_graphs``); worth a note
        self.recompiled = any("compiling it again" in line for line in lines)
        if exc and exc[0] is None:
            Path(self.log.name).unlink(missing_ok=True)  # keep the log of a failed trial


def localllm_cmd() -> list[str]:
    exe = Path(sys.executable).with_name("localllm")
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "localllm.cli"]
