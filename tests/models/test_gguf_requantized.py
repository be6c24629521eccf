"""The default model requantized by llama.cpp's llama-quantize (bench/requantize.py writes the
files into the fixtures cache; skipped where they are absent, as in CI): each file's plan names
its stored types as they are, and a Q4_K_M file loads with every tensor of a kernel type kept as
stored. tests/models/test_gguf_mixed.py holds the same on a committed-fixture file everywhere."""

from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path

import pytest

from localllm.kernels import cpu_ops
from localllm.quant import gguf_formats as gf


def _fixtures() -> Path:
    home = os.environ.get("LOCALLLM_HOME")
    return Path(home) / "fixtures" if home else Path.home() / ".cache" / "localllm-fixtures"


FILES = {kind: _fixtures() / f"smollm2-135m-instruct.{kind}.gguf" for kind in ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0",
                                                                                "IQ4_XS")}
needs = pytest.mark.skipif(not FILES["Q4_K_M"].is_file(), reason="run bench/requantize.py to make the files")


@needs
@pytest.mark.parametrize("kind", list(FILES))
def test_each_files_reason_line_counts_its_tensors_by_type(kind: str) -> None:
    from localllm.models.formats import open_checkpoint
    from localllm.quant.gguf_modules import reason_line

    path = FILES[kind]
    if not path.is_file():
        pytest.skip(f"{path.name} not made")
    ckpt = open_checkpoint(path)
    line = reason_line(ckpt.block_types, tied=True)
    matrices = Counter(t for n, t in ckpt.block_types.items() if n.endswith("_proj.weight"))
    matrices[ckpt.block_types["model.embed_tokens.weight"]] += 1  # the tied head
    for type_id, n in matrices.items():
        assert re.search(rf"\b{gf.type_name(type_id)} x{n}\b", line), (kind, line)
    assert ("no CPU kernel" in line) == any(not gf.fmt(t).cpu_kernel for t in matrices)


@needs
@pytest.mark.skipif(not cpu_ops.has_gguf_kernels(), reason="GGUF kernels need an x86-64-v3 CPU")
def test_q4_k_m_keeps_every_kernel_type_as_stored() -> None:
    from localllm.models.loader import load_model
    from localllm.quant.gguf import GGUFLinear

    loaded = load_model(str(FILES["Q4_K_M"]), device="cpu", compile=False)
    assert loaded.plan.quant == "gguf"
    block_types = {gf.type_name(m.block_type) for m in loaded.model.modules() if isinstance(m, GGUFLinear)}
    # Q5_0 (576-wide rows), Q4_K/Q6_K (ffn_down, 1536-wide) and Q8_0 as stored where a kernel takes them
    for name in ("Q5_0", "Q4_K", "Q6_K", "Q8_0"):
        assert (name in block_types) == gf.fmt(name).cpu_kernel or name == gf.FALLBACK, (name, block_types)


GEMMA = _fixtures() / "gemma-3-270m-q4_k_m.gguf"  # the published file (see ENVIRONMENT.md)


@pytest.mark.skipif(not GEMMA.is_file(), reason="the Gemma 3 270M Q4_K_M file is not in the fixtures cache")
@pytest.mark.skipif(not cpu_ops.has_gguf_kernels(), reason="GGUF kernels need an x86-64-v3 CPU")
def test_gemma_q4_k_m_loads_every_tensor_as_stored() -> None:
    from localllm.models.gguf_file import read_gguf
    from localllm.models.loader import load_model
    from localllm.quant.gguf import GGUFLinear

    loaded = load_model(str(GEMMA), device="cpu", compile=False, max_model_len=512)
    line = next(r for r in loaded.plan.reasons if r.startswith("gguf blocks"))
    _, tensors = read_gguf(GEMMA)
    stored = Counter(gf.type_name(int(t.tensor_type)) for n, t in tensors.items()
                     if n.endswith("weight") and n.split(".")[-2] in ("attn_q", "attn_k", "attn_v", "attn_output",
                                                                      "ffn_gate", "ffn_up", "ffn_down"))
    stored["Q8_0"] += 1  # token_embd: the tied head
    for name, n in stored.items():
        assert gf.fmt(name).cpu_kernel and f"{name} x{n}" in line, (name, line)
    assert "no CPU kernel" not in line
    held = Counter(gf.type_name(m.block_type) for m in loaded.model.modules() if isinstance(m, GGUFLinear))
    assert set(held) == set(stored)  # nothing rounded again into another type
