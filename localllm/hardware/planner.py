"""The precision and memory planner the engine calls at start.

Given the hardware, a model's dims, the context wanted and how many chats run at once,
``plan()`` picks where to run, the weight precision (bf16, FP8, INT8 or AWQ 4-bit), the KV
dtype and pool size, the batch limits and whether to capture CUDA graphs. Every choice
carries a one-line reason. When nothing fits it raises :class:`DoesNotFit`, whose message
names the nearest plan that would (a shorter context, fewer chats, a smaller model).

The ladder: bf16 while it leaves room for the wanted KV; FP8 next on GPUs
with FP8 tensor cores (sm89+), INT8 weight-only on older ones; AWQ 4-bit last. Hopper and
datacenter Blackwell take the full path: FP8 first, CUDA graphs, the largest batch. A GGUF
checkpoint whose linears a kernel takes starts the ladder with its own blocks ("gguf": the
CPU's kernels, or the GPU's Triton ones in the compute dtype), sized from the file's tensors.

The KV cache is 16-bit (fp32 on CPU) while any rung leaves room for the wanted tokens; when
none does, GPUs with FP8 support walk the ladder again with an FP8 (e4m3) cache, which halves
the bytes per token (``_kv_passes``). ``kv_cache_dtype="fp8"`` asks for it outright.

On a GPU the budget is the free VRAM (what other processes hold is already out of it), less a
reserve for what the engine allocates beside the plan for a while (the torch candidate timed
when a GEMM is chosen, Triton's autotune buffer, cuBLAS workspaces: ``_reserve``) and a margin
for the desktop to grow, capped at ``gpu_memory_utilization`` of the card. Invariant: free VRAM
minus the plan's total is at least the reserve plus the margin, so a start never depends on
memory the plan did not count.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from localllm.errors import LocalLLMError
from localllm.hardware.probe import GiB, GPUInfo, Hardware, MemoryMeter, MiB, probe_hardware
from localllm.hardware.sizing import (
    DTYPE_BYTES,
    QUANTS,
    GGUFWeights,
    ModelDims,
    count_params,
    decode_read_bytes,
    gguf_catalog_weights,
    kv_bytes_per_token,
    param_counts,
    kv_cache_dtype_name,
    largest_matrix,
    weight_bytes,
    workspace_bytes,
)

__all__ = [
    "Beside",
    "DoesNotFit", "MemoryCheck", "MemoryMeter", "Plan", "compare_memory", "decode_tokens_per_s",
    "plan", "probe_hardware",
]

DEFAULT_CONTEXT = 8192  # planned for when no context is given (the probe's "chats at 8K" too)
CPU_RAM_FRACTION = 0.75  # of *available* RAM: the OS, the TUI and the browser need the rest
# Driver + kernels; outside torch's allocator. Always planned: NVML's free figure is read before
# this process makes its context; where only torch could read it (after making one), this
# counts it twice, 512 MiB on the safe side.
CUDA_CONTEXT_BYTES = 512 * MiB
# The captured decode graphs' private pool holds the largest bucket's activations and logits
# (graphs are captured largest first and share it); never planned below this floor, which also
# covers the static input buffers and allocator rounding.
CUDA_GRAPH_BYTES = 256 * MiB
# --- the GPU reserve: allocations beside the plan that come and go, kept free, never planned ---
# triton.testing.do_bench clears the L2 cache between runs by writing a 256 MiB buffer
# (the NVIDIA driver's get_empty_cache_for_benchmark), allocated for every autotuned shape.
TRITON_BENCH_BYTES = 256 * MiB
# torch's default cuBLAS workspace (CUBLAS_WORKSPACE_CONFIG ":4096:8" = 32 MiB on sm90+,
# ":4096:2:16:8" ~ 8 MiB before); cuBLASLt takes as much; each per stream: the default stream
# and the one CUDA graphs are captured on.
CUBLAS_WORKSPACE_BYTES = {True: 32 * MiB, False: 8 * MiB}  # by Hopper-or-newer
CUBLAS_HANDLES = 4
# The torch path a quantized GEMM is timed against at its first call (kernels/_triton.py
# gemm_backend_choice) dequantizes the whole weight: bytes alive per weight while it runs.
# AWQ (awq_dequantize): the unpacked int32 codes, their difference from the zeros and the fp32
# product (12); FP8 (w.float()) and INT8 (w.to(dtype) * scale) 4. A GGUF torch reference is
# taken to dequantize like AWQ.
CANDIDATE_BYTES_PER_WEIGHT = {"awq": 12, "gguf": 12, "fp8": 4, "int8": 4}
# Room for the desktop to grow after the plan is made (a browser tab, the compositor) and for
# the caching allocator's rounding: a share of the card, at least a floor.
GPU_MARGIN_FRACTION = 0.02
GPU_MARGIN_MIN_BYTES = 256 * MiB
# oneDNN scratch, thread pools, allocator slack, the tokenizer: measured on the real engine after its
# largest step (tests/hardware/test_hw_memory.py; fp32 and bf16 grew 80-84 MB past the rest of the
# plan). 63 MiB of that was Dynamo's modules, which the eager path no longer imports (2026-12-04:
# `run --json` of the default model without compiling grew 499 MiB instead of 562): they are in
# CPU_COMPILE_BYTES now, where the compile thread imports them
CPU_RUNTIME_BYTES = 49 * MiB
# torch.compile's decode graphs loaded from their saved files, as every start after the first
# runs (RSS growth of `localllm run --json` over the eager engine, default model, 2026-12-02,
# Xeon): 72-92 MiB for fp32, GGUF, bf16, int8 and int4 alike. The start that compiles them
# holds 146-158 MiB more (Dynamo's and Inductor's structures): CPU_FIRST_COMPILE_BYTES, which
# the memory check adds for that start only; one figure for both (170 MiB) had put every
# warm start 12-19% over its measure. With Dynamo's modules (63 MiB, see CPU_RUNTIME_BYTES).
CPU_COMPILE_BYTES = 148 * MiB
CPU_FIRST_COMPILE_BYTES = 150 * MiB
MIN_SUGGESTED_CONTEXT = 512
MEMORY_TOLERANCE = 0.10  # predicted against measured

_LABELS = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "fp8": "fp8"}


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def precision_label(weight_dtype: str, quant: str | None = None) -> str:
    """``fp32``/``bf16``/``fp16`` for a dtype name, or the quantization's label."""
    if quant == "awq":
        return "awq-int4"
    if quant:
        return quant
    return _LABELS.get(weight_dtype, weight_dtype)


@dataclass(frozen=True, slots=True)
class Beside:
    """Memory a second model of the same engine takes out of a plan's budget (a draft model):
    ``bytes`` whatever its size (weights, activations, CUDA graph pool), and
    ``kv_bytes_per_token`` for every token of the plan's KV pool, which its own pool mirrors
    block for block."""

    name: str
    bytes: int
    kv_bytes_per_token: int

    def bytes_for(self, kv_tokens: int) -> int:
        """All it takes beside a pool of ``kv_tokens`` tokens."""
        return self.bytes + kv_tokens * self.kv_bytes_per_token


NO_BESIDE = Beside("", 0, 0)


@dataclass(frozen=True, slots=True)
class Plan:
    """What the engine should build. Byte figures are predictions the engine can check.

    Immutable: ``plan()`` is its one writer, and every field, ``reasons`` and ``reserve``
    included, is read-only after it. What loading decides beyond the plan travels on the
    ``LoadedModel`` (``notes``), not here."""

    model: str
    device: str  # "cuda" or "cpu"
    weight_dtype: str  # "bfloat16", "float16" or "float32": storage of unquantized weights, and compute
    quant: str | None  # None, "fp8", "int8" or "awq"
    kv_dtype: str  # "float32", "bfloat16", "float16" or "fp8" (e4m3 with per-tensor scales)
    block_size: int
    num_kv_blocks: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    use_cuda_graphs: bool
    weight_bytes: int
    kv_bytes: int  # the whole pool: num_kv_blocks x block_size x kv_bytes_per_token
    kv_bytes_per_token: int
    workspace_bytes: int  # activations and logits of the largest step
    runtime_bytes: int  # CUDA graph pool on GPU, runtime allowance on CPU
    context_bytes: int  # the CUDA context: outside torch's allocator, so never in a measurement
    budget_bytes: int
    kv_capacity_tokens: int  # tokens the budget could hold at this precision (>= the pool)
    decode_read_bytes: int  # weight bytes one decode step reads
    reasons: tuple[str, ...]
    # GPU only (0 on CPU). What other processes held when planned (total - free), the engine's
    # transients kept free beside the plan (item -> bytes), and the margin for the desktop:
    # free VRAM - total_bytes >= reserve_bytes + margin_bytes.
    others_bytes: int = 0
    reserve: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    margin_bytes: int = 0
    # False: no room was kept to time a quantized GEMM's torch candidate; the engine should
    # run the Triton kernel without measuring (LOCALLLM_GEMM_BACKEND=triton does the same).
    time_gemm_candidates: bool = True
    # what the ``Beside`` model takes for this plan's pool size (0: none); in total_bytes, not
    # in expected_measured_bytes (that model is measured apart)
    beside_bytes: int = 0

    @property
    def precision(self) -> str:
        return precision_label(self.weight_dtype, self.quant)

    @property
    def precision_reason(self) -> str:
        """Why this precision: reasons are device, budget, precision, KV dtype, pool, context, batch, graphs."""
        return self.reasons[2]

    @property
    def kv_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    @property
    def reserve_bytes(self) -> int:
        return sum(self.reserve.values())

    @property
    def overhead_bytes(self) -> int:
        return self.workspace_bytes + self.runtime_bytes + self.context_bytes

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.overhead_bytes + self.beside_bytes

    @property
    def expected_measured_bytes(self) -> int:
        """What a MemoryMeter should see: RSS growth on CPU, max_memory_allocated on GPU."""
        return self.weight_bytes + self.kv_bytes + self.workspace_bytes + self.runtime_bytes

    def summary(self) -> str:
        lines = [
            f"{self.model} on {self.device}: {self.precision} weights,"
            f" KV cache {_LABELS.get(self.kv_dtype, self.kv_dtype)}",
            f"  memory: weights {fmt_bytes(self.weight_bytes)} + KV pool {fmt_bytes(self.kv_bytes)}"
            f" ({self.kv_tokens:,} tokens) + overhead {fmt_bytes(self.overhead_bytes)}"
            + (f" + draft model {fmt_bytes(self.beside_bytes)}" if self.beside_bytes else "")
            + f" = {fmt_bytes(self.total_bytes)} of a {fmt_bytes(self.budget_bytes)} budget"
            + (f"; kept free: reserve {fmt_bytes(self.reserve_bytes)} + margin {fmt_bytes(self.margin_bytes)}"
               if self.device == "cuda" else ""),
            f"  limits: {self.max_model_len:,} tokens per sequence, {self.max_num_seqs} sequences per step,"
            f" {self.max_num_batched_tokens:,} tokens per step, blocks of {self.block_size}"
            f"{', CUDA graphs' if self.use_cuda_graphs else ''}",
            "  why:",
        ]
        lines += [f"   - {r}" for r in self.reasons]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "device": self.device,
            "precision": self.precision,
            "weight_dtype": self.weight_dtype,
            "quant": self.quant,
            "kv_dtype": self.kv_dtype,
            "block_size": self.block_size,
            "num_kv_blocks": self.num_kv_blocks,
            "kv_tokens": self.kv_tokens,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "use_cuda_graphs": self.use_cuda_graphs,
            "weight_bytes": self.weight_bytes,
            "kv_bytes": self.kv_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "workspace_bytes": self.workspace_bytes,
            "runtime_bytes": self.runtime_bytes,
            "context_bytes": self.context_bytes,
            "overhead_bytes": self.overhead_bytes,
            "total_bytes": self.total_bytes,
            "expected_measured_bytes": self.expected_measured_bytes,
            "budget_bytes": self.budget_bytes,
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "decode_read_bytes": self.decode_read_bytes,
            "others_bytes": self.others_bytes,
            "reserve_bytes": self.reserve_bytes,
            "reserve": dict(self.reserve),
            "margin_bytes": self.margin_bytes,
            "time_gemm_candidates": self.time_gemm_candidates,
            "beside_bytes": self.beside_bytes,
            "reasons": list(self.reasons),
        }


class DoesNotFit(LocalLLMError):
    """Nothing on the ladder fits. ``nearest`` is a plan that would, when one exists."""

    def __init__(self, message: str, *, nearest: Plan | None, suggestions: list[str], needed_bytes: int,
                 kv_bytes_per_token: int | None = None) -> None:
        super().__init__(message)
        self.nearest = nearest
        self.suggestions = suggestions
        self.needed_bytes = needed_bytes
        self.kv_bytes_per_token = kv_bytes_per_token  # of the smallest plan tried


@dataclass(frozen=True, slots=True)
class _Rung:
    weight_dtype: str
    quant: str | None
    why: str  # completed with the fit figures once known


@dataclass(frozen=True, slots=True)
class _Target:
    device: str
    gpu: GPUInfo | None
    budget: int  # CPU: the budget; GPU: the cap, gpu_memory_utilization x VRAM
    where: str
    device_reason: str
    full_path: bool
    seqs_cap: int
    batched_tokens: int
    cpu_runtime: int = 0  # CPU only: what the runtime holds beside weights, KV and activations
    cpu_budget_reason: str = ""  # CPU only: a GPU's depends on the fit (its reserve)
    free: int = 0  # GPU only: free VRAM (other processes' use already out of it)
    others: int = 0  # GPU only: what other processes hold
    margin: int = 0  # GPU only: kept free for the desktop to grow
    util: float = 1.0
    beside: Beside = NO_BESIDE  # a draft model sharing the budget


@dataclass(frozen=True, slots=True)
class _Fit:
    rung: _Rung
    graphs: bool
    batched_tokens: int
    weights: int
    workspace: int
    runtime: int
    context: int
    kv_dtype: str
    kvpt: int
    capacity: int  # KV tokens the budget leaves room for, whole blocks only
    budget: int  # GPU: min(cap, free - reserve - margin); CPU: the target's
    reserve: dict[str, int]  # GPU transients kept free beside the plan; empty on CPU
    candidate: bool  # room is kept to time the GEMM choice's torch candidate

    @property
    def fixed(self) -> int:
        return self.weights + self.workspace + self.runtime + self.context


def _model_name(model: ModelDims) -> str:
    for attr in ("id", "name", "model_id"):
        value = getattr(model, attr, None)
        if isinstance(value, str) and value:
            return value
    return "the model"


def _model_max_context(model: ModelDims) -> int | None:
    for attr in ("max_context", "max_position_embeddings", "max_model_len"):
        value = getattr(model, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _validate(
    context: int | None, chats: int, quant: str | None, dtype: str | None, util: float, block_size: int
) -> None:
    if context is not None and (not isinstance(context, int) or context <= 0):
        raise LocalLLMError(f"context must be a positive number of tokens, got {context}")
    if not isinstance(chats, int) or chats < 1:
        raise LocalLLMError(f"chats must be at least 1, got {chats}")
    if quant is not None and quant not in QUANTS:
        raise LocalLLMError(f"unknown quantization {quant!r}; use one of {', '.join(QUANTS)} (or none)")
    if dtype is not None and dtype not in DTYPE_BYTES:
        raise LocalLLMError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPE_BYTES)} or auto")
    if not 0 < util <= 1:
        raise LocalLLMError(f"gpu_memory_utilization must be in (0, 1], got {util}")
    if block_size <= 0 or block_size & (block_size - 1):
        raise LocalLLMError(f"block_size must be a positive power of two, got {block_size}")


def _target(hw: Hardware, util: float) -> _Target:
    gpu = hw.gpu
    if gpu is not None:
        full_path = gpu.compute_capability[0] in (9, 10)  # Hopper, datacenter Blackwell
        # A free figure of 0 means none was read (some drivers): the card is taken as idle.
        free = gpu.free_bytes if 0 < gpu.free_bytes <= gpu.total_bytes else gpu.total_bytes
        # NVML's per-process figure where the driver gives one (total - free also counts the
        # driver's own reservation); the budget itself comes from free either way.
        others = gpu.others_bytes if gpu.others_bytes is not None else gpu.total_bytes - free
        held = f", {fmt_bytes(others)} held by other processes" if others > 0 else ""
        kind = "planned for, not present" if hw.hypothetical else f"driver {gpu.driver or '?'}"
        return _Target(
            device="cuda", gpu=gpu, budget=int(gpu.total_bytes * util),
            where=f"{gpu.name} ({fmt_bytes(gpu.total_bytes)}{held})",
            device_reason=(f"device cuda: {gpu.name}, {fmt_bytes(gpu.total_bytes)},"
                           f" compute capability {gpu.cc_str} ({kind})"),
            full_path=full_path,
            seqs_cap=256 if full_path else 64,
            batched_tokens=8192 if full_path or gpu.total_bytes >= 40 * GiB else 2048,
            free=free, others=others, util=util,
            margin=max(GPU_MARGIN_MIN_BYTES, int(gpu.total_bytes * GPU_MARGIN_FRACTION)),
        )
    why = next((n for n in hw.notes if n.startswith("no NVIDIA GPU")), "no NVIDIA GPU")
    budget = int(hw.ram_available_bytes * CPU_RAM_FRACTION)
    return _Target(
        device="cpu", gpu=None, budget=budget,
        where=f"this CPU ({fmt_bytes(budget)} RAM budget)",
        device_reason=f"device cpu: {why.split(';')[0]}",
        cpu_budget_reason=(f"RAM budget {fmt_bytes(budget)} = {CPU_RAM_FRACTION:.0%} of"
                           f" {fmt_bytes(hw.ram_available_bytes)} available"),
        full_path=False,
        # Concurrency is bounded by KV blocks actually held, not by slots; batching pays even
        # on 2 cores (8 streams gave ~2x one stream's throughput here).
        seqs_cap=64,
        batched_tokens=512,
    )


def _ladder(t: _Target, hw: Hardware, quant: str | None, dtype: str | None) -> list[_Rung]:
    if t.device == "cuda":
        gpu = t.gpu
        assert gpu is not None
        if dtype == "bfloat16" and not gpu.has_bf16:
            raise LocalLLMError(
                f"bfloat16 needs compute capability 8.0+, {gpu.name} is {gpu.cc_str}; use --dtype float16")
        compute = dtype or ("bfloat16" if gpu.has_bf16 else "float16")
        half, sm = _LABELS[compute], f"sm{gpu.cc_str.replace('.', '')}"
        if quant == "fp8" and not gpu.has_fp8_tensor_cores:
            why = f"fp8 as asked: weight storage only on {sm} (no FP8 tensor cores), dequantized to {half} for matmuls"
            return [_Rung(compute, "fp8", why)]
        if quant:
            return [_Rung(compute, quant, f"{precision_label(compute, quant)} as asked")]
        if t.full_path and dtype is None:
            return [
                _Rung(compute, "fp8", f"fp8 (W8A8): Hopper-class {sm} full path, FP8 tensor cores and half the"
                                      " weight reads of bf16"),
                _Rung(compute, "awq", "awq-int4: FP8 does not leave room for the wanted KV"),
            ]
        if gpu.has_fp8_tensor_cores:
            middle = _Rung(compute, "fp8", f"fp8 (W8A8): {half} does not leave room for the wanted KV, and {sm} has"
                                           " FP8 tensor cores")
        else:
            middle = _Rung(compute, "int8", f"int8 weight-only: {half} does not leave room for the wanted KV; no FP8"
                                            f" tensor cores on {sm}, so INT8 halves the weights")
        return [
            _Rung(compute, None, f"{half}: fits with room for the wanted KV"),
            middle,
            _Rung(compute, "awq", "awq-int4: nothing at 8 bits leaves room for the wanted KV"),
        ]
    cpu = hw.cpu
    if dtype is not None:
        preferred, why = dtype, f"{_LABELS[dtype]} as asked"
    elif cpu.bf16_fast:
        preferred = "bfloat16"
        isa = "AMX" if "amx_bf16" in cpu.flags else "AVX512-BF16"
        why = f"bf16 weights: {isa} makes bf16 matmuls ~2x faster than fp32 at batch 16 and halves RAM"
    else:
        preferred, why = "float32", "fp32 weights: no AVX512-BF16 or AMX, so bf16 matmuls would be slower than fp32"
    # The CPU int8/int4 kernels want bf16 activations; with fp32 ones they are 10-100x slower.
    qdtype = "bfloat16" if dtype is None else dtype
    slow = "" if cpu.bf16_fast else " (slow here: no native bf16)"
    if quant:
        return [_Rung(qdtype, quant, f"{precision_label(qdtype, quant)} as asked{slow}")]
    rungs = [_Rung(preferred, None, why)]
    if dtype is None and preferred == "float32":
        rungs.append(_Rung("bfloat16", None, "bf16 weights: fp32 does not leave room for the wanted KV"))
    rungs.append(_Rung(qdtype, "int8", f"int8 weight-only: 16-bit weights do not leave room for the wanted KV{slow}"))
    rungs.append(_Rung(qdtype, "awq", f"awq-int4: int8 does not leave room for the wanted KV{slow}"))
    return rungs


def _kv_passes(t: _Target, kv_cache_dtype: str) -> list[bool]:
    """Whether each walk down the ladder stores the KV cache in FP8.

    "auto" walks it with the 16-bit cache first (fp32 on CPU, where attention runs in fp32);
    only when no weight precision leaves room for the wanted tokens, a GPU with FP8 support
    (compute capability 8.9+) walks it again with FP8. On the CPU FP8 saves memory but no
    time (it is dequantized on read), so it is taken only when asked.
    """
    if kv_cache_dtype == "fp8":
        gpu = t.gpu
        if gpu is not None and not gpu.has_fp8_tensor_cores:
            raise LocalLLMError(
                f"an fp8 KV cache needs compute capability 8.9+ (RTX 40xx, L4, H100); {gpu.name} is {gpu.cc_str}:"
                " use --kv-cache-dtype auto")
        return [True]
    if t.gpu is not None and t.gpu.has_fp8_tensor_cores:
        return [False, True]
    return [False]


def _kv_reason(t: _Target, fit: _Fit, need: int, sixteen: _Fit | None, asked: bool) -> str:
    """The KV dtype line of the plan's reasons. ``sixteen`` is the smallest rung that was tried
    with a 16-bit cache, when the planner went on to FP8."""
    if fit.kv_dtype != "fp8":
        return ("KV cache fp32: the CPU attention runs in fp32" if t.device == "cpu"
                else f"KV cache {_LABELS[fit.kv_dtype]}, the activation dtype")
    if t.device == "cpu":
        return ("KV cache fp8 (e4m3) as asked: one byte per value, dequantized to fp32 on read, so it saves memory,"
                " not time")
    assert t.gpu is not None
    sm = f"sm{t.gpu.cc_str.replace('.', '')}"
    if asked or sixteen is None:
        return f"KV cache fp8 (e4m3) as asked: half the bytes per token of a 16-bit cache ({sm} supports FP8)"
    label = precision_label(sixteen.rung.weight_dtype, sixteen.rung.quant)
    return (f"KV cache fp8 (e4m3): a 16-bit cache leaves room for {sixteen.capacity:,} of {need:,} KV tokens even with"
            f" {label} weights; FP8 halves the bytes per token, and {sm} supports FP8")


def _reserve(model: ModelDims, t: _Target, rung: _Rung, batched_tokens: int, candidate: bool) -> dict[str, int]:
    """What the engine allocates on the GPU beside the plan, for a while, by item: kept free,
    never given to the KV pool. Figures from the model's shapes where they depend on them.
    ``candidate``: room to time the GEMM choice's torch candidate (a plan without it pins the
    Triton kernel, ``Plan.time_gemm_candidates``)."""
    assert t.gpu is not None
    hopper = t.gpu.compute_capability[0] >= 9
    items = {"cuBLAS/cuBLASLt workspaces": CUBLAS_HANDLES * CUBLAS_WORKSPACE_BYTES[hopper],
             "Triton autotune (do_bench cache-flush buffer)": TRITON_BENCH_BYTES}
    per_weight = CANDIDATE_BYTES_PER_WEIGHT.get(rung.quant or "")
    if per_weight and candidate:
        name, k, n = largest_matrix(model)
        # the dequantized weight, and the candidate's fp32 output at the largest step
        items[f"GEMM choice: torch candidate for {name} {k}x{n}"] = k * n * per_weight + batched_tokens * n * 4
    return items


def _graph_pool_bytes(model: ModelDims, t: _Target, act_dtype: str) -> int:
    """The CUDA graph pool: the largest decode bucket's activations and logits, at least the floor."""
    return max(CUDA_GRAPH_BYTES, workspace_bytes(model, act_dtype, t.seqs_cap, t.seqs_cap))


def _fit(model: ModelDims, t: _Target, rung: _Rung, graphs: bool, batched_tokens: int, chats: int,
         block_size: int, kv_fp8: bool = False, gguf: GGUFWeights | None = None, candidate: bool = True) -> _Fit:
    kv_dtype = "fp8" if kv_fp8 else "float32" if t.device == "cpu" else rung.weight_dtype
    act_dtype = "float32" if t.device == "cpu" else rung.weight_dtype
    weights = weight_bytes(model, rung.weight_dtype, rung.quant, gguf)
    workspace = workspace_bytes(model, act_dtype, batched_tokens, max(chats, t.seqs_cap),
                                logit_copies=1 if t.device == "cpu" else 2)
    reserve: dict[str, int] = {}
    budget = t.budget
    if t.device == "cuda":
        runtime = _graph_pool_bytes(model, t, act_dtype) if graphs else 0
        context = CUDA_CONTEXT_BYTES
        reserve = _reserve(model, t, rung, batched_tokens, candidate)
        budget = max(0, min(t.budget, t.free - t.margin - sum(reserve.values())))
    else:
        runtime, context = t.cpu_runtime, 0
        if rung.quant == "awq":  # the CPU kernel's own int4 layout beside the AWQ tensors
            c = param_counts(model)
            runtime += int(c.block_linear / 2 + c.awq_groups * 4)
    kvpt = kv_bytes_per_token(model, kv_dtype)
    free = budget - (weights + workspace + runtime + context + t.beside.bytes)
    capacity = max(0, free) // (kvpt + t.beside.kv_bytes_per_token) // block_size * block_size
    return _Fit(rung, graphs, batched_tokens, weights, workspace, runtime, context, kv_dtype, kvpt, capacity,
                budget, reserve, candidate and rung.quant in CANDIDATE_BYTES_PER_WEIGHT)


def _budget_reason(t: _Target, fit: _Fit) -> str:
    if t.gpu is None:
        return t.cpu_budget_reason
    total, reserve = t.gpu.total_bytes, sum(fit.reserve.values())
    held = f"; {fmt_bytes(t.others)} held by other processes" if t.others > 0 else ""
    if fit.budget < t.budget:
        return (f"budget {fmt_bytes(fit.budget)} = {fmt_bytes(t.free)} free (of {fmt_bytes(total)}{held})"
                f" - {fmt_bytes(reserve)} reserve for the engine's transients - {fmt_bytes(t.margin)} margin")
    return (f"budget {fmt_bytes(fit.budget)} = {t.util:.0%} of {fmt_bytes(total)} (gpu_memory_utilization"
            f" {t.util:.2f}); the other {fmt_bytes(t.free - fit.budget)} free{held} covers the"
            f" {fmt_bytes(reserve)} reserve and the {fmt_bytes(t.margin)} margin")


def _reserve_reason(t: _Target, fit: _Fit) -> str:
    items = ", ".join(f"{name} {fmt_bytes(n)}" for name, n in fit.reserve.items())
    graphs = f", CUDA graph pool {fmt_bytes(fit.runtime)}" if fit.graphs else ""
    return (f"reserve {fmt_bytes(sum(fit.reserve.values()))} kept free for the engine's transients ({items}),"
            f" and {fmt_bytes(t.margin)} for other processes to grow; planned beside weights and KV: CUDA context"
            f" {fmt_bytes(fit.context)}{graphs}, activations {fmt_bytes(fit.workspace)}")


def plan(
    model: ModelDims,
    hw: Hardware,
    *,
    context: int | None = None,
    chats: int = 1,
    quant: str | None = None,
    dtype: str | None = None,
    gpu_memory_utilization: float = 0.9,
    block_size: int = 16,
    kv_cache_dtype: str = "auto",
    suggest_models: bool = True,
    cpu_gguf: str | None = None,
    cpu_compile: bool = True,
    name: str | None = None,
    gguf: GGUFWeights | None = None,
    gpu_gguf: str | None = None,
    beside: Beside | None = None,
) -> Plan:
    """The plan for ``model`` on ``hw``. Raises LocalLLMError for bad input, DoesNotFit when
    nothing fits (with the nearest plan that would). ``cpu_gguf``: the checkpoint is a GGUF
    file whose blocks the CPU kernels run as they are, and the reason line saying which; a
    CPU plan then starts from "gguf". ``gpu_gguf``: the same for the GPU's Triton kernels; a
    CUDA plan then starts from "gguf" in the compute dtype. ``name`` is what messages and the
    plan call the model (default: the model's id or name attribute). ``kv_cache_dtype`` is
    "auto" (16-bit, FP8 where only that fits) or "fp8" ("fp8_e4m3"). ``gguf``: the GGUF
    checkpoint's tensors, which size a "gguf" plan (without them, the Q4_1 estimate); on a GPU
    as the Triton kernels hold them (``GGUFWeights.kernels``). ``beside``: a draft model
    that shares the budget: its fixed bytes and a mirror of every KV token planned come out of
    it before the KV pool is sized."""
    if dtype == "auto":
        dtype = None
    _validate(context, chats, quant, dtype, gpu_memory_utilization, block_size)
    try:
        kv_cache_dtype = kv_cache_dtype_name(kv_cache_dtype)
    except ValueError as e:
        raise LocalLLMError(str(e)) from None
    name = name or _model_name(model)
    model_max = _model_max_context(model)
    if context is not None and model_max is not None and context > model_max:
        raise LocalLLMError(
            f"context {context:,} is longer than {name}'s maximum of {model_max:,} tokens; use {model_max} or less")
    wanted = context if context is not None else min(model_max or DEFAULT_CONTEXT, DEFAULT_CONTEXT)
    need = wanted * chats
    t = _target(hw, gpu_memory_utilization)
    t = replace(t, cpu_runtime=CPU_RUNTIME_BYTES + (CPU_COMPILE_BYTES if cpu_compile else 0),
                beside=beside or NO_BESIDE)
    ladder = _ladder(t, hw, quant, dtype)
    if t.device == "cpu" and cpu_gguf and (quant in (None, "gguf")) and dtype is None:
        ladder = [_Rung("float32", "gguf", cpu_gguf)] + ([] if quant else ladder)
    if t.device == "cuda" and gpu_gguf and quant in (None, "gguf"):
        # the file's blocks, with activations in the compute dtype; the ladder follows for a
        # file that does not fit (awq-int4 is smaller than a Q8_0 file)
        ladder = [_Rung(ladder[0].weight_dtype, "gguf", gpu_gguf)] + ([] if quant else ladder)
    if gguf is not None and t.device == "cuda":
        gguf = replace(gguf, kernels="triton")  # a type those kernels lack is held at FALLBACK's size
    if gguf is not None:
        experts = f"; {gguf.expert_label}" if gguf.expert_label else ""
        sized = f" (sized from {gguf.source}: {gguf.label}, {fmt_bytes(gguf.tensor_bytes)}{experts})"
        ladder = [replace(r, why=r.why + sized) if r.quant == "gguf" else r for r in ladder]

    # Before a precision is given up, the cheaper knobs go first: a smaller prefill chunk
    # (its workspace), then the room to time the GEMM choice's torch candidate (the Triton
    # kernel is kept without timing: prefill may be slower, decode is not), then the CUDA graph pool.
    if t.device == "cuda":
        small = min(t.batched_tokens, 2048)
        knobs = ([(True, t.batched_tokens, True)] + ([(True, small, True)] if small < t.batched_tokens else [])
                 + [(True, small, False), (False, small, False)])
    else:
        knobs = [(False, t.batched_tokens, True)]
    tried: list[_Fit] = []
    chosen: _Fit | None = None
    sixteen: _Fit | None = None  # the smallest rung tried with a 16-bit cache, before FP8
    for kv_fp8 in _kv_passes(t, kv_cache_dtype):
        if tried:
            sixteen, tried = tried[-1], []
        for rung in ladder:
            for graphs, tokens, candidate in knobs:
                fit = _fit(model, t, rung, graphs, tokens, chats, block_size, kv_fp8, gguf, candidate)
                if fit.capacity >= need:
                    chosen = fit
                    break
            else:
                tried.append(fit)
                continue
            break
        if chosen is not None:
            break

    if chosen is None:
        raise _does_not_fit(model, hw, name, t, tried, wanted, chats, quant, dtype, gpu_memory_utilization,
                            block_size, kv_cache_dtype, model_max, suggest_models, gguf,
                            {"cpu_gguf": cpu_gguf, "gpu_gguf": gpu_gguf})

    # Say why each bigger rung was passed over, so "fp8" never looks arbitrary.
    with_kv = " with an fp8 KV cache" if sixteen is not None else ""
    skipped = "; ".join(
        f"{precision_label(f.rung.weight_dtype, f.rung.quant)}{with_kv} leaves room for {f.capacity:,} of {need:,}"
        " KV tokens"
        for f in tried
    )
    precision_reason = chosen.rung.why + (f" ({skipped})" if skipped else "")
    kv_dtype = chosen.kv_dtype
    reasons = [t.device_reason, _budget_reason(t, chosen), precision_reason,
               _kv_reason(t, chosen, need, sixteen, asked=kv_cache_dtype == "fp8")]
    per_chat = f"{chats} chat{'s' if chats > 1 else ''}"

    if t.device == "cuda":
        num_blocks = chosen.capacity // block_size
        if context is not None:
            max_len = context
            ctx_reason = f"max_model_len {max_len:,}: as asked"
        else:
            room = chosen.capacity // chats // block_size * block_size
            max_len = max(wanted, min(model_max or wanted, room))
            ctx_reason = (f"max_model_len {max_len:,}: no context given, and the KV pool holds the model's full"
                          f" {max_len:,} tokens for {per_chat}" if model_max is not None and max_len >= model_max
                          else f"max_model_len {max_len:,}: no context given; the KV pool holds that much"
                          f" for {per_chat}")
        pool_reason = (f"KV pool {num_blocks:,} blocks x {block_size} = {num_blocks * block_size:,} tokens"
                       f" ({fmt_bytes(num_blocks * block_size * chosen.kvpt)}): all that is left under the budget")
        seqs = max(chats, min(t.seqs_cap, num_blocks))
        seq_reason = (f"max_num_seqs {seqs}: " + ("Hopper-class full path, largest batch" if t.full_path
                      else "room for several chats and API clients per step"))
        pool = _graph_pool_bytes(model, t, chosen.rung.weight_dtype)
        graphs_reason = (f"CUDA graphs on: decode steps are replayed, not relaunched (pool ~{fmt_bytes(pool)}:"
                         f" {t.seqs_cap} sequences' activations and logits, at least {fmt_bytes(CUDA_GRAPH_BYTES)})"
                         if chosen.graphs else
                         f"CUDA graphs off: their {fmt_bytes(pool)} pool is needed for the KV cache")
        if not chosen.candidate and chosen.rung.quant in CANDIDATE_BYTES_PER_WEIGHT:
            name_, k, n = largest_matrix(model)
            skipped_bytes = k * n * CANDIDATE_BYTES_PER_WEIGHT[chosen.rung.quant] + chosen.batched_tokens * n * 4
            graphs_reason += (f"; no room kept for the GEMM choice's torch candidate ({name_} dequantized,"
                              f" {fmt_bytes(skipped_bytes)}): the Triton kernels run untimed (where the"
                              " candidate runs out of memory, the kernel is kept)")
        if chosen.batched_tokens < t.batched_tokens:
            seq_reason += (f"; {chosen.batched_tokens:,} tokens per step, not {t.batched_tokens:,}:"
                           " the larger prefill workspace is needed for the KV cache")
    else:
        num_blocks = -(-need // block_size)
        max_len = wanted
        ctx_reason = (f"max_model_len {max_len:,}: as asked" if context is not None
                      else f"max_model_len {max_len:,}: no context given"
                      + (f" (the model allows {model_max:,}; pass a context for more)"
                         if model_max and model_max > wanted else ""))
        pool_reason = (f"KV pool {num_blocks:,} blocks x {block_size} = {num_blocks * block_size:,} tokens"
                       f" ({fmt_bytes(num_blocks * block_size * chosen.kvpt)}): {max_len:,} tokens x {per_chat};"
                       f" the budget could hold {chosen.capacity:,}")
        seqs = max(chats, min(t.seqs_cap, num_blocks))
        seq_reason = (f"max_num_seqs {seqs}: batching pays on CPU too (8 streams gave ~2x one stream's throughput);"
                      " the KV pool, not this cap, bounds concurrency")
        graphs_reason = "CUDA graphs off: running on the CPU"
    reasons += [pool_reason, ctx_reason, seq_reason, graphs_reason]
    if t.device == "cuda":
        reasons.append(_reserve_reason(t, chosen))
    beside_bytes = 0
    if beside is not None:
        beside_bytes = beside.bytes_for(num_blocks * block_size)
        reasons.append(f"draft model {beside.name}: {fmt_bytes(beside_bytes)} of the budget ({fmt_bytes(beside.bytes)}"
                       f" weights and activations, {fmt_bytes(beside.kv_bytes_per_token)} of KV per token of this"
                       " pool, which its own mirrors)")

    return Plan(
        model=name,
        device=t.device,
        weight_dtype=chosen.rung.weight_dtype,
        quant=chosen.rung.quant,
        kv_dtype=kv_dtype,
        block_size=block_size,
        num_kv_blocks=num_blocks,
        max_model_len=max_len,
        max_num_seqs=seqs,
        max_num_batched_tokens=chosen.batched_tokens,
        use_cuda_graphs=t.device == "cuda" and chosen.graphs,
        weight_bytes=chosen.weights,
        kv_bytes=num_blocks * block_size * chosen.kvpt,
        kv_bytes_per_token=chosen.kvpt,
        workspace_bytes=chosen.workspace,
        runtime_bytes=chosen.runtime,
        context_bytes=chosen.context,
        budget_bytes=chosen.budget,
        kv_capacity_tokens=chosen.capacity,
        decode_read_bytes=decode_read_bytes(model, chosen.rung.weight_dtype, chosen.rung.quant, gguf),
        reasons=tuple(reasons),
        others_bytes=t.others,
        reserve=MappingProxyType(dict(chosen.reserve)),
        margin_bytes=t.margin,
        time_gemm_candidates=chosen.candidate or chosen.rung.quant not in CANDIDATE_BYTES_PER_WEIGHT,
        beside_bytes=beside_bytes,
    )


def _fits_as(p: Plan) -> str:
    """A nearest plan's numbers, for a suggestion: precision, weights (on a GPU the KV pool takes
    what is left, so the footprint alone reads "the whole budget") and footprint against its budget."""
    kv = " + fp8 KV" if p.kv_dtype == "fp8" else ""
    return (f"{p.precision}{kv}, weights {fmt_bytes(p.weight_bytes)}, {fmt_bytes(p.total_bytes)} of a"
            f" {fmt_bytes(p.budget_bytes)} budget")


def _does_not_fit(
    model: ModelDims, hw: Hardware, name: str, t: _Target, tried: list[_Fit], wanted: int, chats: int,
    quant: str | None, dtype: str | None, util: float, block_size: int, kv_cache_dtype: str, model_max: int | None,
    suggest_models: bool, gguf: GGUFWeights | None = None, gguf_lines: dict[str, str | None] | None = None,
) -> DoesNotFit:
    last = tried[-1]  # the smallest precision tried (with an FP8 cache, if one was tried)
    label = precision_label(last.rung.weight_dtype, last.rung.quant)
    if last.kv_dtype == "fp8":
        label += " with an fp8 KV cache"
    needed = last.fixed + wanted * chats * last.kvpt + t.beside.bytes_for(wanted * chats)
    # the nearest plans keep a GGUF file's blocks where this one would have (``gguf_lines``)
    kwargs: dict[str, Any] = dict(quant=quant, dtype=dtype, gpu_memory_utilization=util, block_size=block_size,
                                  kv_cache_dtype=kv_cache_dtype, suggest_models=False, gguf=gguf, **(gguf_lines or {}))
    suggestions: list[str] = []
    nearest: Plan | None = None
    per_chat = last.capacity // chats // 256 * 256
    if model_max is not None:
        per_chat = min(per_chat, model_max)
    if per_chat >= MIN_SUGGESTED_CONTEXT:
        try:
            nearest = plan(model, hw, context=per_chat, chats=chats, **kwargs)
            suggestions.append(f"context {per_chat:,} ({_fits_as(nearest)})")
        except LocalLLMError:
            pass
    if chats > 1 and last.capacity >= wanted:
        fewer = last.capacity // wanted
        try:
            alt = plan(model, hw, context=wanted, chats=fewer, **kwargs)
            suggestions.append(f"{fewer} chat{'s' if fewer > 1 else ''} at {wanted:,} tokens ({_fits_as(alt)})")
            nearest = nearest or alt
        except LocalLLMError:
            pass
    if (quant is not None or dtype is not None) and not suggestions:
        # A precision was pinned: the planner's own ladder (down to 4-bit) may fit as asked.
        try:
            alt = plan(model, hw, context=wanted, chats=chats, **{**kwargs, "quant": None, "dtype": None})
            suggestions.append(f"{alt.precision} weights at {wanted:,} tokens ({_fits_as(alt)})")
            nearest = nearest or alt
        except LocalLLMError:
            pass
    if suggest_models and gguf is None and quant != "gguf" and not any((gguf_lines or {}).values()):
        # A checkpoint in floats (or a smaller quantization of them) that does not fit may still
        # fit as the Q4_K_M GGUF users download (gpt-oss-20b or Qwen3-30B-A3B on a 24 GB card:
        # the ladder's awq-int4 leaves the experts in floats): the same model, so it goes first.
        own = _own_gguf(model, hw, wanted, chats, kwargs)
        if own is not None:
            suggestions.insert(0, own[0])
            nearest = nearest or own[1]
    if suggest_models:
        smaller = _smaller_catalog_model(model, hw, wanted, chats, kwargs)
        if smaller is not None:
            entry_id, alt = smaller
            suggestions.append(f"{entry_id} at {wanted:,} tokens ({_fits_as(alt)})")
            nearest = nearest or alt
    as_what = f"as {label}" if quant else f"even as {label}"
    tail = ("nearest that fits: " + "; ".join(suggestions)) if suggestions else "nothing smaller fits either"
    if t.gpu is not None:
        room = (f"budget {fmt_bytes(last.budget)} after a {fmt_bytes(sum(last.reserve.values()))} reserve for the"
                f" engine's transients")
    else:
        room = f"budget {fmt_bytes(last.budget)}"
    message = (f"{name} does not fit on {t.where} at {wanted:,} tokens x {chats} chat{'s' if chats > 1 else ''}"
               f" {as_what} (needs {fmt_bytes(needed)}, {room}); {tail}")
    return DoesNotFit(message, nearest=nearest, suggestions=suggestions, needed_bytes=needed,
                      kv_bytes_per_token=last.kvpt)


def _own_gguf(model: ModelDims, hw: Hardware, wanted: int, chats: int,
              kwargs: dict[str, Any]) -> tuple[str, Plan] | None:
    """The suggestion for ``model``'s own Q4_K_M GGUF (sized as ``gguf_catalog_weights`` sizes
    it: the published file where the catalog has its size), when that fits as asked; naming
    the catalog's GGUF repository where it lists one. None when it does not fit either."""
    try:
        alt = plan(model, hw, context=wanted, chats=chats,
                   **{**kwargs, "quant": "gguf", "dtype": None, "gguf": gguf_catalog_weights(model)})
    except LocalLLMError:
        return None
    repos = (getattr(model, "quantized", None) or {}).get("gguf") or ()
    where = f" from {repos[0]}" if repos else ""
    return f"its Q4_K_M GGUF{where} at {wanted:,} tokens ({_fits_as(alt)})", alt


def _smaller_catalog_model(
    model: ModelDims, hw: Hardware, wanted: int, chats: int, kwargs: dict[str, Any]
) -> tuple[str, Plan] | None:
    """The largest supported catalog model, smaller than ``model``, that fits as asked (a GGUF
    plan sized as that model's Q4_K_M)."""
    try:
        from localllm.catalog import load_catalog

        entries = list(load_catalog().values())
    except LocalLLMError:
        return None
    size = count_params(model)
    for entry in sorted(entries, key=lambda e: e.params, reverse=True):
        if not entry.supported or entry.params >= size or entry.max_context < wanted:
            continue
        as_gguf = kwargs.get("quant") == "gguf" or kwargs.get("cpu_gguf") or kwargs.get("gpu_gguf")
        gguf = gguf_catalog_weights(entry) if as_gguf else None
        try:
            return entry.id, plan(entry, hw, context=wanted, chats=chats, **{**kwargs, "gguf": gguf})
        except LocalLLMError:
            continue
    return None


def decode_tokens_per_s(p: Plan, bandwidth_gbs: float | None, context: int) -> float | None:
    """Upper bound on single-stream decode speed: bandwidth / bytes read per token
    (all weights once, plus the KV of ``context`` tokens)."""
    if not bandwidth_gbs:
        return None
    return bandwidth_gbs * 1e9 / (p.decode_read_bytes + p.kv_bytes_per_token * context)


@dataclass(frozen=True, slots=True)
class MemoryCheck:
    predicted_bytes: int
    actual_bytes: int
    error: float  # (actual - predicted) / predicted
    ok: bool

    def to_dict(self) -> dict[str, Any]:
        return {"predicted_bytes": self.predicted_bytes, "actual_bytes": self.actual_bytes,
                "error": round(self.error, 4), "ok": self.ok}


def compare_memory(p: Plan, actual_bytes: int, tolerance: float = MEMORY_TOLERANCE,
                   compiled_graphs: int = 0) -> MemoryCheck:
    """Predicted (``expected_measured_bytes``) against what a MemoryMeter measured.
    ``compiled_graphs``: decode graphs this process compiled rather than loaded (a first start
    holds CPU_FIRST_COMPILE_BYTES more)."""
    predicted = p.expected_measured_bytes + (CPU_FIRST_COMPILE_BYTES if compiled_graphs else 0)
    error = (actual_bytes - predicted) / predicted if predicted else float("inf")
    return MemoryCheck(predicted, actual_bytes, error, abs(error) <= tolerance)
