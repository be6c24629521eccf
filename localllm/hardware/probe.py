"""What this machine has: CPU and its ISA, RAM, and the GPUs torch can use (NVML adds figures).

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
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Any, Protocol

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
    # "torch+nvml" (torch's device, NVML's figures), "torch" (no NVML record) or "table"
    # (a card planned for, not present); ``index`` is always torch's: the engine's cuda:<index>
    source: str = "torch+nvml"
    uuid: str | None = None
    others_bytes: int | None = None  # VRAM other processes hold (NVML), where the driver says

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
        """The GPU the engine would use: torch's first CUDA device (cuda:0)."""
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
                    "uuid": g.uuid,
                    "others_bytes": g.others_bytes,
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


# ---------------------------------------------------------------- GPUs
#
# torch decides which CUDA devices exist: a CPU-only wheel, CUDA_VISIBLE_DEVICES or a driver
# older than the wheel's CUDA all leave NVML seeing a card that the engine cannot use. NVML
# adds what torch does not say (the driver, other processes' memory, bandwidth from clocks),
# matched to torch's devices by UUID or PCI address: the two number devices differently
# (NVML by PCI order, CUDA fastest first unless CUDA_DEVICE_ORDER=PCI_BUS_ID, and after
# CUDA_VISIBLE_DEVICES), so an index never identifies a card across them.

PciAddress = tuple[int, int, int]  # (domain, bus, device)


def _uuid(value: object) -> str | None:
    """A GPU UUID as both sides can compare it: NVML writes ``GPU-<hex>``, torch ``<hex>``."""
    text = _text(value).strip().lower() if value is not None else ""
    for prefix in ("gpu-", "mig-"):
        text = text.removeprefix(prefix)
    return text or None


@dataclass(frozen=True, slots=True)
class TorchDevice:
    """One device as torch numbers it: ``cuda:<index>`` (ROCm devices too, under HIP)."""

    index: int
    name: str
    total_bytes: int
    compute_capability: tuple[int, int]
    uuid: str | None = None
    pci: PciAddress | None = None
    free_bytes: int | None = None  # read only where NVML cannot say (it needs a CUDA context)


@dataclass(frozen=True, slots=True)
class TorchView:
    """What torch can run on. ``why_not``: one line, set whenever ``devices`` is empty."""

    version: str
    cuda_version: str | None = None  # the CUDA the wheel was built for, None for a CPU-only one
    hip: bool = False
    devices: tuple[TorchDevice, ...] = ()
    why_not: str | None = None
    mps: bool = False
    visible: str | None = None  # CUDA_VISIBLE_DEVICES as torch saw it


@dataclass(frozen=True, slots=True)
class NvmlDevice:
    index: int  # NVML's numbering, for messages only
    name: str
    total_bytes: int
    free_bytes: int
    compute_capability: tuple[int, int]
    uuid: str | None = None
    pci: PciAddress | None = None
    others_bytes: int | None = None  # held by other processes, where the driver says
    clock_bandwidth_gbs: float | None = None  # memory clock x 2 x bus width


@dataclass(frozen=True, slots=True)
class NvmlView:
    devices: tuple[NvmlDevice, ...] = ()
    driver: str | None = None
    cuda_driver: tuple[int, int] | None = None  # the newest CUDA the driver runs
    why_not: str | None = None


class TorchCuda(Protocol):
    """The part of ``torch.cuda`` the probe reads; tests hand in their own devices."""

    def is_available(self) -> bool: ...
    def device_count(self) -> int: ...
    def get_device_properties(self, device: int) -> Any: ...  # torch's _CudaDeviceProperties
    def mem_get_info(self, device: int) -> tuple[int, int]: ...
    def init(self) -> None: ...


def read_torch(cuda: TorchCuda | None = None, version: str | None = None, cuda_version: str | None = None,
               hip: bool | None = None, environ: Mapping[str, str] | None = None) -> TorchView:
    """The devices torch can use, or why none. Never raises. With no arguments it reads the
    installed torch; tests pass a ``TorchCuda`` and the build's versions."""
    environ = os.environ if environ is None else environ
    mps = False
    if cuda is None:
        try:
            import torch
        except Exception as e:  # noqa: BLE001
            return TorchView("", why_not=f"torch is not importable ({type(e).__name__}: {e})")
        cuda, version = torch.cuda, torch.__version__
        cuda_version, hip = torch.version.cuda, bool(getattr(torch.version, "hip", None))
        with contextlib.suppress(Exception):
            mps = bool(torch.backends.mps.is_available())
    version, hip = version or "?", bool(hip)
    view = TorchView(version, cuda_version, hip, mps=mps, visible=environ.get("CUDA_VISIBLE_DEVICES"))
    if cuda_version is None and not hip:
        return replace(view, why_not=f"torch {version} is a CPU-only build (no CUDA)")
    try:
        with warnings.catch_warnings():  # torch warns what _why_no_cuda says in one line
            warnings.simplefilter("ignore")
            available = cuda.is_available()
            count = cuda.device_count() if available else 0
            if count == 0:
                return replace(view, why_not=_why_no_cuda(cuda, version, cuda_version, environ))
        devices = []
        for i in range(count):
            props = cuda.get_device_properties(i)
            pci = None
            if getattr(props, "pci_bus_id", None) is not None:
                pci = (int(getattr(props, "pci_domain_id", 0)), int(props.pci_bus_id), int(props.pci_device_id))
            devices.append(TorchDevice(
                index=i, name=str(props.name), total_bytes=int(props.total_memory),
                compute_capability=(int(props.major), int(props.minor)),
                uuid=_uuid(getattr(props, "uuid", None)), pci=pci,
            ))
    except Exception as e:  # noqa: BLE001 - a broken driver must not break the app
        return replace(view, why_not=f"torch {version} could not use CUDA: {_first_line(e)}")
    return replace(view, devices=tuple(devices))


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def _why_no_cuda(cuda: TorchCuda, version: str, cuda_version: str | None, environ: Mapping[str, str]) -> str:
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and (not visible.strip() or visible.strip().startswith("-1")):
        return f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU from torch"
    try:
        cuda.init()  # is_available() says only False; initialising says why
    except Exception as e:  # noqa: BLE001
        return f"torch {version} (CUDA {cuda_version}) cannot use CUDA: {_first_line(e)}"
    return f"torch {version} (CUDA {cuda_version}) finds no CUDA device"


def read_nvml(nvml: Any = None) -> NvmlView:
    """NVIDIA devices through NVML (``pynvml``, or a stand-in with its API). Never raises."""
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError as e:
            return NvmlView(why_not=f"nvidia-ml-py is not installed ({e})")
    try:
        nvml.nvmlInit()
    except Exception as e:  # noqa: BLE001 - pynvml.NVMLError and its subclasses
        return NvmlView(why_not=f"NVML: {e}")
    devices: list[NvmlDevice] = []
    driver: str | None = None
    cuda_driver: tuple[int, int] | None = None
    try:
        with contextlib.suppress(Exception):
            driver = _text(nvml.nvmlSystemGetDriverVersion())
        with contextlib.suppress(Exception):
            v = int(nvml.nvmlSystemGetCudaDriverVersion())  # e.g. 12020 for 12.2
            cuda_driver = (v // 1000, v % 1000 // 10)
        for i in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            mem = nvml.nvmlDeviceGetMemoryInfo(h)
            devices.append(NvmlDevice(
                index=i, name=_text(nvml.nvmlDeviceGetName(h)), total_bytes=int(mem.total),
                free_bytes=int(mem.free), compute_capability=_nvml_cc(nvml, h),
                uuid=_optional(lambda: _uuid(nvml.nvmlDeviceGetUUID(h))),
                pci=_optional(lambda: _nvml_pci(nvml, h)),
                others_bytes=_optional(lambda: _others_bytes(nvml, h)),
                clock_bandwidth_gbs=_optional(lambda: _clock_bandwidth(nvml, h)),
            ))
    except Exception as e:  # noqa: BLE001
        return NvmlView(tuple(devices), driver, cuda_driver, f"NVML: {e}")
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()
    return NvmlView(tuple(devices), driver, cuda_driver, None if devices else "NVML found no NVIDIA GPU")


def _optional(read: Callable[[], Any]) -> Any:
    """An NVML figure that older drivers, MIG or containers may not give: None then."""
    try:
        return read()
    except Exception:  # noqa: BLE001
        return None


def _nvml_cc(nvml: Any, h: Any) -> tuple[int, int]:
    cc = _optional(lambda: tuple(int(x) for x in nvml.nvmlDeviceGetCudaComputeCapability(h)))
    return (cc[0], cc[1]) if cc else (0, 0)


def _nvml_pci(nvml: Any, h: Any) -> PciAddress:
    info = nvml.nvmlDeviceGetPciInfo(h)
    return int(info.domain), int(info.bus), int(info.device)


def _others_bytes(nvml: Any, h: Any) -> int | None:
    """Memory the other processes on this GPU hold (compute and graphics: a desktop's
    compositor and browser are graphics clients). None when the driver does not say (in a
    container it often reports no per-process figures)."""
    me = os.getpid()
    total, known = 0, False
    for read in (nvml.nvmlDeviceGetComputeRunningProcesses, nvml.nvmlDeviceGetGraphicsRunningProcesses):
        for proc in read(h):
            used = getattr(proc, "usedGpuMemory", None)
            if proc.pid != me and isinstance(used, int) and 0 <= used < 1 << 50:
                total += used
                known = True
    return total if known else None


def _clock_bandwidth(nvml: Any, h: Any) -> float | None:
    clock_mhz = nvml.nvmlDeviceGetMaxClockInfo(h, nvml.NVML_CLOCK_MEM)
    bus_bits = nvml.nvmlDeviceGetMemoryBusWidth(h)
    return clock_mhz * 1e6 * 2 * bus_bits / 8 / 1e9 if clock_mhz and bus_bits else None


def _match(device: TorchDevice, nvml: NvmlView) -> NvmlDevice | None:
    """The NVML record of a torch device: same UUID, else same PCI address; never by index."""
    for key in ("uuid", "pci"):
        value = getattr(device, key)
        if value is not None:
            found = [n for n in nvml.devices if getattr(n, key) == value]
            if len(found) == 1:
                return found[0]
    return None


def _version_tuple(text: str | None) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", text or "")
    return (int(m[1]), int(m[2])) if m else None


def gpus_from(torch_view: TorchView, nvml: NvmlView,
              free_bytes: Callable[[int], int] | None = None) -> tuple[list[GPUInfo], list[str], str | None]:
    """GPUs as torch numbers them, with NVML's figures where a device matches; the notes;
    and, when CUDA is not usable, the one-line reason. ``free_bytes(index)`` asks torch for
    a device NVML does not describe (it costs a CUDA context)."""
    notes: list[str] = []
    gpus: list[GPUInfo] = []
    backend = "rocm" if torch_view.hip else "cuda"
    matched: set[int] = set()
    for d in torch_view.devices:
        n = _match(d, nvml) if backend == "cuda" else None
        known_bw, known_src = _bandwidth_for(d.name, d.total_bytes)
        if n is not None:
            matched.add(n.index)
            free = n.free_bytes
            if known_bw is None and n.clock_bandwidth_gbs:
                known_bw, known_src = n.clock_bandwidth_gbs, "nvml"
        else:
            free = d.free_bytes
            if free is None and free_bytes is not None:
                with contextlib.suppress(Exception):
                    free = int(free_bytes(d.index))
            if free is None:
                free = d.total_bytes
            if backend == "cuda" and nvml.devices:
                notes.append(f"cuda:{d.index} ({d.name}) matches no NVML device by UUID or PCI address;"
                             " using torch's figures alone")
        gpus.append(GPUInfo(
            index=d.index, name=d.name, total_bytes=d.total_bytes, free_bytes=free,
            compute_capability=d.compute_capability, backend=backend,
            driver=nvml.driver if n is not None else None,
            bandwidth_gbs=known_bw if backend == "cuda" else None,
            bandwidth_source=known_src if backend == "cuda" else "none",
            source="torch+nvml" if n is not None else "torch",
            uuid=d.uuid, others_bytes=n.others_bytes if n is not None else None,
        ))
    if torch_view.hip and gpus:
        notes.append("ROCm GPU reported by torch; the engine runs on NVIDIA CUDA only for now")
    hidden = [n for n in nvml.devices if n.index not in matched]
    if hidden and gpus and backend == "cuda":
        visible = torch_view.visible
        names = ", ".join(f"{n.name} (NVML {n.index})" for n in hidden)
        notes.append(f"NVML also sees {names}, which CUDA does not expose"
                     + (f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""))
    if gpus and backend == "cuda" and not nvml.devices:
        notes.append(f"NVML is unavailable ({nvml.why_not}); using torch's device figures")
    if torch_view.mps:
        notes.append("Apple MPS reported by torch; the engine does not run on MPS yet")
    if any(g.backend == "cuda" for g in gpus):
        return gpus, notes, None
    return gpus, notes, _why_cpu(torch_view, nvml)


def _why_cpu(torch_view: TorchView, nvml: NvmlView) -> str:
    """One line: why there is no usable NVIDIA GPU, naming both sides where both have a say."""
    if not nvml.devices:
        nvml_says = nvml.why_not or "NVML found no NVIDIA GPU"
        if torch_view.hip:
            return f"{nvml_says} (torch is a ROCm build)"
        # torch's reason too: a CPU-only wheel stays a reason after a driver is installed
        return f"{nvml_says}, and {torch_view.why_not}" if torch_view.why_not else nvml_says
    # No ';' inside: the planner's device line keeps what comes before the first one.
    seen = f"NVML sees {', '.join(sorted({n.name for n in nvml.devices}))}"
    need, have = _version_tuple(torch_view.cuda_version), nvml.cuda_driver
    if need is not None and have is not None and have < need:
        return (f"driver {nvml.driver or '?'} runs CUDA up to {have[0]}.{have[1]}, but torch {torch_view.version}"
                f" needs CUDA {torch_view.cuda_version} ({seen}): update the driver, or install a torch built for"
                f" CUDA {have[0]}.{have[1]} or older")
    why = torch_view.why_not or "torch sees no CUDA device"
    if torch_view.cuda_version is None and not torch_view.hip:
        return f"{why}, though {seen}: install a CUDA build of torch to use it"
    return f"{why}, though {seen}"


def _bandwidth_for(name: str, total: int) -> tuple[float | None, str]:
    known = find_known_gpu(name, total)
    return (known.bandwidth_gbs, "table") if known is not None else (None, "none")


def probe_hardware(torch_view: TorchView | None = None, nvml: NvmlView | None = None) -> Hardware:
    """This machine. Never raises; with no usable GPU the notes' first line says why, as
    ``no NVIDIA GPU: <reason>; planning for the CPU``. Tests pass the two views."""
    cpu = _probe_cpu()
    total, available = _probe_ram()
    free_bytes: Callable[[int], int] | None = None
    if torch_view is None:
        torch_view = read_torch()

        def free_bytes(index: int) -> int:
            import torch

            return int(torch.cuda.mem_get_info(index)[0])
    if nvml is None:
        nvml = read_nvml()
    gpus, gpu_notes, why = gpus_from(torch_view, nvml, free_bytes)
    if torch_view.mps:
        gpus.append(GPUInfo(index=0, name="Apple GPU (MPS)", total_bytes=total, free_bytes=total,
                            compute_capability=(0, 0), backend="mps", source="torch"))
    notes = [f"no NVIDIA GPU: {why}; planning for the CPU"] if why is not None else []
    return Hardware(cpu=cpu, ram_total_bytes=total, ram_available_bytes=available,
                    gpus=tuple(gpus), notes=tuple(notes + gpu_notes))


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
