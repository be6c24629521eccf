"""Builds ``cpu_ops.cpp`` for the CPU at hand (``-march=native``) the first time it is needed,
caches the library on disk and registers its ops as ``torch.ops.localllm_cpu.*``.

The build takes ~30 s once per machine and torch version; later starts load the cached
library in milliseconds. Without a C++ compiler (or with ``LOCALLLM_CPU_OPS=0``) ``load()``
returns False after a one-line note, and callers keep the torch references.

The cache lives in ``compiled_cache_dir()``, not under ``LOCALLLM_HOME``: the library is built
for one CPU and one torch, so it must not travel with a portable model store, and tests that
give every run a fresh home would otherwise rebuild it each time.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import platformdirs
import torch

SOURCE = Path(__file__).with_name("cpu_ops.cpp")
_loaded: bool | None = None


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
    "-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-fPIC", "-shared", "-std=c++17",
    # what lets the reductions vectorise, without -ffast-math: that links crtfastmath.o, which
    # sets flush-to-zero for the whole process when the library loads (subnormals vanish in
    # torch and everywhere else; hypothesis caught it)
    "-fno-math-errno", "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros", "-freciprocal-math",
)  # fmt: skip


def _library_path(cxx: str) -> Path:
    parts = (SOURCE.read_text(), torch.__version__, cpu_signature(), cxx, *FLAGS)
    key = hashlib.sha256(b"\0".join(s.encode() for s in parts)).hexdigest()[:16]
    return compiled_cache_dir() / "cpu_ops" / key / "localllm_cpu_ops.so"


def _build(cxx: str, out: Path) -> None:
    torch_dir = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd = [
        cxx, *FLAGS,
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        "-I", str(torch_dir / "include"), "-I", str(torch_dir / "include" / "torch" / "csrc" / "api" / "include"),
        str(SOURCE), "-L", str(torch_dir / "lib"), "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_dir / 'lib'}",
    ]  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_lib = Path(tmp) / out.name
        proc = subprocess.run([*cmd, "-o", str(tmp_lib)], capture_output=True, text=True)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"{cxx} failed: {last}")
        os.replace(tmp_lib, out)  # atomic: a concurrent start sees no half-written library


def load() -> bool:
    """True once ``torch.ops.localllm_cpu`` is usable in this process."""
    global _loaded
    if _loaded is not None:
        return _loaded
    _loaded = False
    if os.environ.get("LOCALLLM_CPU_OPS", "1") == "0":
        return False
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or ""
    lib = _library_path(cxx) if cxx else None
    try:
        if lib is None or not lib.exists():
            if not cxx:
                raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
            print("localllm: building CPU kernels for this CPU (first run only, ~30 s)", file=sys.stderr, flush=True)
            _build(cxx, lib)  # type: ignore[arg-type]
        torch.ops.load_library(str(lib))
    except (OSError, RuntimeError) as e:
        print(f"localllm: note: CPU kernels unavailable ({e}); using the slower torch path", file=sys.stderr)
        return False
    _register_fakes()
    _loaded = True
    return True


def _register_fakes() -> None:
    """Shapes for torch.compile, which traces through these ops without running them."""

    @torch.library.register_fake("localllm_cpu::paged_attention")
    def _(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, max_q):  # type: ignore[no-untyped-def]
        return torch.empty_like(q)

    if hasattr(torch.ops.localllm_cpu, "gguf_linear"):  # built on x86-64-v3 only

        @torch.library.register_fake("localllm_cpu::gguf_linear")
        def _(x, codes, d, c, type, levels):  # type: ignore[no-untyped-def]
            return x.new_empty(x.shape[0], codes.shape[0] * 8)

        @torch.library.register_fake("localllm_cpu::gguf_dequantize")
        def _(codes, d, c, type, dtype):  # type: ignore[no-untyped-def]
            return codes.new_empty(codes.shape[0] * 8, codes.shape[1] * 32, dtype=dtype)

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
