"""The GGUF block kernels on every packed type (kernels/cpu/gguf): the dense expansion is the
gguf package's own dequantization bit for bit, and the integer linear matches x @ W^T on
those exact weights within the two-level int8 activations' error, at M = 1, 16 and a
prefill-sized 70 (kernel row tiles of 4, 2 and 1 all used, and with AMX the 16-row kernel),
each row bit for bit what it is alone. Blocks are made by the gguf
package's quantizer where it has one, else random bytes with sane fp16 fields (every bit
pattern is a valid block); and on the real Gemma 3 270M Q4_K_M file's tensors when that
fixture is on this machine."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from localllm.kernels import cpu_ops
from localllm.quant import gguf_formats as gf
from localllm.quant.gguf import GGUFBlocks, GGUFLinear, dequantize_blocks, packed_layout
from tests.kernels.test_cpu_ops import quantized_x

pytestmark = pytest.mark.skipif(not cpu_ops.has_gguf_kernels(), reason="GGUF CPU kernels not built here")

QUANTIZER = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4"}  # gguf.quants.quantize exists for these
KERNEL_TYPES = sorted(gf.fmt(t).name for t in gf.cpu_kernel_types())
GEMMA = Path(os.environ.get("LOCALLLM_GEMMA_Q4_K_M", "~/.cache/localllm-fixtures/gemma-3-270m-q4_k_m.gguf")).expanduser()


def _fp16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(*values.shape[:-1], -1)


def random_blocks(name: str, rows: int, k: int, seed: int = 0) -> torch.Tensor:
    """``rows`` x ``k`` weights of type ``name`` as file bytes (uint8 [rows, row_bytes])."""
    f = gf.fmt(name)
    gen = np.random.default_rng(seed)
    if name in QUANTIZER:
        from gguf import GGMLQuantizationType, quants

        w = (gen.standard_normal((rows, k)) * 0.05).astype(np.float32)
        w[:, :7] *= 8  # an outlier column per row or two: blocks with very different scales
        return torch.from_numpy(np.ascontiguousarray(quants.quantize(w, GGMLQuantizationType[name])).reshape(rows, -1))
    nblk = rows * k // f.block_weights
    raw = gen.integers(0, 256, (nblk, f.block_bytes), dtype=np.uint8)
    scales = gen.uniform(0.0005, 0.02, (nblk, 2))
    if name in ("Q4_K", "Q5_K"):  # d, dmin first
        raw[:, :4] = _fp16_bytes(scales)
    elif name == "Q6_K":  # d last
        raw[:, 208:] = _fp16_bytes(scales[:, :1])
    elif name in ("IQ4_NL", "IQ4_XS"):  # d first
        raw[:, :2] = _fp16_bytes(scales[:, :1])
    return torch.from_numpy(raw.reshape(rows, -1))


def packed_linear(blocks: torch.Tensor, name: str, k: int) -> GGUFLinear:
    lin = GGUFLinear(k, blocks.shape[0], gf.fmt(name).type_id)
    lin.load_weight("weight", GGUFBlocks(gf.fmt(name).type_id, blocks), None)
    return lin


def check(lin: GGUFLinear, blocks: torch.Tensor, name: str, rows: tuple[int, ...] = (1, 16, 70)) -> None:
    exact = dequantize_blocks(blocks, gf.fmt(name).type_id)
    dense = lin.dequantize()
    assert torch.equal(dense.view(torch.int32), exact.view(torch.int32))  # bit for bit, signed zeros too
    picked = torch.tensor([0, 5, 8, exact.shape[0] - 1])
    assert torch.equal(lin.dequantize_rows(picked), exact[picked])
    w = exact.double()
    gen = torch.Generator().manual_seed(1)
    for m in rows:
        x = torch.randn(m, exact.shape[1], generator=gen)
        ref = x.double() @ w.T
        y = torch.ops.localllm_cpu.gguf_linear(x, lin.packed, lin.block_type, 2)
        scale = (x.double().abs() @ w.abs().T).clamp_min(1e-6)
        # what the kernel multiplies: the file's exact weights by the two-level int8
        # activations, up to fp32 sums (a wrong layout, scale or offset is off by O(1))
        assert ((y.double() - quantized_x(x, 2).double() @ w.T).abs() / scale).max() < 1e-5, (name, m)
        # and two levels carry ~14 bits of each activation block: ~1e-4 of the float product
        assert ((y.double() - ref).abs() / scale).max() < 2e-3, (name, m)
        # a row's result does not depend on the batch: rows in whole 16s (the AMX kernel where
        # the CPU has it) and the rows past them (the VNNI row tiles) alike
        for i in {0, m // 2, m - 1}:
            one = torch.ops.localllm_cpu.gguf_linear(x[i : i + 1], lin.packed, lin.block_type, 2)
            assert torch.equal(one[0], y[i]), (name, m, i)


@pytest.mark.parametrize("name", KERNEL_TYPES)
def test_every_packed_type_is_the_files_weight_and_multiplies_on_it(name: str) -> None:
    k = 512  # two super-blocks: the K-quants' per-256 fields are indexed, not just the first
    blocks = random_blocks(name, 24, k)  # three tiles: an AVX-512 pair and a lone tile
    lin = packed_linear(blocks, name, k)
    check(lin, blocks, name)


@pytest.mark.parametrize("name", KERNEL_TYPES)
def test_packed_size_is_the_files(name: str) -> None:
    """Memory ~ file size: the packed layout holds the same bits per weight as the file,
    within 10% (the K-quants' 6-bit scales take a byte each)."""
    f = gf.fmt(name)
    assert packed_layout(f.type_id).bits_per_weight() <= 1.1 * f.bits_per_weight
    blocks = random_blocks(name, 8, 256)
    lin = packed_linear(blocks, name, 256)
    assert sum(p.numel() * p.element_size() for p in lin.packed) <= 1.1 * blocks.numel()


def test_a_type_without_a_kernel_says_so() -> None:
    from localllm.errors import LocalLLMError

    with pytest.raises(LocalLLMError, match="Q3_K has no CPU kernel"):
        GGUFLinear(256, 8, gf.fmt("Q3_K").type_id)


@pytest.mark.skipif(not GEMMA.is_file(), reason=f"the Gemma 3 270M Q4_K_M fixture is not at {GEMMA}")
def test_the_real_q4_k_m_files_tensors() -> None:
    """One tensor of each type of the real file (Q4_K, Q6_K, Q5_0, Q8_0), its first 64 rows."""
    from gguf import GGUFReader

    seen: set[str] = set()
    for t in GGUFReader(GEMMA).tensors:
        name = t.tensor_type.name
        if name in seen or name not in KERNEL_TYPES or t.name == "token_embd.weight":
            continue
        seen.add(name)
        k = int(t.shape[0])
        blocks = torch.from_numpy(np.ascontiguousarray(t.data[:64])).reshape(64, -1)
        check(packed_linear(blocks, name, k), blocks, name, rows=(1, 16))
    assert {"Q4_K", "Q6_K", "Q5_0", "Q8_0"} <= seen
