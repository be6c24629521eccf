"""SIGTERM and SIGHUP end `localllm` as ctrl+c does (issue 30: "stopping any command mid-build
leaves no compiler running"): the real command in its own process, stopped while a compiler
of its own runs (the CPU kernel build on an empty cache; Inductor compiling the decode step in
the background), exits with 128 + the signal's number, without a traceback, and leaves no
process of its tree behind. The signal goes to the process alone (`kill PID`, a service
manager), not to its group as a terminal's ctrl+c does: the compilers get nothing from it."""

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
from tests.models.test_random_models import tokenizer_folder, write_random_model  # noqa: F401 (fixture)

COMPILERS = ("cc1plus", "g++", "c++", "clang", "gcc", "cc", "as", "ld")
MAIN = "import sys\nfrom localllm.cli import main\nsys.argv[0] = 'localllm'\nsys.exit(main())\n"


def _run_cmd(model: Path) -> list[str]:
    return [sys.executable, "-c", MAIN, "run", "--model", str(model), "--temperature", "0", "--max-tokens", "4",
            "Hi"]


def _env(cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "LOCALLLM_NO_COMPILE"}
    env["LOCALLLM_CACHE_DIR"] = str(cache)
    return env


def _stop_while_compiling(cmd: list[str], env: dict[str, str], sig: signal.Signals) -> tuple[int, str, list[int]]:
    """Starts ``cmd``, waits for a compiler among its descendants, sends ``sig`` to its main
    process only; its exit code, its stderr and the pids of its tree when signalled."""
    # SIGHUP at its default in the child: under nohup the suite's children inherit it ignored,
    # and `run` rightly keeps an ignored SIGHUP ignored (cli.py), so the test would hang there
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    try:
        tree: list[psutil.Process] = []
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                tree = psutil.Process(proc.pid).children(recursive=True)
            except psutil.Error:
                tree = []
            if any(_name(p) in COMPILERS for p in tree):
                break
            time.sleep(0.05)
        assert proc.poll() is None and any(_name(p) in COMPILERS for p in tree), \
            f"no compiler started: {[_name(p) for p in tree]}"
        os.kill(proc.pid, sig)
        # read stderr while waiting: a build's progress lines can fill the pipe, and a
        # process blocked writing to it never gets to exit
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, err, [p.pid for p in tree]


def _name(p: psutil.Process) -> str:
    try:
        return p.name()
    except psutil.Error:
        return ""


def _assert_all_gone(pids: list[int], grace_s: float) -> None:
    """No process of the stopped tree runs ``grace_s`` after its exit (a zombie not reaped yet
    counts as gone). Not "in the end": an Inductor g++ left alone ends by itself seconds later."""
    deadline = time.monotonic() + grace_s
    left = [pid for pid in pids if _running(pid)]
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [pid for pid in left if _running(pid)]
    for pid in left:  # leave nothing behind, then fail
        os.kill(pid, signal.SIGKILL)
    assert not left, f"still running after the stop: {left}"


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


needs_compiler = pytest.mark.skipif(cpu_ops.compiler() is None, reason="the build needs a C++ compiler")


@needs_compiler
def test_sighup_during_the_kernel_build_ends_run_and_its_compilers(default_model_path: Path,
                                                                   tmp_path: Path) -> None:
    """An empty kernel cache: `run` builds the CPU kernels (parallel g++, each in its own
    session); a SIGHUP (the terminal closed) a moment in ends it with 129 and its compilers."""
    code, err, tree = _stop_while_compiling(_run_cmd(default_model_path), _env(tmp_path / "cache"), signal.SIGHUP)
    assert code == 128 + signal.SIGHUP, err
    assert "Traceback" not in err and "terminate called" not in err, err
    _assert_all_gone(tree, grace_s=3.0)  # each compiler's watcher kills its group on the exit


@pytest.mark.skipif(cpu_ops.compiler() is None or not cpu_ops.has_gguf_kernels(),
                    reason="the compile needs a C++ compiler, the default plan the CPU kernels")
def test_sigterm_during_the_background_compile_ends_run_and_its_compilers(tokenizer_folder: Path,  # noqa: F811
                                                                          tmp_path: Path) -> None:
    """A cache with the CPU kernels built but no decode graph: `run` answers from the eager
    path while Inductor compiles the decode step (its g++ children); a SIGTERM then ends it
    with 143 and every compiler it started. A tiny random llama (2 layers): Dynamo traces it
    in a moment, where the default model's 30 layers took most of this test's time before
    the first g++ (how run stops does not depend on the model)."""
    model = write_random_model(tmp_path / "llama", "LlamaForCausalLM", tokenizer_folder)
    cache = tmp_path / "cache"
    if cpu_build.background_build is not None:  # a staged first build: the whole library follows
        cpu_build.background_build.join()
    lib = cpu_build._library_path()  # the whole library, copied: no kernel build in the child
    (cache / lib.relative_to(cpu_ops.compiled_cache_dir())).parent.mkdir(parents=True)
    shutil.copy2(lib, cache / lib.relative_to(cpu_ops.compiled_cache_dir()))
    code, err, tree = _stop_while_compiling(_run_cmd(model), _env(cache), signal.SIGTERM)
    assert code == 128 + signal.SIGTERM, err
    assert "Traceback" not in err and "terminate called" not in err, err
    _assert_all_gone(tree, grace_s=0.0)  # ended before the exit (cli._end_now)
