"""Builds the C++ kernels of ``kernels/cpu/`` for the CPU at hand (``-march=native``) the first
time they are needed, caches them on disk and registers their ops as ``torch.ops.localllm_cpu.*``.

Each ``.cpp`` under ``kernels/cpu/`` is one translation unit, compiled by its own compiler
process (as many at once as there are cores) into an object cached under the hash of its
source, the headers, the flags, the CPU and the torch version; the objects are then linked
into the library, which is cached under the hash of its objects' keys. So a cold build costs
its compile time shared among the cores (~26 CPU-s of compiles, ~13 s of wall on 2 idle
cores; only ops.cpp and parallel.cpp parse torch headers, the kernel files plain C++), and a
change to one file recompiles only that file. Later starts load the cached library in milliseconds,
whichever install (venv, pipx) they run from. One process builds at a time (an flock in the
cache; the others wait and say so), and a stopped or killed start takes its compilers down
with it (see ``_WATCHED``). Without a C++ compiler (``compiler()`` is the one answer to "can
anything be compiled here", asked by the engine's torch.compile too) or with
``LOCALLLM_CPU_OPS=0``, ``load()`` returns False after one line, and callers keep the torch
references.

The cache lives in ``compiled_cache_dir()``, not under ``LOCALLLM_HOME``: the library is built
for one CPU and one torch, so it must not travel with a portable model store, and tests that
give every run a fresh home would otherwise rebuild it each time.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import platformdirs
import torch

try:
    import fcntl
except ImportError:  # Windows: no flock (and no build of these kernels either)
    fcntl = None  # type: ignore[assignment]

SOURCE_DIR = Path(__file__).with_name("cpu")
_loaded: bool | None = None


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
    "-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-fPIC", "-std=c++17",
    # what lets the reductions vectorise, without -ffast-math: that links crtfastmath.o, which
    # sets flush-to-zero for the whole process when the library loads (subnormals vanish in
    # torch and everywhere else; hypothesis caught it)
    "-fno-math-errno", "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros", "-freciprocal-math",
)  # fmt: skip


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


def _object_keys() -> list[tuple[Path, str]]:
    """Each translation unit with the key of its object: its own source, every header (a
    header change recompiles every file; any one file's change, only that file), torch's
    version and ABI, the CPU and the flags. Not the compiler's path or version (any
    compiler's build is as good, and a cached one loads where the compiler is gone) and no
    install path (the library links torch's libraries by name, not by where one install keeps
    them), so every install of one version on this machine (a venv, pipx, an editable
    checkout) shares one build."""
    abi = str(int(torch._C._GLIBCXX_USE_CXX11_ABI))
    headers = "\0".join(f"{p.relative_to(SOURCE_DIR)}\0{p.read_text()}" for p in _headers())
    common = (headers, torch.__version__, cpu_signature(), abi, *FLAGS)
    return [(tu, _key(str(tu.relative_to(SOURCE_DIR)), tu.read_text(), *common)) for tu in translation_units()]


def _library_path() -> Path:
    """Where the library for this CPU, torch and source lives: keyed by its objects' keys."""
    key = _key(*(k for _, k in _object_keys()), *LINK_FLAGS)
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
BUILD_PREFIX = ".build-"  # temp folders of builds in progress (or of killed ones)
WAITING = "localllm: waiting for another localllm process building the CPU kernels"
LINK_FLAGS = ("-shared", "-fopenmp")


def _build(cxx: str, out: Path) -> None:
    """Builds the library into ``out``, one process at a time: the first takes an flock on
    ``out``'s folder (the kernel releases it when its holder dies, however it dies, so a
    killed builder's lock is taken over at once) and the others wait on it with one line,
    then find the library built. The holder first deletes the temp folders of builds that
    were killed. The objects it lacks are compiled in parallel (``_compile_objects``), then
    linked; every output appears by an atomic rename, never half-written."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with cache_lock(out.parent / ".lock", wait_message=WAITING):
        if out.exists():  # built by the process we waited for
            return
        _remove_stale_builds(out.parent)
        units = _object_keys()
        objects = _object_dir()
        objects.mkdir(parents=True, exist_ok=True)
        missing = [(tu, objects / f"{key}.o") for tu, key in units if not (objects / f"{key}.o").exists()]
        what = f"{len(missing)} of {len(units)} files" if len(missing) < len(units) else f"{len(units)} files"
        print(f"localllm: building CPU kernels for this CPU (first run only, ~10-30 s; {what})",
              file=sys.stderr, flush=True)
        start = time.monotonic()
        tmp = Path(tempfile.mkdtemp(prefix=BUILD_PREFIX, dir=out.parent))
        try:
            _compile_objects(cxx, missing, tmp)
            tmp_lib = tmp / out.name
            _run_compiler([*_link_command(cxx, [objects / f"{key}.o" for _, key in units]), "-o", str(tmp_lib)],
                          tmp / "link.txt")
            os.replace(tmp_lib, out)  # atomic: a concurrent loader sees no half-written library
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        print(f"localllm: CPU kernels built in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)


def _compile_objects(cxx: str, jobs: Sequence[tuple[Path, Path]], tmp: Path) -> None:
    """Compiles each (source, object) pair, up to one compiler per core at once, longest
    sources first (they set the critical path). Each object is written in ``tmp`` and renamed
    into place when whole; a failure or an interrupt kills the compilers still running (their
    whole groups) and raises."""
    pending = sorted(jobs, key=lambda j: -j[0].stat().st_size)
    width = max(1, min(len(pending), os.cpu_count() or 1))
    running: list[tuple[subprocess.Popen[bytes], list[str], Path, Path]] = []
    try:
        while pending or running:
            while pending and len(running) < width:
                src, obj = pending.pop(0)
                cmd = [*_compile_command(cxx), "-c", str(src), "-o", str(tmp / obj.name)]
                log = tmp / f"{obj.stem}.txt"
                running.append((_start_compiler(cmd, log), cmd, obj, log))
            done = next((job for job in running if job[0].poll() is not None), None)
            if done is None:
                time.sleep(0.02)
                continue
            running.remove(done)
            proc, cmd, obj, log = done
            _finish_compiler(proc, log, cmd)
            os.replace(tmp / obj.name, obj)  # atomic: a concurrent build never links half an object
    except BaseException:
        for proc, *_ in running:
            _kill_group(proc.pid)
            proc.wait()
            assert proc.stdin is not None
            proc.stdin.close()
        raise


def _compile_command(cxx: str) -> list[str]:
    """The compiler and its flags for one translation unit (``-c src -o obj`` follow)."""
    torch_dir = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        *shlex.split(cxx), *FLAGS,
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        "-I", str(torch_dir / "include"), "-I", str(torch_dir / "include" / "torch" / "csrc" / "api" / "include"),
    ]  # fmt: skip


def _link_command(cxx: str, objects: Sequence[Path]) -> list[str]:
    # no -rpath to this install's torch: the library is loaded into a process that has
    # already loaded libc10/libtorch_cpu, which the dynamic linker matches by name, and a
    # path baked in would tie a shared build to one install
    torch_dir = Path(torch.__file__).parent
    return [*shlex.split(cxx), *LINK_FLAGS, *map(str, objects), "-L", str(torch_dir / "lib"), "-lc10", "-ltorch_cpu"]


def _start_compiler(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    """Starts ``cmd`` under the watcher (``_WATCHED``), its output to ``log``."""
    with open(log, "w") as err:
        return subprocess.Popen(["sh", "-c", _WATCHED, "sh", *cmd], stdin=subprocess.PIPE, stdout=err,
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


def _run_compiler(cmd: list[str], log: Path) -> None:
    """Runs ``cmd`` under the watcher to its end (``_finish_compiler``)."""
    _finish_compiler(_start_compiler(cmd, log), log, cmd)


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


def load() -> bool:
    """True once ``torch.ops.localllm_cpu`` is usable in this process. Builds the library the
    first time on this machine (one process at a time; see ``_build``); without a compiler
    and without a cached library, says so in one line (``can_compile``) and returns False."""
    global _loaded
    if _loaded is not None:
        return _loaded
    _loaded = False
    if os.environ.get("LOCALLLM_CPU_OPS", "1") == "0":
        return False
    lib = _library_path()
    try:
        if lib.exists():
            _clean_after_killed_builds(lib.parent)
        else:
            cxx = compiler()
            if cxx is None:
                can_compile()  # the one line: what a compiler would give
                return False
            _build(cxx, lib)
        torch.ops.load_library(str(lib))
    except (OSError, RuntimeError) as e:
        print(f"localllm: note: CPU kernels unavailable ({e}); using the slower torch path", file=sys.stderr)
        return False
    _register_fakes()
    _loaded = True
    return True


def path_free_inductor_keys() -> None:
    """Makes Inductor's on-disk cache keys independent of where torch is installed, so every
    install of one torch version on this machine (a venv, pipx) shares its compiled graphs.

    Inductor keys each compiled C++ file by its source and its compiler command line, and the
    command line holds this install's torch folder (``-I .../torch/include``, ``-L .../lib``):
    a second install found none of the first's builds, and loading a saved decode step there
    compiled its C++ again (minutes for the real model). The headers and libraries at that
    folder are the same for one torch version (the version is in the keys already), so the
    folder is replaced by a placeholder in what is hashed; the compile itself still uses the
    real paths. Idempotent."""
    from torch._inductor import codecache

    original = codecache.write
    if getattr(original, "localllm_path_free", False):
        return
    # only torch's folder: the Python headers come from the base interpreter, the same path
    # for every venv made from it (and a different interpreter is a different build anyway)
    root = str(Path(torch.__file__).parent)

    def write(
        content: str | bytes, extension: str, extra: str = "", *args: object, **kwargs: object
    ) -> tuple[str, str]:
        extra = extra.replace(root, "<torch>")
        return original(content, extension, extra, *args, **kwargs)  # type: ignore[arg-type]

    write.localllm_path_free = True  # type: ignore[attr-defined]
    write.__wrapped__ = original  # type: ignore[attr-defined]
    codecache.write = write  # type: ignore[assignment]


def _register_fakes() -> None:
    """Shapes for torch.compile, which traces through these ops without running them."""

    @torch.library.register_fake("localllm_cpu::paged_attention")
    def _(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, max_q, max_splits=0, window=0,  # type: ignore[no-untyped-def]
          sinks=None):
        return torch.empty_like(q)

    if hasattr(torch.ops.localllm_cpu, "gguf_linear"):  # built on x86-64-v3 only

        @torch.library.register_fake("localllm_cpu::gguf_linear")
        def _(x, packed, type, levels):  # type: ignore[no-untyped-def]
            return x.new_empty(x.shape[0], packed[0].shape[0] * 8)

        @torch.library.register_fake("localllm_cpu::gguf_dequantize")
        def _(packed, type, dtype):  # type: ignore[no-untyped-def]
            codes = packed[0]
            return codes.new_empty(codes.shape[0] * 8, codes.shape[1] * 32, dtype=dtype)

        @torch.library.register_fake("localllm_cpu::gguf_linear_grouped")
        def _(x, packed, type, levels, offsets):  # type: ignore[no-untyped-def]
            return x.new_empty(x.shape[0], packed[0].shape[0] * 8 // (offsets.shape[0] - 1))

    @torch.library.register_fake("localllm_cpu::topk_indices")
    def _(logits, k):  # type: ignore[no-untyped-def]
        return logits.new_empty(logits.shape[0], k, dtype=torch.int64)

    @torch.library.register_fake("localllm_cpu::store_kv")
    def _(k, v, k_cache, v_cache, slot_mapping):  # type: ignore[no-untyped-def]
        return None


def bind_threads(cpus: list[int]) -> list[int]:
    """Binds thread i of the calling thread's OpenMP team to CPU ``cpus[i]``; returns the CPU
    each team thread is now bound to (-1: it is not), [] without the library. A forward's
    ~150 parallel regions each end in a barrier: two threads the scheduler puts on one core
    (it does, waking a sleeping worker onto its waker's core) make every barrier wait for a
    time slice, and a batch-16 step on 2 cores then took 55-1,300 ms instead of ~60."""
    if not load():
        return []
    return list(torch.ops.localllm_cpu.bind_threads(cpus))


def usable(x: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether the C++ ops serve this call: CPU tensors, an fp32 cache, and the library built."""
    return x.device.type == "cpu" and cache.dtype == torch.float32 and load()


def topk_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of each row's k largest values, largest first: the C++ kernel for CPU fp32
    rows (torch's topk is ~300 us for 8 of a 49k row there), else ``x.topk(k).indices``, the
    reference (the two may order exactly equal values differently)."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and load():
        return torch.ops.localllm_cpu.topk_indices(x, k)
    return x.topk(k, dim=-1).indices


def has_gguf_kernels() -> bool:
    """The GGUF block kernels are built only on x86-64-v3 CPUs (AVX2, FMA, F16C)."""
    return load() and hasattr(torch.ops.localllm_cpu, "gguf_linear")


def fast_bf16() -> bool:
    """bf16 matmuls beat fp32 here (AMX or AVX512-BF16); without them oneDNN emulates bf16."""
    return any(f in cpu_signature().split() for f in ("amx_bf16", "avx512_bf16"))
