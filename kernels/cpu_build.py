"""Builds the C++ kernels of ``kernels/cpu/`` for the CPU at hand (``-march=native``) and caches
them on disk: ``library()`` answers the path of a library ``kernels/cpu_ops.py`` can load.

Each ``.cpp`` under ``kernels/cpu/`` is one translation unit, compiled by its own compiler
process (as many at once as there are cores) into an object cached under the hash of its
source, the headers, the flags, the CPU and the torch version; the objects are then linked
into the library, which is cached under the hash of its objects' keys. So a cold build costs
its compile time shared among the cores (~26 CPU-s of compiles on an Intel Xeon; only ops.cpp
and parallel.cpp parse torch headers, the kernel files plain C++), and a change to one file
recompiles only that file. Later starts load the cached library in milliseconds, whichever
install (venv, pipx) they run from. One process builds a library at a time (an flock in the
cache; the others wait and say so), and a stopped or killed start takes its compilers down
with it (see ``_WATCHED``). Without a C++ compiler (``compiler()`` is the one answer to "can
anything be compiled here", asked by the engine's torch.compile too) ``library()`` returns
None after one line, and callers keep the torch references.

The first build on a machine for a model that said what it runs on (``expect``: its
attention head dims, its GGUF block types, whether it has experts) is staged, so that the
first answer does not wait on kernels the model never calls (~10 of the 26 CPU-s): the files
that only serve other models (``OPTIONAL``) are compiled without optimisation (~0.4 CPU-s
each instead of 2-4), the library linked from them is loaded at once, and the whole library,
every file optimised, is built in the background at the lowest priority for the next start.
The files the model runs are compiled exactly as in the whole build (one object, one key), so
its outputs are bit for bit those of every later start; another model loaded into the same
process before that process ends runs its unoptimised kernels (the same math, slower, its
float sums possibly rounded otherwise).

The cache lives in ``compiled_cache_dir()``, not under ``LOCALLLM_HOME``: the library is built
for one CPU and one torch, so it must not travel with a portable model store, and tests that
give every run a fresh home would otherwise rebuild it each time.

This module is never traced by torch.compile (``cpu_ops`` is, and a saved decode graph is
dropped when a module it traced changes): a change to the build recompiles no model.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import platformdirs
import torch

try:
    import fcntl
except ImportError:  # Windows: no flock (and no build of these kernels either)
    fcntl = None  # type: ignore[assignment]

SOURCE_DIR = Path(__file__).with_name("cpu")


def translation_units() -> list[Path]:
    """The files compiled one by one (every ``.cpp`` under ``kernels/cpu/``), sorted."""
    return sorted(SOURCE_DIR.rglob("*.cpp"))


def _headers() -> list[Path]:
    return sorted(SOURCE_DIR.rglob("*.h"))


def source_text() -> str:
    """Every kernel source, in one string: what a measured choice or a saved graph that
    depends on these kernels is keyed by."""
    return "\0".join(f"{p.relative_to(SOURCE_DIR)}\0{p.read_text()}" for p in [*_headers(), *translation_units()])


def compiled_cache_dir() -> Path:
    """Machine-specific build products (this library, Inductor's compiled graphs)."""
    env = os.environ.get("LOCALLLM_CACHE_DIR")
    base = Path(env).expanduser() if env else Path(platformdirs.user_cache_dir("localllm")) / "compiled"
    base.mkdir(parents=True, exist_ok=True)
    return base


def cpu_signature() -> str:
    """What -march=native depends on: the CPU model and its flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


FLAGS = (
    "-O3", "-march=native",
    # x86 only: GCC for other CPUs rejects it (and then nothing would build there)
    *(("-mprefer-vector-width=512",) if platform.machine().lower() in ("x86_64", "amd64") else ()),
    "-fopenmp", "-fPIC", "-std=c++17",
    # what lets the reductions vectorise, without -ffast-math: that links crtfastmath.o, which
    # sets flush-to-zero for the whole process when the library loads (subnormals vanish in
    # torch and everywhere else; hypothesis caught it)
    "-fno-math-errno", "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros", "-freciprocal-math",
)  # fmt: skip
# GCC's own memory collector, told to wait for a 1 GiB heap: ops.cpp (torch's headers) then
# compiles in ~0.7 CPU-s less (it collected ~10% of its time) into the same bytes, at ~130 MB
# more peak memory. Not part of an object's key: it changes how long GCC takes, not what it
# writes. Only where GCC compiles and the machine has the memory for two such compilers.
_GCC_SPEED = ("--param", "ggc-min-expand=100", "--param", "ggc-min-heapsize=1048576")


def _speed_flags(cxx: str) -> tuple[str, ...]:
    """``_GCC_SPEED`` where ``cxx`` is GCC (told by the name the command resolves to: ``c++``
    is a link to g++ on Linux, to clang on macOS; running it to ask would cost a process)."""
    names = [os.path.basename(os.path.realpath(shutil.which(p) or p)) for p in shlex.split(cxx)]
    gcc = any(n.startswith(("g++", "gcc")) or "-g++" in n for n in names) and not any("clang" in n for n in names)
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = 0
    return _GCC_SPEED if gcc and memory >= 8 << 30 else ()


# A staged build's files the model does not run: the same flags unoptimised (a template-heavy
# kernel file compiles in ~0.3-0.5 CPU-s instead of 2-4)
UNOPTIMISED = tuple("-O0" if f == "-O3" else f for f in FLAGS)


@dataclass(frozen=True)
class Needs:
    """What one model runs on these kernels: its attention head dims, the GGML type ids of its
    GGUF blocks (empty: not a GGUF file) and whether it has GGUF experts."""

    head_dims: frozenset[int]
    gguf_types: frozenset[int] = frozenset()
    experts: bool = False


ISA_ENV = "LOCALLLM_CPU_ISA"  # "generic": the generic GGUF kernels even where the x86 ones are built


def _x86_v3() -> bool:
    """Whether the x86 GGUF kernels build here (gguf/gguf.h: AVX2, FMA and F16C)."""
    flags = set(cpu_signature().split())
    return {"avx2", "fma", "f16c"} <= flags


# The files only some models run, each with the test a model's needs pass when it runs it.
# Every other file (ops.cpp, the dispatch, repacking, sampling, threads) every model runs.
# The GGML type ids are those of gguf/formats.h (tests/kernels/test_cpu_build.py checks each
# file's `case` labels against them).
_FIXED_HEAD_DIMS = (64, 128, 256)
OPTIONAL: dict[str, Callable[[Needs], bool]] = {
    "attention_d64.cpp": lambda n: 64 in n.head_dims,
    "attention_d128.cpp": lambda n: 128 in n.head_dims,
    "attention_d256.cpp": lambda n: 256 in n.head_dims,
    "attention_generic.cpp": lambda n: any(d not in _FIXED_HEAD_DIMS for d in n.head_dims),
    # Q4_0, Q4_1, Q5_0, Q5_1, Q8_0
    "gguf/linear_legacy.cpp": lambda n: bool(n.gguf_types & {2, 3, 6, 7, 8}),
    # Q4_K, Q5_K, Q6_K
    "gguf/linear_kquant.cpp": lambda n: bool(n.gguf_types & {12, 13, 14}),
    # IQ4_NL, IQ4_XS, MXFP4
    "gguf/linear_table.cpp": lambda n: bool(n.gguf_types & {20, 23, 39}),
    "gguf/experts.cpp": lambda n: n.experts,
    # the portable GGUF kernels: the only ones off x86-64-v3, elsewhere run only when forced
    "gguf/generic.cpp": lambda n: bool(n.gguf_types) and (os.environ.get(ISA_ENV) == "generic" or not _x86_v3()),
}
_expected: Needs | None = None  # written by expect() only
Progress = Callable[[str, int, int], None]  # (stage, done, total), as the loader reports
_progress: Progress | None = None  # written by expect() only
STAGE = "building CPU kernels (first run only)"


def expect(needs: Needs, progress: Progress | None = None) -> None:
    """Says what the model about to be loaded runs, before its first kernel call: a first
    build on this machine then stages (module docstring). ``progress``: told ``(STAGE, files
    done, files in all)`` as that build goes, in place of its lines on stderr (a TUI shows a
    bar that moves). Only the first call of a process counts (the first model loaded sets the
    first build); later ones change nothing."""
    global _expected, _progress
    if _expected is None:
        _expected, _progress = needs, progress


def unused_units(needs: Needs | None) -> list[Path]:
    """The translation units a model with these needs never calls (none when unknown)."""
    if needs is None:
        return []
    units = {str(tu.relative_to(SOURCE_DIR)): tu for tu in translation_units()}
    return [units[name] for name, runs in OPTIONAL.items() if name in units and not runs(needs)]


def compiler() -> str | None:
    """The C++ compiler this machine has, or None: ``$CXX`` when it names a program that
    exists (a missing one counts as none: the user pointed at nothing), else ``c++`` or
    ``g++`` on the PATH. The one place that answers "can anything be compiled here": the
    kernel build and the engine's torch.compile (Inductor also runs a C++ compiler on CPU)
    both ask it, so neither starts a compile that cannot happen."""
    cxx = os.environ.get("CXX", "").strip()
    if cxx:
        first, *rest = shlex.split(cxx)  # "ccache g++" is a compiler command too
        found = shutil.which(first)
        return shlex.join([found, *rest]) if found else None
    return shutil.which("c++") or shutil.which("g++")


# what a C++ compiler would give, in one line (docs/benchmarks.md, 2026-12-03: the default
# model's single-stream decode, 2.2-2.6 tok/s on the torch path against 7.7-11.9 with the
# C++ kernels alone; the compiled decode step adds more)
NO_COMPILER = ("localllm: no C++ compiler (install g++ or set CXX): using the slower torch path;"
               " with one, decode is ~{}x faster")
COMPILER_SPEEDUP = 4
_noted_no_compiler = False


def can_compile() -> bool:
    """Whether C++ can be compiled here (``compiler()``); without a compiler, says once per
    process what one would give, so every caller that falls back shares one line."""
    global _noted_no_compiler
    if compiler() is not None:
        return True
    if not _noted_no_compiler:
        _noted_no_compiler = True
        print(NO_COMPILER.format(COMPILER_SPEEDUP), file=sys.stderr, flush=True)
    return False


def _key(*parts: str) -> str:
    return hashlib.sha256(b"\0".join(p.encode() for p in parts)).hexdigest()[:16]


def _flags(tu: Path, unoptimised: Collection[Path]) -> tuple[str, ...]:
    return UNOPTIMISED if tu in unoptimised else FLAGS


def _object_keys(unoptimised: Collection[Path] = ()) -> list[tuple[Path, str]]:
    """Each translation unit with the key of its object: its own source, every header (a
    header change recompiles every file; any one file's change, only that file), torch's
    version and ABI, the CPU and its flags (``FLAGS``, or ``UNOPTIMISED`` for the files in
    ``unoptimised``). Not the compiler's path or version (any compiler's build is as good, and
    a cached one loads where the compiler is gone) and no install path (the library links
    torch's libraries by name, not by where one install keeps them), so every install of one
    version on this machine (a venv, pipx, an editable checkout) shares one build."""
    abi = str(int(torch._C._GLIBCXX_USE_CXX11_ABI))
    headers = "\0".join(f"{p.relative_to(SOURCE_DIR)}\0{p.read_text()}" for p in _headers())
    common = (headers, torch.__version__, cpu_signature(), abi)
    return [(tu, _key(str(tu.relative_to(SOURCE_DIR)), tu.read_text(), *common, *_flags(tu, unoptimised)))
            for tu in translation_units()]


def _library_path(unoptimised: Collection[Path] = ()) -> Path:
    """Where the library for this CPU, torch and source lives: keyed by its objects' keys
    (the whole library: every file optimised)."""
    key = _key(*(k for _, k in _object_keys(unoptimised)), *LINK_FLAGS)
    return compiled_cache_dir() / "cpu_ops" / key / "localllm_cpu_ops.so"


def _object_dir() -> Path:
    return compiled_cache_dir() / "cpu_ops" / "objects"


# The compiler runs under this shell in a session of its own: the shell holds the read end of
# a pipe whose write end only this process holds, so however this process ends (ctrl-c, a
# SIGTERM that skips Python's cleanup, SIGKILL, a crash) the pipe closes, the watcher's read
# returns and it kills the whole group: g++ and the cc1plus/as/ld it started (a compiler
# killed alone leaves its children running). Non-interactive sh gives background jobs
# /dev/null as stdin, hence the pipe kept on fd 3.
_WATCHED = r"""exec 3<&0
"$@" 3<&- </dev/null &
c=$!
(read -r _ <&3; kill -KILL 0) &
w=$!
exec 3<&-
wait "$c"
s=$?
kill "$w" 2>/dev/null
exit "$s"
"""
# A background build's compilers yield to everything else: nice 19, and (its own session is
# its own scheduling group where Linux groups by session, which would otherwise weigh it
# as much as the whole start it runs beside) the group's nice 19 too.
_BACKGROUND = "echo 19 > /proc/self/autogroup 2>/dev/null\n"
BUILD_PREFIX = ".build-"  # temp folders of builds in progress (or of killed ones)
WAITING = "localllm: waiting for another localllm process building the CPU kernels"
LINK_FLAGS = ("-shared", "-fopenmp")


def _build(cxx: str, out: Path, unoptimised: Collection[Path] = (), background: bool = False) -> None:
    """Builds the library into ``out`` (the files in ``unoptimised`` without optimisation),
    one process at a time: the first takes an flock on ``out``'s folder (the kernel releases
    it when its holder dies, however it dies, so a killed builder's lock is taken over at
    once) and the others wait on it with one line, then find the library built. The holder
    first deletes the temp folders of builds that were killed. The objects it lacks are
    compiled in parallel (``_compile_objects``), then linked; every output appears by an
    atomic rename, never half-written. ``background``: no line printed, compilers at the
    lowest priority, and a lock held by another process means that one builds it: return."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with cache_lock(out.parent / ".lock", wait_message=None if background else WAITING,
                    blocking=not background) as lock:
        if out.exists() or not lock.held:  # built by the process we waited for, or building
            return
        _remove_stale_builds(out.parent)
        units = _object_keys(unoptimised)
        objects = _object_dir()
        objects.mkdir(parents=True, exist_ok=True)
        missing = [(tu, objects / f"{key}.o") for tu, key in units if not (objects / f"{key}.o").exists()]
        what = f"{len(missing)} of {len(units)} files" if len(missing) < len(units) else f"{len(units)} files"
        if unoptimised:
            what += f", {len(unoptimised)} this model does not use unoptimised; the rest follows in the background"
        progress = None if background else _progress
        if not background and progress is None:
            print(f"localllm: building CPU kernels for this CPU (first run only, ~10-30 s; {what})",
                  file=sys.stderr, flush=True)
        start = time.monotonic()
        tmp = Path(tempfile.mkdtemp(prefix=BUILD_PREFIX, dir=out.parent))
        total = len(missing) + 1  # and the link
        tick = (lambda done: progress(STAGE, done, total)) if progress is not None else None
        try:
            if tick is not None:
                tick(0)
            _compile_objects(cxx, [(tu, obj, _flags(tu, unoptimised)) for tu, obj in missing], tmp, background, tick)
            tmp_lib = tmp / out.name
            _run_compiler([*_link_command(cxx, [objects / f"{key}.o" for _, key in units]), "-o", str(tmp_lib)],
                          tmp / "link.txt", background)
            os.replace(tmp_lib, out)  # atomic: a concurrent loader sees no half-written library
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if tick is not None:
            tick(total)
        elif not background:
            print(f"localllm: CPU kernels built in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)


_LOCAL_INCLUDE = re.compile(r'^#include "([^"]+)"', re.MULTILINE)


def _compile_cost(tu: Path, unoptimised: Collection[Path]) -> tuple[bool, bool, int]:
    """An estimate of a file's compile time, for ordering, larger first: optimised files before
    unoptimised ones, files that parse torch's headers (the longest: ops.cpp) first among
    them, then the bytes of the file and of the project headers it includes (a short file
    that instantiates a big header's kernel templates is a long compile)."""
    seen: set[Path] = set()
    todo = [tu]
    while todo:
        path = todo.pop()
        if path in seen or not path.is_file():
            continue
        seen.add(path)
        todo += [(path.parent / name).resolve() for name in _LOCAL_INCLUDE.findall(path.read_text())]
    text = tu.read_text()
    return tu not in unoptimised, "<torch/" in text or "<ATen/" in text, sum(p.stat().st_size for p in seen)


def _compile_objects(cxx: str, jobs: Sequence[tuple[Path, Path, tuple[str, ...]]], tmp: Path,
                     background: bool = False, tick: Callable[[int], None] | None = None) -> None:
    """Compiles each (source, object, flags), up to one compiler per core at once, the longest
    first (``_compile_cost``: they set the critical path). Each object is written in ``tmp``
    and renamed into place when whole (then ``tick`` gets how many are); a failure or an
    interrupt kills the compilers still running (their whole groups) and raises."""
    unoptimised = {src for src, _, flags in jobs if flags != FLAGS}
    pending = sorted(jobs, key=lambda j: _compile_cost(j[0], unoptimised), reverse=True)
    width = max(1, min(len(pending), os.cpu_count() or 1))
    running: list[tuple[subprocess.Popen[bytes], list[str], Path, Path]] = []
    try:
        while pending or running:
            while pending and len(running) < width:
                src, obj, flags = pending.pop(0)
                cmd = [*_compile_command(cxx, flags), "-c", str(src), "-o", str(tmp / obj.name)]
                log = tmp / f"{obj.stem}.txt"
                running.append((_start_compiler(cmd, log, background), cmd, obj, log))
            done = next((job for job in running if job[0].poll() is not None), None)
            if done is None:
                time.sleep(0.02)
                continue
            running.remove(done)
            proc, cmd, obj, log = done
            _finish_compiler(proc, log, cmd)
            os.replace(tmp / obj.name, obj)  # atomic: a concurrent build never links half an object
            if tick is not None:
                tick(len(jobs) - len(pending) - len(running))
    except BaseException:
        for proc, *_ in running:
            _kill_group(proc.pid)
            proc.wait()
            assert proc.stdin is not None
            proc.stdin.close()
        raise


def _compile_command(cxx: str, flags: Sequence[str] = FLAGS) -> list[str]:
    """The compiler and its flags for one translation unit (``-c src -o obj`` follow)."""
    torch_dir = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        *shlex.split(cxx), *flags, *_speed_flags(cxx),
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        "-I", str(torch_dir / "include"), "-I", str(torch_dir / "include" / "torch" / "csrc" / "api" / "include"),
    ]  # fmt: skip


def _link_command(cxx: str, objects: Sequence[Path]) -> list[str]:
    # no -rpath to this install's torch: the library is loaded into a process that has
    # already loaded libc10/libtorch_cpu, which the dynamic linker matches by name, and a
    # path baked in would tie a shared build to one install
    torch_dir = Path(torch.__file__).parent
    return [*shlex.split(cxx), *LINK_FLAGS, *map(str, objects), "-L", str(torch_dir / "lib"), "-lc10", "-ltorch_cpu"]


def _start_compiler(cmd: list[str], log: Path, background: bool = False) -> subprocess.Popen[bytes]:
    """Starts ``cmd`` under the watcher (``_WATCHED``), its output to ``log``; ``background``:
    at the lowest priority (``_BACKGROUND``)."""
    nice = shutil.which("nice") if background else None
    prefix = [nice, "-n", "19"] if nice else []
    script = _BACKGROUND + _WATCHED if background else _WATCHED
    with open(log, "w") as err:
        return subprocess.Popen([*prefix, "sh", "-c", script, "sh", *cmd], stdin=subprocess.PIPE, stdout=err,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _finish_compiler(proc: subprocess.Popen[bytes], log: Path, cmd: Sequence[str]) -> None:
    """Waits for a started compiler; raises RuntimeError with its last line when it failed.
    On any exception here (KeyboardInterrupt included) its group is killed first."""
    try:
        code = proc.wait()
    except BaseException:
        _kill_group(proc.pid)
        proc.wait()
        raise
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
    if code != 0:
        last = (log.read_text(errors="replace").strip().splitlines() or [f"exit status {code}"])[-1]
        raise RuntimeError(f"{cmd[0]} failed: {last}")


def _run_compiler(cmd: list[str], log: Path, background: bool = False) -> None:
    """Runs ``cmd`` under the watcher to its end (``_finish_compiler``)."""
    _finish_compiler(_start_compiler(cmd, log, background), log, cmd)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:  # already gone
        pass


class cache_lock:
    """An exclusive flock on the file ``path`` for as long as the ``with`` block runs; prints
    ``wait_message`` once if another process holds it. ``blocking=False``: ``held`` says
    whether it was free. The kernel drops the lock when its holder exits, however it exits."""

    def __init__(self, path: Path, wait_message: str | None = None, blocking: bool = True) -> None:
        self.path = path
        self.wait_message = wait_message
        self.blocking = blocking
        self.held = False
        self._fd = -1

    def __enter__(self) -> cache_lock:
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        if fcntl is None:
            self.held = True
            return self
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self.held = True
        except BlockingIOError:
            if self.blocking:
                if self.wait_message:
                    print(self.wait_message, file=sys.stderr, flush=True)
                try:
                    fcntl.flock(self._fd, fcntl.LOCK_EX)
                except BaseException:  # ctrl-c while waiting: no __exit__ will close it
                    os.close(self._fd)
                    raise
                self.held = True
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self._fd)  # closing the last descriptor releases the flock


def read_cache_json(path: Path) -> dict[str, object]:
    """A JSON object kept in the cache (measured choices, tunings); {} when there is none or
    it does not parse: the caller then measures again."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_cache_json(path: Path, data: dict[str, object]) -> None:
    """Replaces ``path`` at once (a temp file beside it, then ``os.replace``), so a concurrent
    start reads a whole file. A read-only cache only costs the next start its measurements."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", suffix=".tmp",
                                         delete=False) as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(f.name, path)
    except OSError:
        pass


def _remove_stale_builds(folder: Path) -> None:
    """Deletes the temp folders of builds that no longer run. Only the lock holder calls it:
    a builder holds the lock from its temp folder's making to its deletion, so any temp
    folder the holder finds belongs to a build that was killed."""
    for tmp in folder.iterdir():
        if tmp.is_dir() and tmp.name.startswith((BUILD_PREFIX, "tmp")):  # "tmp": builds before the lock
            shutil.rmtree(tmp, ignore_errors=True)


def _clean_after_killed_builds(folder: Path) -> None:
    """At a start that finds the library built: takes the lock only if free (a build in
    progress keeps its folder) and deletes what killed builds left."""
    try:
        if not any(p.name.startswith((BUILD_PREFIX, "tmp")) for p in folder.iterdir()):
            return
        with cache_lock(folder / ".lock", blocking=False) as lock:
            if lock.held:
                _remove_stale_builds(folder)
    except OSError:  # a read-only cache: nothing to clean, nothing lost
        pass


background_build: threading.Thread | None = None  # the whole library's build after a staged one


def _build_in_background(cxx: str, out: Path) -> None:
    """The whole library's build after a staged one (``library``): silent, at the lowest
    priority; a failure costs only the next start a staged build again."""
    try:
        _build(cxx, out, background=True)
    except (OSError, RuntimeError):
        pass


def library() -> Path | None:
    """The library to load: the cached whole library; else, built now (one line says so):
    staged where ``expect`` said what the model runs and some file it does not run has no
    optimised object yet (the whole library then follows on a background thread,
    ``background_build``), else whole. None without a compiler (after ``can_compile``'s
    line). Raises OSError or RuntimeError when a build fails."""
    global background_build
    whole = _library_path()
    if whole.exists():
        _clean_after_killed_builds(whole.parent)
        return whole
    cxx = compiler()
    if cxx is None:
        can_compile()  # the one line: what a compiler would give
        return None
    objects = _object_dir()
    optimised = dict(_object_keys())
    unoptimised = [tu for tu in unused_units(_expected) if not (objects / f"{optimised[tu]}.o").exists()]
    if not unoptimised:
        _build(cxx, whole)
        return whole
    staged = _library_path(unoptimised)
    if staged.exists():
        _clean_after_killed_builds(staged.parent)
    else:
        _build(cxx, staged, unoptimised)
    if background_build is None:
        background_build = threading.Thread(target=_build_in_background, args=(cxx, whole), daemon=True,
                                            name="localllm-kernel-build")
        background_build.start()
    return staged
