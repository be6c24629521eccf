"""What a start waits on before its first answer, and how it ends (issue 30): the eager path
imports neither Dynamo nor sympy (1.5-4 s each on the 2-core machines: the compile thread
imports them after the first step), and a process stopped while its decode step compiles in
the background (ctrl+c on `run`'s "finishing the optimization") ends at once, cleanly, with
no compiler left running."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from localllm.kernels import cpu_build, cpu_ops

# a child whose SIGINT is Python's (a background job of a non-interactive shell starts with it
# ignored, and Python then keeps it ignored: ctrl+c would not reach the process at all)
SIGINT_ON = "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler)\n"


def test_the_first_answer_imports_neither_dynamo_nor_sympy(default_model_path: Path) -> None:
    """Build (on meta, then to the CPU), prefill (the CPU attention's opaque op, called as its
    function: kernels/opaque_op.py) and decode of the default model, without a compile."""
    script = (
        "import sys\n"
        "from localllm import LLM, SamplingParams\n"
        f"llm = LLM({str(default_model_path)!r}, device='cpu', compile=False)\n"
        "out = llm.generate(['The capital of France is'], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))\n"
        "print(len(out[0].outputs[0].token_ids))\n"
        "print(sorted(m for m in ('torch._dynamo', 'torch._inductor', 'sympy') if m in sys.modules))\n"
    )
    env = {**os.environ, "LOCALLLM_NO_COMPILE": "1"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    tokens, imported = proc.stdout.strip().splitlines()[-2:]
    assert tokens == "6"  # a prefill (the attention's opaque op) and decodes
    assert imported == "[]", imported


@pytest.mark.parametrize("thread", ["localllm-compile", "localllm-kv-reserve"])
def test_an_exit_past_a_running_thread_of_ours_ends_the_process_now(thread: str) -> None:
    """``cli._exit_past_threads``: with a daemon thread of ours inside torch's C++ ops at exit
    (a background compile, or no compile but another thread such as the KV pool's page
    reservation), the process ends with the command's code (not 134: a daemon thread unwound
    at the interpreter's exit aborts it), its output flushed, its stand-in compiler ended."""
    compiling = thread == "localllm-compile"
    script = SIGINT_ON + (
        "import subprocess, threading, time, torch\n"
        "from localllm import cli\n"
        "from localllm.engine import model_runner\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "print(child.pid, flush=True)\n"
        "a = torch.randn(512, 512)\n"
        "def work():\n"
        "    while True:\n"
        "        a @ a  # in C++ with the GIL released, as Inductor's tracing often is\n"
        f"worker = threading.Thread(target=work, daemon=True, name={thread!r})\n"
        + ("model_runner._COMPILE_THREADS.add(worker)\n" if compiling else "")
        + "worker.start()\n"
        "time.sleep(0.5)\n"
        "print('the answer', end='')  # block-buffered: a pipe\n"
        "cli._exit_past_threads(7)\n"
        "print('not reached')\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 7, proc.stderr
    pid, out = proc.stdout.split("\n", 1)
    assert out == "the answer"
    assert "terminate called" not in proc.stderr
    _assert_gone(int(pid))  # _end_now ends this process's children either way


@pytest.mark.skipif(cpu_ops.compiler() is None or not cpu_ops.has_gguf_kernels(),
                    reason="the compile needs a C++ compiler, the default plan the CPU kernels")
def test_ctrl_c_while_run_finishes_the_optimization_ends_it_at_once(default_model_path: Path,
                                                                     tmp_path: Path) -> None:
    """The real `localllm run` on a cache with the CPU kernels built but no decode graph: it
    answers, says it finishes the optimization, and ctrl+c (SIGINT to its process group, as a
    terminal sends it) ends it within seconds, exit 0 (the answer was given), with nothing
    left of its group and no abort."""
    cache = tmp_path / "cache"
    if cpu_build.background_build is not None:  # a staged first build: the whole library follows
        cpu_build.background_build.join()
    lib = cpu_build._library_path()  # the whole library, copied: no kernel build here
    (cache / lib.relative_to(cpu_ops.compiled_cache_dir())).parent.mkdir(parents=True)
    shutil.copy2(lib, cache / lib.relative_to(cpu_ops.compiled_cache_dir()))
    env = {k: v for k, v in os.environ.items() if k != "LOCALLLM_NO_COMPILE"}
    env["LOCALLLM_CACHE_DIR"] = str(cache)
    script = SIGINT_ON + "from localllm.cli import main\nsys.argv[0] = 'localllm'\nsys.exit(main())\n"
    cmd = [sys.executable, "-c", script, "run", "--model", str(default_model_path), "--temperature", "0",
           "--max-tokens", "4", "Hi"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert proc.stderr is not None
        lines = []
        for line in proc.stderr:  # ends when the process does
            lines.append(line)
            if "finishing the optimization" in line:
                break
        assert "finishing the optimization" in lines[-1], "".join(lines)
        time.sleep(1.0)  # into the compile
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=20)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    rest = proc.stderr.read()
    assert code == 0, "".join(lines) + rest
    assert "terminate called" not in rest and "Traceback" not in rest
    assert proc.stdout is not None and proc.stdout.read().strip()  # the answer
    left = [p for p in psutil.process_iter(["pid"]) if _pgid(p.pid) == proc.pid]
    assert not left, left


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _assert_gone(pid: int) -> None:
    try:
        psutil.Process(pid).wait(timeout=10)  # gone, or a zombie about to be reaped
    except psutil.NoSuchProcess:
        pass
    except psutil.TimeoutExpired:
        psutil.Process(pid).kill()
        raise AssertionError("the stand-in compiler outlived the process") from None
