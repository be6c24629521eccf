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


def _made(kind: str) -> Path:
    """FILES[kind], or a skip where bench/requantize.py did not make it: ``--types`` may have
    made the Q4_K_M file ``needs`` looks for and not this one."""
    path = FILES[kind]
    if not path.is_file():
        pytest.skip(f"{path.name} not made")
    return path


@needs
@pytest.mark.parametrize("kind", list(FILES))
def test_each_files_reason_line_counts_its_tensors_by_type(kind: str) -> None:
    from localllm.models.formats import open_checkpoint
    from localllm.quant.gguf_modules import reason_line

    path = _made(kind)
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
    # issue 28's memory target: the model holds the file's blocks (repacked, plus the layouts'
    # own scales and the float norms), within 10% of the file, and the plan predicted that
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in [*loaded.model.parameters(), *loaded.model.buffers()]}
    size = FILES["Q4_K_M"].stat().st_size
    assert abs(sum(held.values()) / size - 1) <= 0.10, (sum(held.values()), size)
    assert abs(sum(held.values()) / loaded.plan.weight_bytes - 1) <= 0.10, (sum(held.values()), loaded.plan.weight_bytes)


@needs
@pytest.mark.parametrize("kind", list(FILES))
def test_each_files_planned_weights_are_its_tensors(kind: str) -> None:
    from localllm.hardware.sizing import weight_bytes
    from localllm.models.formats import open_checkpoint
    from localllm.models.gguf_file import gguf_weights_from_file

    path = _made(kind)
    weights = gguf_weights_from_file(path)
    planned = weight_bytes(open_checkpoint(path).config, "float32", "gguf", weights)
    # every type of these files has a CPU kernel: the plan is the tensors as stored, the file
    # that plus its metadata (the tokenizer: ~1.7 MB here)
    assert planned == weights.tensor_bytes
    assert 0 < path.stat().st_size - planned <= 0.03 * path.stat().st_size, (planned, path.stat().st_size)


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
