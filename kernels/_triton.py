"""Whether the Triton path can run: Triton imports, and the tensor lives on a CUDA device, or
on the CPU in rehearsal mode.

Rehearsal mode (``LOCALLLM_TRITON_ON_CPU=1``, which implies ``TRITON_INTERPRET=1``) sends CPU
tensors through the Triton path under the interpreter, posing as a GPU of compute capability
``REHEARSAL_CAPABILITY``: the model and the engine then run every kernel together, as a GPU
would, on a machine without one. It is for tests and bisecting, slow (~4 ms per inner-loop
iteration) and wrong for bf16 (the interpreter computes bf16 on raw bits).

Also the few helpers every kernel file shares: a stand-in ``triton``/``tl`` where Triton is
missing (so the kernel files still import and their torch references still run), launch
configs that collapse to one under the interpreter, and a per-shape "is the kernel faster than
the torch path" decision measured once on CUDA.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from localllm.kernels import tuning

# Before Triton is imported: the interpreter is chosen when each @triton.jit decorator runs.
if os.environ.get("LOCALLLM_TRITON_ON_CPU") == "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:  # Triton is Linux-only; macOS and Windows run the torch references.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the platform
    HAS_TRITON = False

    class _Stub:
        """Lets ``@triton.jit`` and ``tl.constexpr`` annotations evaluate without Triton; the
        decorated kernels are never launched because ``use_triton`` is False."""

        constexpr = int

        @staticmethod
        def jit(fn: Any = None, **_: Any) -> Any:
            return fn if fn is not None else (lambda f: f)

        def __getattr__(self, name: str) -> Any:
            raise RuntimeError(f"Triton is not installed (triton.{name})")

    triton = _Stub()  # type: ignore[assignment]
    tl = _Stub()  # type: ignore[assignment]

# Under TRITON_INTERPRET=1 the kernels run on CPU tensors, which is how CI tests them.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Read at call time (use_triton, capability, rehearsing), so tests can switch it per test.
REHEARSAL = HAS_TRITON and INTERPRET and os.environ.get("LOCALLLM_TRITON_ON_CPU") == "1"
if os.environ.get("LOCALLLM_TRITON_ON_CPU") == "1" and not REHEARSAL:
    import warnings

    warnings.warn(
        "LOCALLLM_TRITON_ON_CPU=1 is ignored: "
        + ("Triton is not installed" if not HAS_TRITON else "TRITON_INTERPRET is set, but not to 1"),
        stacklevel=1,
    )


def _rowwise_interpreter_dot() -> None:
    """The interpreter's ``tl.dot`` is numpy's fp32 matmul, whose BLAS sums a row's products
    in another order at another row of the tile on some CPUs (a Zen 4: rows 6-11 of every 12
    took other last bits), so a row's result moved with its batch there, which a GPU's MMA
    does not (an H200: the same bits alone and in batches of 40 and 512). Float dots are
    summed in fp64 and rounded once instead: the same result wherever the row sits."""
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def create_dot(self: Any, a: Any, b: Any, d: Any, input_precision: Any, max_num_imprecise_acc: Any) -> Any:
        if d.data.dtype != np.float32 or a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        exact = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64))
        return interpreter.TensorHandle((exact.astype(np.float32) + d.data).astype(np.float32), d.dtype.scalar)

    builder.create_dot = create_dot


if HAS_TRITON and INTERPRET:
    _rowwise_interpreter_dot()

# What a rehearsal poses as: Hopper, so every path (FP8 GEMM, FP8 KV) is taken.
REHEARSAL_CAPABILITY = (9, 0)

__all__ = [
    "HAS_TRITON",
    "INTERPRET",
    "REHEARSAL_CAPABILITY",
    "Config",
    "capability",
    "configs_for",
    "dot_fp32",
    "gemm_backend_choice",
    "gpu_tiles",
    "launch_configs",
    "next_power_of_2",
    "num_sms",
    "rehearsing",
    "round_half_even",
    "round_to_e4m3_grid",
    "scale_tensor",
    "tl",
    "triton",
    "use_triton",
]


def rehearsing() -> bool:
    """Whether CPU tensors take the Triton path (rehearsal mode; see the module docstring)."""
    return REHEARSAL


def use_triton(t: torch.Tensor) -> bool:
    return HAS_TRITON and (t.is_cuda or (REHEARSAL and t.device.type == "cpu"))


def gpu_tiles(t: torch.Tensor) -> bool:
    """Whether a launch takes the tile configs a GPU would (the autotuner's, collapsed to its
    first config under the interpreter): on CUDA, and in a rehearsal, which poses as a GPU.
    The interpreter's kernel tests keep small fixed tiles instead, which cost less there."""
    return REHEARSAL or (t.is_cuda and not INTERPRET)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def dot_fp32(t: torch.Tensor) -> bool:
    """Whether a kernel must upcast its tl.dot operands to fp32.

    The interpreter computes bf16 on raw uint16 values, so everything is upcast there; fp32
    inputs keep full IEEE precision (no TF32) so GPU results match the fp32 reference.
    """
    return INTERPRET or t.dtype == torch.float32


@functools.lru_cache(maxsize=None)
def _device_props(index: int) -> tuple[int, int, int]:
    p = torch.cuda.get_device_properties(index)
    return p.major, p.minor, p.multi_processor_count


def capability(t: torch.Tensor) -> tuple[int, int]:
    if not t.is_cuda:
        return REHEARSAL_CAPABILITY if REHEARSAL and t.device.type == "cpu" else (0, 0)
    major, minor, _ = _device_props(t.device.index or 0)
    return major, minor


def num_sms(t: torch.Tensor) -> int:
    """Streaming multiprocessors of the tensor's device; a nominal 8 under the interpreter, so
    the occupancy heuristics still pick split-K paths on tiny test shapes."""
    if not t.is_cuda:
        return 8
    return _device_props(t.device.index or 0)[2]


class Config:
    """A launch configuration: meta-parameters plus num_warps/num_stages.

    A plain class rather than ``triton.Config`` so the config tables exist without Triton.
    """

    __slots__ = ("hopper_only", "kwargs", "num_stages", "num_warps")

    def __init__(
        self, kwargs: dict[str, int], num_warps: int = 4, num_stages: int = 3, hopper_only: bool = False
    ) -> None:
        self.kwargs = kwargs
        self.num_warps = num_warps
        self.num_stages = num_stages
        # Tiles that need wgmma (accumulators outside the register file) or ~200 KB of shared
        # memory; on sm80/sm86/sm89 they spill or do not fit (bench/aot_check.py).
        self.hopper_only = hopper_only

    def to_triton(self) -> Any:
        return triton.Config(dict(self.kwargs), num_warps=self.num_warps, num_stages=self.num_stages)

    def __repr__(self) -> str:
        return f"Config({self.kwargs}, num_warps={self.num_warps}, num_stages={self.num_stages})"


def configs_for(t: torch.Tensor, configs: Sequence[Config]) -> list[Config]:
    """The configs this tensor's device can run well."""
    hopper = capability(t)[0] >= 9
    return [c for c in configs if hopper or not c.hopper_only]


def launch_configs(configs: Sequence[Config]) -> list[Config]:
    """Timing configs needs a GPU, so the interpreter gets the first (smallest-footprint)
    config only; a rehearsal gets the first two, "timed" by one run each
    (``_interpreted_bench``), so the autotuner's bookkeeping runs as on a GPU: shape keys,
    the on-disk choices (``tuning``), the progress line."""
    if not INTERPRET:
        return list(configs)
    return list(configs[: 2 if REHEARSAL else 1])


def _quick_bench(kernel_call: Callable[[], Any], quantiles: Any) -> Any:
    # Shorter than Triton's default 25 ms warm-up + 100 ms of repetitions: a model has a few
    # dozen (shape, batch bucket) keys to tune at start-up, and these kernels run for µs.
    from triton.testing import do_bench

    return do_bench(kernel_call, warmup=5, rep=20, quantiles=quantiles)


def _interpreted_bench(kernel_call: Callable[[], Any], quantiles: Any) -> list[float]:
    """One run (it must not fail), timed by the wall clock: under the interpreter the figure
    means nothing, and only decides between configs that all compute the same result."""
    import time

    t0 = time.perf_counter()
    kernel_call()
    ms = (time.perf_counter() - t0) * 1e3
    return [ms] * (len(quantiles) if quantiles else 1)


def tuning_identity() -> tuning.Identity:
    """What the choices measured here are valid for: the current CUDA device's name and
    compute capability; a rehearsal's own name (its choices mean nothing on a GPU)."""
    if torch.cuda.is_available() and not INTERPRET:
        index = torch.cuda.current_device()
        major, minor, _ = _device_props(index)
        return torch.cuda.get_device_name(index), major, minor
    return "rehearsal (Triton interpreter)", *REHEARSAL_CAPABILITY


def make_autotuner(fn: Any, configs: Sequence[Config], key: list[str], even_k: bool = True) -> Any:
    """Wraps a jitted kernel in ``triton.autotune`` whose choices persist in localllm's
    compiled cache per GPU, torch, Triton and kernel source (``tuning.PersistentConfigs``):
    only the first start on a machine tunes, and says so through ``tuning.reporting``.

    ``even_k`` adds the GEMM kernels' EVEN_K constexpr, derived from K and each config's
    BLOCK_K (so a caller never passes it to the tuned kernel).
    """
    kernel = fn
    if even_k:
        kernel = triton.heuristics({"EVEN_K": lambda a: a["K"] % a["BLOCK_K"] == 0})(fn)
    configs_t = [c.to_triton() for c in launch_configs(configs)]
    tuner = triton.autotune(configs=configs_t, key=key, do_bench=_interpreted_bench if INTERPRET else _quick_bench)(
        kernel
    )
    # Triton's own cache_results would keep them too, but keyed by architecture (an RTX 4090
    # and an L40 share sm89) and outside our cache folder: one store, ours.
    tuner.cache = tuning.PersistentConfigs(getattr(fn, "__name__", str(fn)), configs_t, tuning_identity)
    return tuner


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
ScaleArg = float | torch.Tensor | None  # an FP8 scale; None is 1.0

# FP8 scales given as python floats become 1-element device tensors once, so a call under
# CUDA-graph capture never does a host-to-device copy (pass tensors to avoid even the first).
_SCALES: dict[tuple[float, torch.device], torch.Tensor] = {}


def scale_tensor(s: ScaleArg, device: torch.device) -> torch.Tensor:
    if isinstance(s, torch.Tensor):
        if s.device == device and s.dtype == torch.float32 and s.numel() == 1:
            return s.reshape(1)
        return s.reshape(1).to(device=device, dtype=torch.float32)
    value = 1.0 if s is None else float(s)
    t = _SCALES.get((value, device))
    if t is None:
        t = _SCALES[(value, device)] = torch.tensor([value], dtype=torch.float32, device=device)
    return t


# --- per-shape backend choice -------------------------------------------------------------------

# LOCALLLM_GEMM_BACKEND=triton|torch pins the quantized GEMM dispatchers (benchmarks, bisecting);
# the default measures once per shape and keeps the faster.
_FORCED = os.environ.get("LOCALLLM_GEMM_BACKEND", "auto").lower()
_CHOICES: dict[tuple[Any, ...], str] = {}


def _time_ms(fn: Callable[[], Any], iters: int = 10) -> float:
    for _ in range(2):  # the first call may compile or autotune
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def gemm_backend_choice(key: tuple[Any, ...], candidates: dict[str, Callable[[], Any]]) -> str:
    """Name of the fastest candidate for this shape key, measured on first use and cached.

    The first candidate is the kernel; it is also the answer while a CUDA graph is being
    captured (timing would break the capture), under the interpreter (timing it means nothing,
    and a rehearsal is there to run the kernel) and when LOCALLLM_GEMM_BACKEND=triton. Every
    other candidate is a torch path; LOCALLLM_GEMM_BACKEND=torch picks the last one. A GPU's
    measurements persist (``tuning``): a later start on that GPU and torch measures nothing.
    """
    names = list(candidates)
    if _FORCED == "torch":
        return names[-1]
    if _FORCED == "triton":
        return names[0]
    hit = _CHOICES.get(key)
    if hit is not None:
        return hit
    if INTERPRET:  # nothing to measure; recorded all the same, so a rehearsal shows which shapes a start decides
        _CHOICES[key] = names[0]
        return names[0]
    saved = tuning.store(tuning_identity()).gemm.get(tuning.key_text(key))
    if saved in candidates:  # measured by an earlier start on this GPU and torch
        _CHOICES[key] = saved
        return saved
    if torch.cuda.is_current_stream_capturing():
        return names[0]
    tuning.note_tuning()
    times: dict[str, float] = {}
    out_of_memory = False
    for name, fn in candidates.items():
        try:
            times[name] = _time_ms(fn)
        except torch.OutOfMemoryError:
            # A candidate (or the kernel's autotuning) that does not fit beside the KV cache is
            # not chosen now, and the choice is not saved: with memory free it may win.
            out_of_memory = True
            times[name] = float("inf")
            torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001 - a candidate the device cannot run is simply not chosen
            times[name] = float("inf")
    if out_of_memory and min(times.values()) == float("inf"):
        from localllm.errors import LocalLLMError

        raise LocalLLMError(
            f"out of GPU memory choosing the matmul kernel for {key[0]} (M bucket, N, K = {key[1:4]}): close"
            " programs that hold VRAM, or pass a shorter --context or a lower --gpu-memory-utilization")
    best = min(times, key=times.__getitem__)
    _CHOICES[key] = best
    if not out_of_memory:
        tuning.store(tuning_identity()).put_gemm(tuning.key_text(key), best)
    return best


def gemm_choices() -> dict[tuple[Any, ...], str]:
    """The decisions made so far (for benchmarks and logs)."""
    return dict(_CHOICES)


def m_bucket(m: int) -> int:
    """Shape decisions are keyed by a power-of-two bucket of M so decode batch sizes 1..512
    cost a handful of measurements, not one each."""
    return min(next_power_of_2(m), 1024)


# One int32 counter per output tile, for split-K kernels whose last-arriving program does the
# reduction. Programs reset their counter after use, so a buffer is zero between launches; one
# buffer per device is safe because kernels on one stream never overlap.
_SPLITK_LOCKS: dict[torch.device, torch.Tensor] = {}


def splitk_locks(device: torch.device, n: int) -> torch.Tensor:
    locks = _SPLITK_LOCKS.get(device)
    if locks is None or locks.numel() < n:
        locks = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _SPLITK_LOCKS[device] = locks
    return locks


@triton.jit
def round_to_e4m3_grid(x):
    """Rounds fp32 values (already clamped to +-448) to the nearest e4m3 value, ties to even.

    Only for the interpreter: its fp32 -> fp8 cast drops the carry when rounding crosses a power
    of two (127.9 becomes 64). After this the cast is exact. GPUs cast correctly in hardware.
    """
    a = tl.abs(x)
    e = tl.maximum(tl.floor(tl.math.log2(tl.maximum(a, 1e-30))), -6.0)
    step = tl.math.exp2(e - 3.0)
    t = a / step
    f = tl.floor(t)
    d = t - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
    r = (f + tl.where((d > 0.5) | ((d == 0.5) & odd), 1.0, 0.0)) * step
    return tl.where(x < 0, -r, r)


@triton.jit
def round_half_even(x):
    """Round to nearest integer, ties to even (torch.round's rule), in fp32 arithmetic; a
    float-to-int cast alone would truncate toward zero."""
    f = tl.floor(x)
    d = x - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
    return f + tl.where((d > 0.5) | ((d == 0.5) & odd), 1.0, 0.0)


# ---- the tile schedule the GEMM kernels share (awq_gemm, int8_gemm) ----


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program id -> (tile row, tile column) in grouped order: GROUP_M consecutive programs
    walk down one column of tiles, so the weight columns they read stay in L2."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pids_per_group = GROUP_M * num_pid_n
    first_m = (pid // pids_per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % pids_per_group) % group_rows
    pid_n = (pid % pids_per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def split_k_range(K, pid_k, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """The K tiles [lo, hi) that split pid_k of SPLIT_K accumulates."""
    k_tiles = tl.cdiv(K, BLOCK_K)
    tiles_per_split = tl.cdiv(k_tiles, SPLIT_K)
    lo = pid_k * tiles_per_split
    return lo, tl.minimum(lo + tiles_per_split, k_tiles)


@triton.jit
def split_k_sum(
    acc, ws_ptr, locks_ptr, pid_k, pid_m, pid_n, offs_m, offs_n, M, N, mask,
    BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
):
    """Publishes this split's partial tile to the workspace and counts arrivals on the tile's
    lock. Returns (sum over all splits, True) to the last split to arrive, which then owns the
    epilogue, and (its own partial, False) to the others. Sums stay in acc's type, so int32
    stays exact. The last split resets the lock for the next launch.

    Ordering (the interpreter runs programs one after another, so only a GPU can break it):
    every thread of the program stores a slice of the partial tile, but the scalar atomic is
    issued by one thread. So (1) ``debug_barrier`` (bar.sync: CTA-scope ordering of all the
    program's stores before it) precedes the atomic, and (2) the atomic is a release at GPU
    scope (``acq_rel``, scope "gpu"), which is cumulative: it publishes the whole program's
    stores, not only its own thread's, to the program that acquires the counter. On the
    reducing side the acquire is again one thread's; the arrival count reaches the others
    through shared memory behind a bar.sync that Triton emits, so their workspace loads come
    after the acquire. The workspace loads use ``.cg`` (L2, not the SM's non-coherent L1).
    This is CUTLASS's semaphore pattern (syncthreads, then one thread's release). Without (1),
    a thread that had not yet stored its slice could be overtaken by the counter, and the last
    program would sum a stale partial: a result wrong now and then, under load.
    bench/aot_check.py checks the compiled PTX for bar.sync between the stores and the atom."""
    offs_ws = offs_m[:, None] * N + offs_n[None, :]
    tl.store(ws_ptr + pid_k * M * N + offs_ws, acc, mask=mask)
    tile = pid_m * tl.cdiv(N, BLOCK_N) + pid_n
    tl.debug_barrier()  # every thread's partial is stored before the one thread counts arrival
    arrived = tl.atomic_add(locks_ptr + tile, 1, sem="acq_rel", scope="gpu")
    last = arrived == SPLIT_K - 1
    if last:
        acc = tl.load(ws_ptr + offs_ws, mask=mask, other=0, cache_modifier=".cg")
        for s_idx in range(1, SPLIT_K):
            acc += tl.load(ws_ptr + s_idx * M * N + offs_ws, mask=mask, other=0, cache_modifier=".cg")
        tl.atomic_xchg(locks_ptr + tile, 0)
    return acc, last
