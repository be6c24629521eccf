"""Registers the C++ kernels of ``kernels/cpu/`` as ``torch.ops.localllm_cpu.*`` and holds the
Python side of their use: ``load()`` (the library that ``kernels/cpu_build.py`` builds for this
CPU the first time it is needed and caches), the ops' shapes for torch.compile, and the checks
callers ask (``usable``, ``has_gguf_kernels``). Without a C++ compiler and a cached library, or
with ``LOCALLLM_CPU_OPS=0``, ``load()`` returns False after one line, and callers keep the
torch references.

torch.compile traces this module (a saved decode graph is dropped when its source changes):
how the library is built lives in ``cpu_build``, which is not traced.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from localllm.kernels import cpu_build
# the build's names, where callers have always found them
from localllm.kernels.cpu_build import (  # noqa: F401
    COMPILER_SPEEDUP,
    NO_COMPILER,
    SOURCE_DIR,
    cache_lock,
    can_compile,
    compiled_cache_dir,
    compiler,
    cpu_signature,
    read_cache_json,
    source_text,
    translation_units,
    write_cache_json,
)

_loaded: bool | None = None


def load() -> bool:
    """True once ``torch.ops.localllm_cpu`` is usable in this process. Builds the library the
    first time on this machine (``cpu_build.library``: one process at a time, staged for the
    model that ``cpu_build.expect`` named); without a compiler and without a cached library,
    says so in one line and returns False."""
    global _loaded
    if _loaded is not None:
        return _loaded
    _loaded = False
    if os.environ.get("LOCALLLM_CPU_OPS", "1") == "0":
        return False
    try:
        lib = cpu_build.library()
        if lib is None:
            return False
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

    if hasattr(torch.ops.localllm_cpu, "gguf_linear"):  # on every CPU (a library from before: x86-64-v3 only)

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

        @torch.library.register_fake("localllm_cpu::gguf_moe_experts")
        def _(x, weights, ids, w13, w13_type, w3, w3_type, w2, w2_type, b13, b2, limit, alpha, levels):  # type: ignore[no-untyped-def]
            return x.new_empty(x.shape[0], x.shape[1])

    @torch.library.register_fake("localllm_cpu::dense_linear")
    def _(x, weight, bias=None):  # type: ignore[no-untyped-def]
        return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32)

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
    """Whether the GGUF block ops are built: on every CPU the library builds on (the x86
    kernels on x86-64-v3 and up, the generic ones elsewhere: ``gguf_kernels``)."""
    return load() and hasattr(torch.ops.localllm_cpu, "gguf_linear")


ISA_ENV = cpu_build.ISA_ENV  # "generic": the generic GGUF kernels even where the x86 ones are built


def gguf_kernels() -> str:
    """Which GGUF kernels an op called now runs, in words: the x86 ones as built here ("x86
    AVX-512 VNNI + AMX", "x86 AVX2", ...) or "generic" / "generic (Arm dot product)"
    (kernels/cpu/gguf/dispatch.h, the one place that chooses; ``LOCALLLM_CPU_ISA=generic``
    forces the generic ones). Raises LocalLLMError for another value of that variable."""
    from localllm.errors import LocalLLMError

    isa = os.environ.get(ISA_ENV, "")
    if isa not in ("", "auto", "generic"):
        raise LocalLLMError(f"{ISA_ENV}={isa} is not a choice: unset it (or auto) for this CPU's best GGUF"
                            " kernels, or set generic for the portable ones")
    if not has_gguf_kernels():
        return "none"
    if not hasattr(torch.ops.localllm_cpu, "gguf_kernels"):  # a library built before the generic kernels
        return "x86"
    return str(torch.ops.localllm_cpu.gguf_kernels())


def fast_bf16() -> bool:
    """bf16 matmuls beat fp32 here (AMX or AVX512-BF16); without them oneDNN emulates bf16."""
    return any(f in cpu_signature().split() for f in ("amx_bf16", "avx512_bf16"))
