"""What this machine has: CPU and its ISA, RAM, and GPUs (NVML first, torch as a cross-check).

``probe_hardware()`` never raises: a machine without a driver, without pynvml or even
without torch still gets a clean CPU profile whose ``notes`` say why no GPU was used.
``hardware_for_gpu()`` builds the same profile for a GPU the user does not have, from a
table of known cards, so the planner can answer "what would fit on an RTX 4090?".
"""

from __future__ import annotations

import contextlib
import difflib
import os
import platform
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Any

from localllm.errors import LocalLLMError

GiB = 1 << 30
MiB = 1 << 20

# ISA flags that change what the CPU path should do; everything else in /proc/cpuinfo is noise.
_INTERESTING_FLAGS = (
    "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
    "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8", "neon", "asimd", "sve",
)


@dataclass(frozen=True, slots=True)
class KnownGPU:
    name: str
    vram_gib: float
    bandwidth_gbs: float
    compute_capability: tuple[int, int]
    aliases: tuple[str, ...] = ()


def _g(name: str, vram: float, bw: float, cc: tuple[int, int], *extra: str) -> KnownGPU:
    base = _norm(name)
    aliases = {base, *(_norm(e) for e in extra)}
    # People type "4090" as often as "RTX 4090".
    for prefix in ("rtx", "gtx"):
        if base.startswith(prefix) and len(base) > len(prefix):
            aliases.add(base[len(prefix):])
    return KnownGPU(name, vram, bw, cc, tuple(sorted(aliases)))


def _norm(name: str) -> str:
    s = name.lower()
    for word in ("nvidia", "geforce", "tesla", "quadro"):
        s = s.replace(word, "")
    return re.sub(r"[^a-z0-9]", "", s)


# Memory bandwidth is the vendor's peak figure; decode speed is bounded by it. VRAM in GiB,
# because that is what "24 GB" on a card means and what NVML reports.
KNOWN_GPUS: tuple[KnownGPU, ...] = (
    _g("RTX 5090", 32, 1792, (12, 0)),
    _g("RTX 5080", 16, 960, (12, 0)),
    _g("RTX 4090", 24, 1008, (8, 9)),
    _g("RTX 4080 Super", 16, 736, (8, 9)),
    _g("RTX 4080", 16, 716.8, (8, 9)),
    _g("RTX 4070 Ti Super", 16, 672, (8, 9)),
    _g("RTX 4070 Ti", 12, 504, (8, 9)),
    _g("RTX 4070 Super", 12, 504, (8, 9)),
    _g("RTX 4070", 12, 504, (8, 9)),
    _g("RTX 4060 Ti", 8, 288, (8, 9)),
    _g("RTX 4060 Ti 16GB", 16, 288, (8, 9), "RTX 4060 Ti"),
    _g("RTX 4060", 8, 272, (8, 9)),
    _g("RTX 3090 Ti", 24, 1008, (8, 6)),
    _g("RTX 3090", 24, 936, (8, 6)),
    _g("RTX 3080 Ti", 12, 912, (8, 6)),
    _g("RTX 3080", 10, 760, (8, 6)),
    _g("RTX 3080 12GB", 12, 912, (8, 6), "RTX 3080"),
    _g("RTX 3070 Ti", 8, 608, (8, 6)),
    _g("RTX 3070", 8, 448, (8, 6)),
    _g("RTX 3060 Ti", 8, 448, (8, 6)),
    _g("RTX 3060", 12, 360, (8, 6)),
    _g("RTX 2080 Ti", 11, 616, (7, 5)),
    _g("RTX 2080", 8, 448, (7, 5)),
    _g("RTX 2070", 8, 448, (7, 5)),
    _g("RTX 2060", 6, 336, (7, 5)),
    _g("RTX 6000 Ada", 48, 960, (8, 9), "RTX 6000 Ada Generation"),
    _g("RTX A6000", 48, 768, (8, 6), "A6000"),
    _g("RTX A5000", 24, 768, (8, 6), "A5000"),
    _g("RTX A4000", 16, 448, (8, 6), "A4000"),
    _g("L40S", 48, 864, (8, 9)),
    _g("L40", 48, 864, (8, 9)),
    _g("L4", 24, 300, (8, 9)),
    _g("A10G", 24, 600, (8, 6)),
    _g("A10", 24, 600, (8, 6)),
    _g("T4", 15, 320, (7, 5)),
    _g("V100", 16, 900, (7, 0)),
    _g("V100 32GB", 32, 900, (7, 0), "V100"),
    _g("A100 80GB", 80, 2039, (8, 0), "A100"),
    _g("A100 40GB", 40, 1555, (8, 0), "A100"),
    _g("H100", 80, 3350, (9, 0), "H100 SXM", "H100 80GB HBM3"),
    _g("H100 PCIe", 80, 2000, (9, 0)),
    _g("H100 NVL", 94, 3900, (9, 0)),
    _g("H200", 140, 4800, (9, 0), "H200 SXM"),
    _g("B200", 180, 8000, (10, 0)),
)


def find_known_gpu(name: str, vram_bytes: int | None = None) -> KnownGPU | None:
    """Best table entry for a device name as NVML reports it ("NVIDIA GeForce RTX 4090").

    The longest alias contained in the name wins (so "RTX 4060 Ti" beats "RTX 4060"); cards
    sold in two sizes share an alias and the VRAM picks between them.
    """
    key = _norm(name)
    best: list[tuple[int, KnownGPU]] = []
    for gpu in KNOWN_GPUS:
        hits = [len(a) for a in gpu.aliases if a and a in key]
        if hits:
            best.append((max(hits), gpu))
    if not best:
        return None
    top = max(length for length, _ in best)
    tied = [gpu for length, gpu in best if length == top]
    if vram_bytes and len(tied) > 1:
        return min(tied, key=lambda g: abs(g.vram_gib * GiB - vram_bytes))
    return tied[0]


def lookup_gpu(name: str) -> KnownGPU:
    """Exact lookup for a name the user typed; unknown names are a one-line LocalLLMError."""
    key = _norm(name)
    for gpu in KNOWN_GPUS:
        if key and key in gpu.aliases:
            return gpu
    names = [g.name for g in KNOWN_GPUS]
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(repr(c) for c in close)}? " if close else ""
    raise LocalLLMError(
        f"unknown GPU {name!r}: {hint}known GPUs: {', '.join(names)}; or give --vram GiB for any other card"
    )


@dataclass(frozen=True, slots=True)
class CPUInfo:
    model: str
    physical_cores: int
    logical_cores: int
    flags: frozenset[str]
    arch: str

    @property
    def bf16_fast(self) -> bool:
        """Native bf16 dot products (AVX512-BF16 or AMX): bf16 GEMM beats fp32 there."""
        return bool({"avx512_bf16", "amx_bf16"} & self.flags)

    def isa_summary(self) -> str:
        names = {
            "avx2": "AVX2", "avx512f": "AVX-512", "avx512_vnni": "AVX512-VNNI",
            "avx512_bf16": "AVX512-BF16", "avx512_fp16": "AVX512-FP16", "amx_bf16": "AMX-BF16",
            "amx_int8": "AMX-INT8", "neon": "NEON", "asimd": "NEON", "sve": "SVE",
        }
        seen: list[str] = []
        for flag, label in names.items():
            if flag in self.flags and label not in seen:
                seen.append(label)
        return ", ".join(seen) if seen else "no AVX2"


@dataclass(frozen=True, slots=True)
class GPUInfo:
    index: int
    name: str
    total_bytes: int
    free_bytes: int
    compute_capability: tuple[int, int]
    backend: str  # "cuda" (NVIDIA), "rocm" or "mps"; the engine runs on "cuda" only
    driver: str | None = None
    bandwidth_gbs: float | None = None
    bandwidth_source: str = "none"  # "table", "nvml" (clock x bus width) or "none"
    source: str = "nvml"  # "nvml", "torch" or "table" (a card planned for, not present)

    @property
    def cc_str(self) -> str:
        return f"{self.compute_capability[0]}.{self.compute_capability[1]}"

    @property
    def has_fp8_tensor_cores(self) -> bool:
        return self.compute_capability >= (8, 9)

    @property
    def has_bf16(self) -> bool:
        return self.compute_capability >= (8, 0)


@dataclass(frozen=True, slots=True)
class Hardware:
    cpu: CPUInfo
    ram_total_bytes: int
    ram_available_bytes: int
    gpus: tuple[GPUInfo, ...] = ()
    notes: tuple[str, ...] = ()
    hypothetical: bool = False  # planning for a card named with --gpu/--vram, not this machine

    @property
    def gpu(self) -> GPUInfo | None:
        """The GPU the engine would use: the first NVIDIA (CUDA) device."""
        for g in self.gpus:
            if g.backend == "cuda":
                return g
        return None

    @property
    def device(self) -> str:
        return "cuda" if self.gpu is not None else "cpu"

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "hypothetical": self.hypothetical,
            "cpu": {
                "model": self.cpu.model,
                "arch": self.cpu.arch,
                "physical_cores": self.cpu.physical_cores,
                "logical_cores": self.cpu.logical_cores,
                "flags": sorted(self.cpu.flags),
                "bf16_fast": self.cpu.bf16_fast,
            },
            "ram": {"total_bytes": self.ram_total_bytes, "available_bytes": self.ram_available_bytes},
            "gpus": [
                {
                    "index": g.index,
                    "name": g.name,
                    "backend": g.backend,
                    "total_bytes": g.total_bytes,
                    "free_bytes": g.free_bytes,
                    "compute_capability": g.cc_str,
                    "driver": g.driver,
                    "bandwidth_gbs": g.bandwidth_gbs,
                    "bandwidth_source": g.bandwidth_source,
                    "source": g.source,
                }
                for g in self.gpus
            ],
            "notes": list(self.notes),
        }


def _probe_cpu() -> CPUInfo:
    model = ""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                if key == "model name" and not model:
                    model = value.strip()
                elif key in ("flags", "features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass  # not Linux: fall back to what torch can tell
    if not flags:
        try:
            import torch

            cap = torch.backends.cpu.get_cpu_capability().lower()  # "avx512", "avx2", "default"
            if cap.startswith("avx512"):
                flags |= {"avx2", "avx512f"}
            elif cap.startswith("avx2"):
                flags.add("avx2")
            if platform.machine().lower() in ("arm64", "aarch64"):
                flags.add("neon")
            if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
                flags.add("avx512_bf16")
        except Exception:  # noqa: BLE001 - a probe must not fail on an odd torch build
            pass
    try:
        import psutil

        logical = psutil.cpu_count(logical=True) or os.cpu_count() or 1
        physical = psutil.cpu_count(logical=False) or logical
    except Exception:  # noqa: BLE001
        logical = physical = os.cpu_count() or 1
    return CPUInfo(
        model=model or platform.processor() or platform.machine() or "unknown CPU",
        physical_cores=int(physical),
        logical_cores=int(logical),
        flags=frozenset(f for f in flags if f in _INTERESTING_FLAGS),
        arch=platform.machine() or "unknown",
    )


def cpus_for_threads(threads: int, allowed: set[int] | None = None,
                     core_of: Callable[[int], tuple[str, str]] | None = None) -> list[int] | None:
    """One CPU for each of ``threads`` compute threads, each on its own physical core, from the
    CPUs this process may use (``allowed``, default its affinity), lowest core first: what
    OpenMP's ``OMP_PLACES=cores OMP_PROC_BIND=close`` would give, but chosen after start-up,
    for the thread that runs the forward. ``core_of(cpu)``: (package, core) ids, default from
    sysfs. None where binding cannot help or is not possible: one thread, more threads than
    cores, or no affinity API (not Linux)."""
    if threads < 2 or not hasattr(os, "sched_getaffinity"):
        return None
    allowed = os.sched_getaffinity(0) if allowed is None else allowed
    core_of = core_of or _sysfs_core
    first: dict[tuple[str, str], int] = {}
    for cpu in sorted(allowed):
        first.setdefault(core_of(cpu), cpu)
    cpus = sorted(first.values())
    return cpus[:threads] if threads <= len(cpus) else None


def _sysfs_core(cpu: int) -> tuple[str, str]:
    """(package, core) of a logical CPU; a CPU sysfs does not describe is its own core."""
    base = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
    try:
        with open(base + "physical_package_id") as pkg, open(base + "core_id") as core:
            return pkg.read().strip(), core.read().strip()
    except OSError:
        return "cpu", str(cpu)


def _probe_ram() -> tuple[int, int]:
    try:
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.total), int(vm.available)
    except Exception:  # noqa: BLE001
        return 0, 0


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _probe_nvml() -> tuple[list[GPUInfo], str | None]:
    """NVIDIA GPUs through NVML, or ([], why not)."""
    try:
        import pynvml
    except ImportError as e:
        return [], f"nvidia-ml-py is not installed ({e})"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return [], f"NVML: {e}"
    gpus: list[GPUInfo] = []
    try:
        try:
            driver: str | None = _text(pynvml.nvmlSystemGetDriverVersion())
        except pynvml.NVMLError:
            driver = None
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = _text(pynvml.nvmlDeviceGetName(h))
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            try:
                cc = tuple(int(x) for x in pynvml.nvmlDeviceGetCudaComputeCapability(h))
            except pynvml.NVMLError:
                cc = (0, 0)
            bw, bw_src = _bandwidth_for(name, int(mem.total), h)
            gpus.append(
                GPUInfo(
                    index=i, name=name, total_bytes=int(mem.total), free_bytes=int(mem.free),
                    compute_capability=(cc[0], cc[1]), backend="cuda", driver=driver,
                    bandwidth_gbs=bw, bandwidth_source=bw_src, source="nvml",
                )
            )
    except pynvml.NVMLError as e:
        return gpus, f"NVML: {e}"
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()
    if not gpus:
        return [], "NVML found no NVIDIA GPU"
    return gpus, None


def _bandwidth_for(name: str, total: int, handle: Any = None) -> tuple[float | None, str]:
    known = find_known_gpu(name, total)
    if known is not None:
        return known.bandwidth_gbs, "table"
    if handle is not None:
        # Unknown card: peak = memory clock x 2 (double data rate) x bus width.
        try:
            import pynvml

            clock_mhz = pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_MEM)
            bus_bits = pynvml.nvmlDeviceGetMemoryBusWidth(handle)
            if clock_mhz and bus_bits:
                return clock_mhz * 1e6 * 2 * bus_bits / 8 / 1e9, "nvml"
        except Exception:  # noqa: BLE001 - older drivers lack these calls
            pass
    return None, "none"


def _probe_torch(nvml_gpus: list[GPUInfo]) -> tuple[list[GPUInfo], list[str]]:
    """Cross-check NVML with torch, and report ROCm and MPS devices that NVML cannot see."""
    notes: list[str] = []
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        return [], [f"torch is not importable ({type(e).__name__}); GPU cross-check skipped"]
    extra: list[GPUInfo] = []
    try:
        hip = getattr(torch.version, "hip", None)
        if torch.cuda.is_available():
            count = torch.cuda.device_count()
            if hip:
                for i in range(count):
                    props = torch.cuda.get_device_properties(i)
                    free, total = torch.cuda.mem_get_info(i)
                    extra.append(GPUInfo(
                        index=i, name=props.name, total_bytes=int(total), free_bytes=int(free),
                        compute_capability=(props.major, props.minor), backend="rocm", source="torch",
                    ))
                notes.append("ROCm GPU reported by torch; the engine runs on NVIDIA CUDA only for now")
            elif not nvml_gpus:
                # CUDA works but NVML does not (containers without libnvidia-ml): trust torch.
                for i in range(count):
                    props = torch.cuda.get_device_properties(i)
                    free, total = torch.cuda.mem_get_info(i)
                    bw, src = _bandwidth_for(props.name, int(total))
                    extra.append(GPUInfo(
                        index=i, name=props.name, total_bytes=int(total), free_bytes=int(free),
                        compute_capability=(props.major, props.minor), backend="cuda",
                        bandwidth_gbs=bw, bandwidth_source=src, source="torch",
                    ))
                notes.append("NVML is unavailable but torch sees CUDA; using torch's device figures")
            elif count != len(nvml_gpus):
                notes.append(f"NVML sees {len(nvml_gpus)} GPU(s) but torch sees {count} (CUDA_VISIBLE_DEVICES?)")
        elif nvml_gpus:
            notes.append(f"NVML sees a GPU but torch {torch.__version__} has no CUDA (a CPU-only torch build?)")
        mps = getattr(torch.backends, "mps", None)
        if mps is not None and mps.is_available():
            total, _ = _probe_ram()
            extra.append(GPUInfo(
                index=0, name="Apple GPU (MPS)", total_bytes=total, free_bytes=total,
                compute_capability=(0, 0), backend="mps", source="torch",
            ))
            notes.append("Apple MPS reported by torch; the engine does not run on MPS yet")
    except Exception as e:  # noqa: BLE001
        notes.append(f"torch GPU cross-check failed: {type(e).__name__}: {e}")
    return extra, notes


def probe_hardware() -> Hardware:
    """This machine. Never raises; with no usable GPU the notes say why (NVML's own words)."""
    cpu = _probe_cpu()
    total, available = _probe_ram()
    notes: list[str] = []
    try:
        nvml_gpus, why = _probe_nvml()
    except Exception as e:  # noqa: BLE001 - a broken driver must not break the app
        nvml_gpus, why = [], f"NVML failed: {type(e).__name__}: {e}"
    torch_gpus, torch_notes = _probe_torch(nvml_gpus)
    gpus = nvml_gpus + torch_gpus
    if not any(g.backend == "cuda" for g in gpus):
        notes.append(f"no NVIDIA GPU: {why or 'none found'}; planning for the CPU")
    notes.extend(torch_notes)
    return Hardware(
        cpu=cpu, ram_total_bytes=total, ram_available_bytes=available,
        gpus=tuple(gpus), notes=tuple(notes),
    )


def hardware_for_gpu(name: str | None = None, vram_gib: float | None = None, base: Hardware | None = None) -> Hardware:
    """A profile with a GPU this machine may not have: a known card by name, or any card by VRAM."""
    if vram_gib is not None and not (vram_gib > 0):
        raise LocalLLMError(f"--vram must be a positive number of GiB, got {vram_gib}")
    base = base if base is not None else probe_hardware()
    notes = ["planning for a GPU this machine does not have; it is assumed otherwise idle"]
    if name:
        known = lookup_gpu(name)
        total = int((vram_gib if vram_gib is not None else known.vram_gib) * GiB)
        gpu = GPUInfo(
            index=0, name=known.name, total_bytes=total, free_bytes=total,
            compute_capability=known.compute_capability, backend="cuda",
            bandwidth_gbs=known.bandwidth_gbs, bandwidth_source="table", source="table",
        )
    elif vram_gib is not None:
        total = int(vram_gib * GiB)
        gpu = GPUInfo(
            index=0, name=f"GPU with {vram_gib:g} GiB", total_bytes=total, free_bytes=total,
            compute_capability=(8, 6), backend="cuda", source="table",
        )
        notes.append("unnamed GPU: assumed compute capability 8.6 (bf16, no FP8 tensor cores); bandwidth unknown")
    else:
        raise LocalLLMError("hardware_for_gpu needs a GPU name or a VRAM size")
    return replace(base, gpus=(gpu,), notes=tuple(notes), hypothetical=True)


def with_bandwidth(hw: Hardware, gbs: float, source: str = "measured") -> Hardware:
    """The same profile with the first CUDA GPU's bandwidth replaced (after --measure)."""
    gpus = tuple(
        replace(g, bandwidth_gbs=gbs, bandwidth_source=source) if g is hw.gpu else g for g in hw.gpus
    )
    return replace(hw, gpus=gpus)


def measure_bandwidth(device: str = "cpu", nbytes: int | None = None, repeats: int = 5) -> float:
    """Copy bandwidth in GB/s (bytes read + bytes written, per second), best of ``repeats``.

    Decode reads every weight once per token, so this bounds tokens/s the same way the
    vendor figure does for GPUs; on CPUs it is the only honest number.
    """
    import torch

    if nbytes is None:
        nbytes = 1 * GiB if device.startswith("cuda") else 256 * MiB
    n = max(1, nbytes // 4)
    src = torch.ones(n, dtype=torch.float32, device=device)  # ones, not empty: pages must be real
    dst = torch.zeros_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(max(1, repeats)):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * n * 4 / best / 1e9


@dataclass(slots=True)
class MemoryMeter:
    """What loading a model actually costs, to hold against ``Plan.expected_measured_bytes``.

    CPU: growth of this process's resident set (RSS) between ``start`` and ``stop``. Only
    touched pages count, so a KV pool made with ``torch.empty``/``zeros`` counts once
    written (the engine should fill it at start-up). GPU: ``torch.cuda.max_memory_allocated``
    above the allocation at ``start``; the CUDA context is outside the allocator and excluded.

        with MemoryMeter(plan.device) as meter:
            engine = load(...); engine.warm_up()
        check = compare_memory(plan, meter.actual_bytes)
    """

    device: str = "cpu"
    baseline: int = 0
    actual_bytes: int = 0
    _running: bool = field(default=False, repr=False)

    def start(self) -> MemoryMeter:
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.baseline = int(torch.cuda.memory_allocated())
        else:
            import psutil

            self.baseline = int(psutil.Process().memory_info().rss)
        self._running = True
        return self

    def stop(self) -> int:
        if not self._running:
            raise RuntimeError("MemoryMeter.stop() before start()")
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.synchronize()
            now = int(torch.cuda.max_memory_allocated())
        else:
            import psutil

            now = int(psutil.Process().memory_info().rss)
        self.actual_bytes = max(0, now - self.baseline)
        self._running = False
        return self.actual_bytes

    def __enter__(self) -> MemoryMeter:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._running:
            self.stop()
