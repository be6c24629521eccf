"""Hardware profiles for tests: built by hand, so no test depends on this machine's GPU or RAM."""

from __future__ import annotations

from localllm.hardware.probe import CPUInfo, GiB, Hardware, hardware_for_gpu


def cpu_hw(flags: tuple[str, ...] = ("avx2", "fma"), available_gib: float = 16.0) -> Hardware:
    return Hardware(
        cpu=CPUInfo("test CPU", 8, 16, frozenset(flags), "x86_64"),
        ram_total_bytes=int(32 * GiB),
        ram_available_bytes=int(available_gib * GiB),
        notes=("no NVIDIA GPU: NVML: NVML Shared Library Not Found; planning for the CPU",),
    )


def gpu_hw(name: str, vram_gib: float | None = None) -> Hardware:
    return hardware_for_gpu(name, vram_gib, base=cpu_hw())
