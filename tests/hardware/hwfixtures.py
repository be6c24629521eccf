"""Hardware profiles for tests: built by hand, so no test depends on this machine's GPU or RAM."""

from __future__ import annotations

from dataclasses import dataclass, field

from localllm.hardware.probe import (
    CPUInfo, GiB, Hardware, NvmlDevice, NvmlView, TorchDevice, TorchView, hardware_for_gpu, read_torch,
)


def cpu_hw(flags: tuple[str, ...] = ("avx2", "fma"), available_gib: float = 16.0) -> Hardware:
    return Hardware(
        cpu=CPUInfo("test CPU", 8, 16, frozenset(flags), "x86_64"),
        ram_total_bytes=int(32 * GiB),
        ram_available_bytes=int(available_gib * GiB),
        notes=("no NVIDIA GPU: NVML: NVML Shared Library Not Found; planning for the CPU",),
    )


def gpu_hw(name: str, vram_gib: float | None = None) -> Hardware:
    return hardware_for_gpu(name, vram_gib, base=cpu_hw())


# ---- GPUs as torch and NVML would report them (no GPU here): typed stand-ins for both sources

@dataclass(frozen=True, slots=True)
class Card:
    """One physical GPU, described once; ``torch_device``/``nvml_device`` say it each side's way."""

    name: str
    total_gib: float
    uuid: str  # as NVML writes it, "GPU-..."
    pci: tuple[int, int, int]  # (domain, bus, device)
    cc: tuple[int, int] = (8, 9)
    free_gib: float | None = None
    others_gib: float | None = None

    def torch_device(self, index: int, with_uuid: bool = True) -> TorchDevice:
        return TorchDevice(index, self.name, int(self.total_gib * GiB), self.cc,
                           uuid=self.uuid.lower().removeprefix("gpu-") if with_uuid else None, pci=self.pci)

    def nvml_device(self, index: int) -> NvmlDevice:
        free = self.free_gib if self.free_gib is not None else self.total_gib
        others = int(self.others_gib * GiB) if self.others_gib is not None else None
        return NvmlDevice(index, self.name, int(self.total_gib * GiB), int(free * GiB), self.cc,
                          uuid=self.uuid.lower().removeprefix("gpu-"), pci=self.pci, others_bytes=others)


RTX_4090 = Card("NVIDIA GeForce RTX 4090", 24, "GPU-4090aaaa-0000-0000-0000-000000000001", (0, 0x41, 0),
                free_gib=21.5, others_gib=2.0)
RTX_3090 = Card("NVIDIA GeForce RTX 3090", 24, "GPU-3090bbbb-0000-0000-0000-000000000002", (0, 0x01, 0), (8, 6),
                free_gib=23.0, others_gib=0.5)


def nvml_view(*cards: Card, driver: str = "550.54", cuda_driver: tuple[int, int] = (12, 4)) -> NvmlView:
    """NVML numbers cards in PCI order."""
    ordered = sorted(cards, key=lambda c: c.pci)
    return NvmlView(tuple(c.nvml_device(i) for i, c in enumerate(ordered)), driver, cuda_driver)


@dataclass(frozen=True, slots=True)
class FakeProps:
    name: str
    total_memory: int
    major: int
    minor: int
    uuid: str
    pci_domain_id: int
    pci_bus_id: int
    pci_device_id: int


@dataclass
class FakeCuda:
    """``torch.cuda`` on a machine with ``cards`` visible (in CUDA's order), or none with the
    error CUDA initialisation raises (``init_error``)."""

    cards: list[Card] = field(default_factory=list)
    init_error: str | None = None

    def is_available(self) -> bool:
        return bool(self.cards)

    def device_count(self) -> int:
        return len(self.cards)

    def get_device_properties(self, device: int) -> FakeProps:
        c = self.cards[device]
        return FakeProps(c.name, int(c.total_gib * GiB), c.cc[0], c.cc[1], c.uuid.removeprefix("GPU-"), *c.pci)

    def mem_get_info(self, device: int) -> tuple[int, int]:
        c = self.cards[device]
        return int((c.free_gib or c.total_gib) * GiB), int(c.total_gib * GiB)

    def init(self) -> None:
        if self.init_error is not None:
            raise RuntimeError(self.init_error)


def cuda_torch_view(cuda: FakeCuda, environ: dict[str, str] | None = None) -> TorchView:
    """What ``read_torch`` makes of a CUDA 12.4 wheel seeing ``cuda``."""
    return read_torch(cuda, version="2.5.1+cu124", cuda_version="12.4", hip=False, environ=environ or {})


@dataclass(frozen=True, slots=True)
class _Mem:
    total: int
    free: int
    used: int


@dataclass(frozen=True, slots=True)
class _Pci:
    domain: int
    bus: int
    device: int


@dataclass(frozen=True, slots=True)
class _Proc:
    pid: int
    usedGpuMemory: int | None  # noqa: N815 - pynvml's field name


@dataclass
class FakeNvml:
    """The calls of ``pynvml`` that ``read_nvml`` makes, answering for ``cards`` (PCI order)
    with ``procs[i]`` (pid, bytes or None) running on card i as compute or graphics clients."""

    cards: list[Card]
    procs: dict[int, list[tuple[int, int | None]]] = field(default_factory=dict)
    driver: str = "550.54.14"
    cuda_driver: int = 12040
    NVML_CLOCK_MEM: int = 2

    def nvmlInit(self) -> None: ...  # noqa: N802 - pynvml's names, all below
    def nvmlShutdown(self) -> None: ...  # noqa: N802
    def nvmlSystemGetDriverVersion(self) -> str: return self.driver  # noqa: N802, E704
    def nvmlSystemGetCudaDriverVersion(self) -> int: return self.cuda_driver  # noqa: N802, E704
    def nvmlDeviceGetCount(self) -> int: return len(self.cards)  # noqa: N802, E704
    def nvmlDeviceGetHandleByIndex(self, i: int) -> int: return i  # noqa: N802, E704
    def nvmlDeviceGetName(self, h: int) -> bytes: return self.cards[h].name.encode()  # noqa: N802, E704
    def nvmlDeviceGetUUID(self, h: int) -> str: return self.cards[h].uuid  # noqa: N802, E704

    def nvmlDeviceGetMemoryInfo(self, h: int) -> _Mem:  # noqa: N802
        c = self.cards[h]
        total, free = int(c.total_gib * GiB), int((c.free_gib or c.total_gib) * GiB)
        return _Mem(total, free, total - free)

    def nvmlDeviceGetCudaComputeCapability(self, h: int) -> tuple[int, int]:  # noqa: N802
        return self.cards[h].cc

    def nvmlDeviceGetPciInfo(self, h: int) -> _Pci:  # noqa: N802
        return _Pci(*self.cards[h].pci)

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[_Proc]:  # noqa: N802
        return [_Proc(pid, used) for pid, used in self.procs.get(h, [])[:1]]

    def nvmlDeviceGetGraphicsRunningProcesses(self, h: int) -> list[_Proc]:  # noqa: N802
        return [_Proc(pid, used) for pid, used in self.procs.get(h, [])[1:]]

    def nvmlDeviceGetMaxClockInfo(self, h: int, clock: int) -> int:  # noqa: N802
        return 10501  # MHz, an RTX 4090's GDDR6X

    def nvmlDeviceGetMemoryBusWidth(self, h: int) -> int:  # noqa: N802
        return 384
