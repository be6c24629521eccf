"""The generic GGUF kernels (kernels/cpu/gguf/generic.cpp: portable C++, what Arm and x86
CPUs before AVX2 run), forced on this machine with LOCALLLM_CPU_ISA=generic (read per call by
kernels/cpu/gguf/dispatch.h): on every packed type the dense expansion is the gguf package's
dequantization bit for bit and the linear is x @ W^T on those weights within the two-level
activations' error (test_gguf_kquants.check, at M = 1, 16 and 70, each row what it is alone);
and against the x86 kernels on the same packed weights, unsigned-code types agree bit for bit,
signed ones within fp32 rounding (AVX-512 offsets signed codes by 128, generic.h)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from localllm.kernels import cpu_ops
from localllm.quant import gguf_formats as gf
from localllm.quant.gguf_experts import expert_slice
from tests.kernels.test_gguf_kquants import KERNEL_TYPES, check, packed_linear, random_blocks

pytestmark = pytest.mark.skipif(not cpu_ops.has_gguf_kernels(), reason="the CPU kernels are not built here")

SIGNED = {"Q8_0", "IQ4_NL", "IQ4_XS", "MXFP4"}  # int8 or table codes


def test_every_type_on_the_generic_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    x86 = cpu_ops.gguf_kernels()
    monkeypatch.setenv("LOCALLLM_CPU_ISA", "generic")
    assert cpu_ops.gguf_kernels().startswith("generic")
    gen = torch.Generator().manual_seed(3)
    for name in KERNEL_TYPES:
        k = 512  # two super-blocks
        blocks = random_blocks(name, 24, k)
        lin = packed_linear(blocks, name, k)  # repacked once: the same bytes for both kernels
        check(lin, blocks, name)
        if not x86.startswith("x86"):
            continue
        x = torch.randn(16, k, generator=gen)
        ours = torch.ops.localllm_cpu.gguf_linear(x, lin.packed, lin.block_type, 2)
        monkeypatch.delenv("LOCALLLM_CPU_ISA")
        theirs = torch.ops.localllm_cpu.gguf_linear(x, lin.packed, lin.block_type, 2)
        monkeypatch.setenv("LOCALLLM_CPU_ISA", "generic")
        if name in SIGNED:
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5, msg=name)
        else:
            assert torch.equal(ours, theirs), name


def test_generic_grouped_rows_equal_per_expert_linears(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCALLLM_CPU_ISA", "generic")
    E, N, K, counts = 4, 16, 256, [0, 1, 18, 3]  # an expert without rows, one over a 16-row item
    for name in ("Q4_K", "MXFP4"):
        t = gf.fmt(name).type_id
        packed = list(torch.ops.localllm_cpu.gguf_repack(random_blocks(name, E * N, K), t, K))
        offsets = torch.tensor([0, *counts]).cumsum(0)
        x = torch.randn(int(offsets[-1]), K, generator=torch.Generator().manual_seed(1))
        got = torch.ops.localllm_cpu.gguf_linear_grouped(x, packed, t, 2, offsets)
        want = torch.cat([torch.ops.localllm_cpu.gguf_linear(x[offsets[e] : offsets[e + 1]],
                                                             expert_slice(packed, E, e), t, 2) for e in range(E)])
        assert torch.equal(got, want), name


def test_an_unknown_isa_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from localllm.errors import LocalLLMError

    monkeypatch.setenv("LOCALLLM_CPU_ISA", "neon")
    with pytest.raises(LocalLLMError, match="LOCALLLM_CPU_ISA=neon"):
        cpu_ops.gguf_kernels()


Q4_K_M = Path("~/.cache/localllm-fixtures/smollm2-135m-instruct.Q4_K_M.gguf").expanduser()


@pytest.mark.full  # an engine load and two greedy runs of the real file: ~20-60 s on 2 cores
@pytest.mark.skipif(not Q4_K_M.is_file(), reason=f"the SmolLM2 Q4_K_M fixture is not at {Q4_K_M}")
def test_the_engine_answers_the_same_on_the_generic_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Q4_K_M file (Q5_0, Q4_K, Q6_K, Q8_0 blocks) planned with the generic kernels forced:
    the reason line names them, and greedy decoding gives the x86 kernels' tokens (the same
    loaded blocks; the dispatch is per call)."""
    from localllm import LLM, SamplingParams

    monkeypatch.setenv("LOCALLLM_CPU_ISA", "generic")
    llm = LLM(str(Q4_K_M), device="cpu", compile=False, max_model_len=256, enable_prefix_caching=False)
    line = next(r for r in llm.engine.plan.reasons if r.startswith("gguf blocks"))
    assert "CPU kernels: generic" in line and "Q4_K x" in line, line
    params = SamplingParams(temperature=0, max_tokens=24)
    prompt = [{"role": "user", "content": "Explain why the sky is blue in two sentences."}]
    generic = llm.chat(prompt, params)[0].outputs[0].token_ids
    assert len(generic) == 24
    monkeypatch.delenv("LOCALLLM_CPU_ISA")
    if not cpu_ops.gguf_kernels().startswith("x86"):
        return  # no x86 kernels built here (Arm, x86 before AVX2) to compare with
    assert llm.chat(prompt, params)[0].outputs[0].token_ids == generic
