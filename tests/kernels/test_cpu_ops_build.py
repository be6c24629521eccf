"""The CPU kernels' build as real processes live it: a start killed mid-build leaves no
compiler running and its temp folder is cleaned by the next start, which takes the lock
over and compiles only the files the killed one had not finished; two starts on one empty
cache both answer (one builds, the other waits with a line); without a compiler nothing
waits on a compile; a change to one source file recompiles that file alone. Each start is a real ``python`` process with
its own cache (``LOCALLLM_CACHE_DIR``). Except in the one real build-and-kill test, the
compiler is a small script: what is under test is the process handling, not the compile.
A slow "compiler" sleeps in a child process, as g++ runs cc1plus; a fast one copies the
library this test session built, as a real build would produce it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from localllm.kernels import cpu_build, cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.load(), reason="CPU kernels could not be built here")

START = "from localllm.kernels import cpu_ops; print('loaded', cpu_ops.load(), flush=True)"


def _script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


@pytest.fixture
def compilers(tmp_path: Path) -> dict[str, Path]:
    """``slow``: never finishes; its child sleeps with a marker in its arguments (as cc1plus
    would compile). ``copy``: counts its runs (one per source file compiled, one per link)
    and writes this session's real library to its last argument (-o's: an object or the
    library)."""
    marker = tmp_path / "cc1-sleep"  # a copy of sleep, so its command line is this test's own
    shutil.copy(shutil.which("sleep") or "/bin/sleep", marker)
    runs = tmp_path / "runs"
    return {
        "slow": _script(tmp_path / "slow-cxx", f"{marker} 600 &\nwait\n"),
        "copy": _script(tmp_path / "copy-cxx", f'echo run >> "{runs}"\nsleep 0.5\nfor a; do out=$a; done\n'
                        f'cp "{cpu_build._library_path()}" "$out"\n'),
        "marker": marker,
        "runs": runs,
    }


def _start(cache: Path, cxx: Path | str) -> subprocess.Popen[str]:
    env = {**os.environ, "LOCALLLM_CACHE_DIR": str(cache), "CXX": str(cxx)}
    return subprocess.Popen([sys.executable, "-c", START], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _wait_for(cond, what: str, limit: float = 120) -> None:  # type: ignore[no-untyped-def]
    """Polls ``cond``; the limit only keeps a broken build from hanging the suite."""
    deadline = time.monotonic() + limit
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"gave up waiting for {what}")
        time.sleep(0.1)


def _build_dirs(cache: Path) -> list[Path]:
    return list(cache.glob(f"cpu_ops/*/{cpu_build.BUILD_PREFIX}*"))


def _pids_with(text: str) -> list[int]:
    """Live processes whose command line holds ``text`` (zombies have none)."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if text.encode() in (d / "cmdline").read_bytes():
                    found.append(int(d.name))
            except OSError:
                continue
    return found


def _group_alive(pgid: int) -> bool:
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":  # fields: state, ppid, pgrp
                return True
    return False


def test_a_real_build_killed_midway_leaves_no_compiler_and_the_next_start_takes_over(
    tmp_path: Path, compilers: dict[str, Path]
) -> None:
    cache = tmp_path / "cache"
    first = _start(cache, cpu_build.compiler() or "g++")  # the real compiler
    _wait_for(lambda: _build_dirs(cache), "the first start's build")
    build_dir = _build_dirs(cache)[0]
    _wait_for(lambda: _pids_with(str(build_dir)), "g++ to start")
    groups = {os.getpgid(p) for p in _pids_with(str(build_dir))}  # g++'s group: cc1plus, as, ld
    second = _start(cache, compilers["copy"])
    assert second.stderr is not None
    assert second.stderr.readline().strip() == cpu_build.WAITING  # the lock is held: it waits, and says so
    first.send_signal(signal.SIGKILL)
    first.wait()
    out, err = second.communicate(timeout=300)
    assert "loaded True" in out, err
    assert "building CPU kernels" in err  # took the dead process's lock over
    runs = compilers["runs"].read_text().count("run")
    assert 1 <= runs <= len(cpu_build.translation_units()) + 1  # what the killed start had not finished, one link
    _wait_for(lambda: not any(_group_alive(g) for g in groups), "the killed build's compiler to go")
    assert _build_dirs(cache) == []  # the killed build's temp folder is gone
    assert (cache / "cpu_ops" / build_dir.parent.name / "localllm_cpu_ops.so").is_file()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stopped_start_stops_its_compiler_and_the_next_start_cleans_up(
    tmp_path: Path, compilers: dict[str, Path], sig: signal.Signals
) -> None:
    cache = tmp_path / "cache"
    first = _start(cache, compilers["slow"])
    _wait_for(lambda: _pids_with(str(compilers["marker"])), "the slow compiler's child")
    first.send_signal(sig)  # ctrl-c (KeyboardInterrupt), or a SIGTERM that skips Python's cleanup
    first.communicate(timeout=60)
    _wait_for(lambda: not _pids_with(str(compilers["marker"])), "the compiler's child to go")
    if sig == signal.SIGINT:  # Python unwound: the build removed its own temp folder
        assert _build_dirs(cache) == []
    else:
        assert len(_build_dirs(cache)) == 1  # left behind: the process died at once
    second = _start(cache, compilers["copy"])
    out, err = second.communicate(timeout=120)
    assert "loaded True" in out, err
    assert _build_dirs(cache) == []


def test_two_starts_on_an_empty_cache_both_load_and_one_builds(tmp_path: Path, compilers: dict[str, Path]) -> None:
    cache = tmp_path / "cache"
    starts = [_start(cache, compilers["copy"]) for _ in range(2)]
    results = [p.communicate(timeout=300) for p in starts]
    assert all("loaded True" in out for out, _ in results), results
    assert compilers["runs"].read_text().count("run") == len(cpu_build.translation_units()) + 1  # one build
    errs = [err for _, err in results]
    assert sum("building CPU kernels" in e for e in errs) == 1
    assert sum(cpu_build.WAITING in e for e in errs) == 1


def test_a_cached_library_cleans_what_a_killed_build_left(tmp_path: Path) -> None:
    """A start that finds the library built still deletes a killed build's temp folder."""
    cache = tmp_path / "cache"
    env = os.environ.get("LOCALLLM_CACHE_DIR")
    os.environ["LOCALLLM_CACHE_DIR"] = str(cache)
    try:
        lib = cpu_build._library_path()
    finally:
        os.environ.pop("LOCALLLM_CACHE_DIR") if env is None else os.environ.__setitem__("LOCALLLM_CACHE_DIR", env)
    lib.parent.mkdir(parents=True)
    lib.write_bytes(cpu_build._library_path().read_bytes())
    left = lib.parent / f"{cpu_build.BUILD_PREFIX}killed"
    left.mkdir()
    (left / "localllm_cpu_ops.so").write_bytes(b"half")
    out, err = _start(cache, "/nonexistent").communicate(timeout=120)
    assert "loaded True" in out, err  # the cached library needs no compiler
    assert not left.exists()
    assert "no C++ compiler" not in err  # nothing was to be compiled


def test_the_library_key_holds_no_install_path_or_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every install of one version (venv, pipx, editable) and any compiler share one build."""
    key = cpu_build._library_path()
    monkeypatch.setenv("CXX", "/some/other/g++")
    monkeypatch.setattr(sys, "prefix", "/elsewhere/venv")
    assert cpu_build._library_path() == key
    assert "-rpath" not in " ".join(cpu_build._compile_command("g++") + cpu_build._link_command("g++", []))


def test_a_change_to_one_file_recompiles_that_file_alone(
    tmp_path: Path, compilers: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Objects are cached per file: with every object but one in the cache (the sources as
    they are, one of them edited), the build compiles the edited file and links."""
    cache = tmp_path / "cache"
    sources = tmp_path / "cpu"
    shutil.copytree(cpu_build.SOURCE_DIR, sources)
    monkeypatch.setattr(cpu_build, "SOURCE_DIR", sources)
    monkeypatch.setenv("LOCALLLM_CACHE_DIR", str(cache))
    objects = cpu_build._object_dir()
    objects.mkdir(parents=True)
    for _, key in cpu_build._object_keys():  # a previous build's objects (their content is not read here)
        (objects / f"{key}.o").write_bytes(b"cached")
    edited = sources / "sampling.cpp"
    edited.write_text(edited.read_text() + "\n// edited\n")
    (tmp_path / "runs").write_text("")
    calls: list[list[str]] = []
    real = cpu_build._start_compiler

    def start(cmd: list[str], log: Path, background: bool = False) -> subprocess.Popen[bytes]:
        calls.append(cmd)
        return real([str(compilers["copy"]), *cmd[1:]], log, background)

    monkeypatch.setattr(cpu_build, "_start_compiler", start)
    lib = cpu_build._library_path()
    cpu_build._build("g++", lib)
    compiled = [c[c.index("-c") + 1] for c in calls if "-c" in c]
    assert compiled == [str(edited)]
    assert len(calls) == 2  # that file, then the link
    assert lib.is_file()


def test_without_a_compiler_the_start_says_so_once_and_does_not_build(tmp_path: Path) -> None:
    out, err = _start(tmp_path / "cache", "/nonexistent").communicate(timeout=120)
    assert "loaded False" in out
    assert err.strip().splitlines() == [cpu_build.NO_COMPILER.format(cpu_build.COMPILER_SPEEDUP)]
    assert not list((tmp_path / "cache").glob("cpu_ops/*/*"))


def test_inductor_keys_hold_no_torch_install_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inductor keys a C++ file by its command line, which names this install's torch folder:
    with it hashed as a placeholder, another install of this torch finds the same key (so
    its compiled decode step loads instead of compiling again)."""
    import torch
    from torch._inductor import codecache

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    original = getattr(codecache.write, "__wrapped__", codecache.write)  # Inductor's own
    monkeypatch.setattr(codecache, "write", original)  # as it was, after the test
    cpu_ops.path_free_inductor_keys()
    cpu_ops.path_free_inductor_keys()  # idempotent: wrapped once
    assert codecache.write.__wrapped__ is original  # type: ignore[attr-defined]
    torch_dir = str(Path(torch.__file__).parent)
    here, _ = codecache.write("int main() {}", "cpp", extra=f"g++ -I{torch_dir}/include -L{torch_dir}/lib")
    elsewhere, _ = original("int main() {}", "cpp", extra="g++ -I<torch>/include -L<torch>/lib")
    assert here == elsewhere
    other, _ = codecache.write("int main() {}", "cpp", extra="g++ -O2")
    assert other != here  # the rest of the command line still counts
