"""Which GPUs the engine may use is torch's answer; NVML only adds figures, matched by UUID or
PCI address. Both sources are stand-ins here (this machine has neither a GPU nor NVML), fed
through the same ``read_torch``/``gpus_from``/``probe_hardware`` the real probe runs."""

from __future__ import annotations

import os

import pytest
from hwfixtures import RTX_3090, RTX_4090, FakeCuda, FakeNvml, cuda_torch_view, nvml_view

from localllm.hardware.planner import plan
from localllm.hardware.probe import GiB, MiB, NvmlView, TorchView, probe_hardware, read_nvml, read_torch
from localllm.models.llama import ModelConfig

SMALL = ModelConfig.from_hf({
    "architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816,
    "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 4, "max_position_embeddings": 4096,
}, "test")


def test_two_gpus_in_different_order_are_matched_by_uuid_not_index() -> None:
    # CUDA puts the faster 4090 first; NVML numbers by PCI bus, where the 3090 comes first.
    nvml = nvml_view(RTX_4090, RTX_3090)
    assert [d.name for d in nvml.devices] == [RTX_3090.name, RTX_4090.name]
    hw = probe_hardware(cuda_torch_view(FakeCuda([RTX_4090, RTX_3090])), nvml)
    first, second = hw.gpus
    assert (first.index, first.name, second.index, second.name) == (0, RTX_4090.name, 1, RTX_3090.name)
    # each carries its own card's NVML figures, not those of NVML's device with the same index
    assert first.free_bytes == int(21.5 * GiB) and first.others_bytes == 2 * GiB and first.compute_capability == (8, 9)
    assert second.free_bytes == 23 * GiB and second.others_bytes == GiB // 2
    assert first.driver == "550.54" and first.source == "torch+nvml" and first.bandwidth_gbs == 1008
    assert hw.gpu is first and hw.device == "cuda" and not hw.notes
    p = plan(SMALL, hw, context=4096)
    assert p.device == "cuda" and RTX_4090.name in " ".join(p.reasons)


def test_without_uuids_the_pci_address_matches() -> None:
    torch_view = cuda_torch_view(FakeCuda([RTX_4090, RTX_3090]))
    old_torch = TorchView(torch_view.version, torch_view.cuda_version,
                          devices=(RTX_4090.torch_device(0, with_uuid=False), RTX_3090.torch_device(1, with_uuid=False)))
    first, second = probe_hardware(old_torch, nvml_view(RTX_4090, RTX_3090)).gpus
    assert first.others_bytes == 2 * GiB and second.others_bytes == GiB // 2


def test_cpu_only_torch_with_nvml_seeing_a_gpu_plans_for_the_cpu_and_says_why() -> None:
    cpu_torch = read_torch()  # this machine's own wheel: torch 2.13.0+cpu
    assert cpu_torch.cuda_version is None and not cpu_torch.devices
    hw = probe_hardware(cpu_torch, nvml_view(RTX_4090))
    assert hw.device == "cpu" and hw.gpu is None
    (why,) = [n for n in hw.notes if n.startswith("no NVIDIA GPU")]
    assert "CPU-only build" in why and RTX_4090.name in why and "\n" not in why
    p = plan(SMALL, hw, context=4096)
    assert p.device == "cpu"
    assert any("CPU-only build" in r for r in p.reasons), p.reasons


def test_cuda_visible_devices_hiding_one_of_two_gpus() -> None:
    # CUDA_VISIBLE_DEVICES=1 (PCI order): torch sees only the 4090, as its cuda:0
    torch_view = cuda_torch_view(FakeCuda([RTX_4090]), {"CUDA_VISIBLE_DEVICES": "1"})
    hw = probe_hardware(torch_view, nvml_view(RTX_4090, RTX_3090))
    (gpu,) = hw.gpus
    assert (gpu.index, gpu.name, gpu.others_bytes) == (0, RTX_4090.name, 2 * GiB)
    assert any(RTX_3090.name in n and "CUDA_VISIBLE_DEVICES='1'" in n for n in hw.notes), hw.notes


def test_cuda_visible_devices_empty_means_the_cpu() -> None:
    torch_view = cuda_torch_view(FakeCuda([]), {"CUDA_VISIBLE_DEVICES": ""})
    assert torch_view.why_not == "CUDA_VISIBLE_DEVICES='' hides every GPU from torch"
    hw = probe_hardware(torch_view, nvml_view(RTX_4090))
    assert hw.device == "cpu" and hw.notes[0].startswith("no NVIDIA GPU: CUDA_VISIBLE_DEVICES='' hides every GPU")


def test_a_driver_older_than_the_wheels_cuda_names_both_versions() -> None:
    error = ("The NVIDIA driver on your system is too old (found version 11040).\n"
             "Please update your GPU driver by downloading and installing a new version")
    torch_view = cuda_torch_view(FakeCuda([], init_error=error))
    assert "too old (found version 11040)" in (torch_view.why_not or "")
    hw = probe_hardware(torch_view, nvml_view(RTX_4090, driver="470.82", cuda_driver=(11, 4)))
    assert hw.device == "cpu"
    why = hw.notes[0]
    assert "driver 470.82 runs CUDA up to 11.4, but torch 2.5.1+cu124 needs CUDA 12.4" in why, why
    assert "\n" not in why


def test_torch_sees_cuda_but_nvml_is_missing() -> None:
    hw = probe_hardware(cuda_torch_view(FakeCuda([RTX_4090])), NvmlView(why_not="NVML: Shared Library Not Found"))
    (gpu,) = hw.gpus
    assert gpu.source == "torch" and gpu.others_bytes is None and gpu.bandwidth_gbs == 1008
    assert gpu.free_bytes == gpu.total_bytes  # no NVML and no context asked for: the whole card
    assert hw.device == "cuda" and any("NVML is unavailable" in n for n in hw.notes)


@pytest.mark.skipif(read_torch().cuda_version is not None, reason="this torch is a CUDA build")
def test_this_machine_reads_as_the_cpu_with_both_reasons() -> None:
    nvml = read_nvml()
    assert nvml.devices or nvml.why_not  # NVML's reason, when it has no device
    hw = probe_hardware()
    assert hw.device == "cpu"
    assert hw.notes[0].startswith("no NVIDIA GPU: ") and "CPU-only build" in hw.notes[0]


def test_read_nvml_keys_devices_by_uuid_and_pci_and_counts_other_processes() -> None:
    me = os.getpid()
    nvml = read_nvml(FakeNvml([RTX_3090, RTX_4090], procs={
        1: [(me, 600 * MiB), (4242, GiB), (4343, 512 * MiB)],  # this process, a compositor, a browser
        0: [(5151, None)],  # a driver that gives no per-process figure
    }))
    assert nvml.driver == "550.54.14" and nvml.cuda_driver == (12, 4) and nvml.why_not is None
    a, b = nvml.devices
    assert (a.name, a.uuid, a.pci) == (RTX_3090.name, "3090bbbb-0000-0000-0000-000000000002", (0, 1, 0))
    assert b.others_bytes == GiB + 512 * MiB  # not this process's own 600 MiB
    assert a.others_bytes is None
    assert b.clock_bandwidth_gbs == pytest.approx(1008.1, abs=0.1)
    # and torch's view of the same cards (in CUDA's order) finds each one's record
    gpus = probe_hardware(cuda_torch_view(FakeCuda([RTX_4090, RTX_3090])), nvml).gpus
    assert [(g.index, g.name, g.others_bytes) for g in gpus] == [
        (0, RTX_4090.name, GiB + 512 * MiB), (1, RTX_3090.name, None)]
