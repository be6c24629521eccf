"""The GPU GGUF kernels (kernels/gguf_linear.py) under the Triton interpreter: for every type
they take, the packed layout holds the file's bytes, its torch dequantization is the ``gguf``
package's own bit for bit, and the one kernel body (decode GEMV without tensor-core tiles,
batched-decode and prefill ``tl.dot``) multiplies by exactly those weights: x @ W.T within fp32
rounding at M = 1, 3 (GEMV), 17 (split-K dot, all rows in one tile) and 70 (prefill GEMM); the
dequantize kernel of prefill's dequantize-then-cuBLAS writes those weights bit for bit.

Blocks: the gguf package's quantizer where it has one; for the K-quants and IQ4 the
llama.cpp-written fixture rows (tests/fixtures/gguf_blocks.gguf), plus as many rows whose
code and scale bytes are random (every bit pattern is a valid block) under the fixture's own
fp16 fields, so every 6-bit scale/min packing and negative Q6_K scale is decoded."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from localllm.kernels.gguf_linear import (
    FORMATS,
    GGUFPacked,
    dequantize_packed,
    dequantize_rows,
    gguf_linear,
    gguf_linear_reference,
    gguf_linear_triton,
    gpu_layout,
    pack_gguf_blocks,
)
from localllm.quant import gguf_formats as gf
from tests.kernels.conftest import ON_GPU
from tests.models.gguf_files import llama_cpp_blocks

pytestmark = pytest.mark.interpreter
QUANTIZER = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4"}  # gguf.quants.quantize exists for these
# Q4_K_M files mix the first four.
# The kernels' tensors: CPU under the interpreter, CUDA for real (bench/gpu_check.py's tests).
DEV = torch.device("cuda" if ON_GPU else "cpu")
ORDER = ["Q4_K", "Q6_K", "Q5_0", "Q8_0", "Q5_K", "Q4_0", "Q4_1", "Q5_1", "IQ4_NL", "IQ4_XS", "MXFP4"]


def test_the_order_covers_every_type_the_kernels_take() -> None:
    assert set(ORDER) == FORMATS


def file_blocks(name: str, rows: int = 32, k: int = 512, seed: int = 0) -> torch.Tensor:
    """uint8 [rows, row bytes]: ``rows`` x ``k`` weights of type ``name`` as a file stores them."""
    gen = np.random.default_rng(seed)
    if name in QUANTIZER:
        from gguf import GGMLQuantizationType, quants

        w = (gen.standard_normal((rows, k)) * 0.05).astype(np.float32)
        w[:, :5] *= 8  # outlier columns: blocks with very different scales
        return torch.from_numpy(np.ascontiguousarray(quants.quantize(w, GGMLQuantizationType[name])).reshape(rows, -1))
    half = llama_cpp_blocks(name, rows // 2, k)
    f = gf.fmt(name)
    noisy = half.reshape(rows // 2, -1, f.block_bytes).copy()
    offset = 0
    for field in f.fields:  # random codes and scale bytes, the fixture's fp16 d / dmin kept
        if field.name not in ("d", "dmin"):
            part = noisy[:, :, offset:offset + field.nbytes]
            part[...] = gen.integers(0, 256, part.shape)
        offset += field.nbytes
    return torch.from_numpy(np.concatenate([half, noisy.reshape(rows // 2, -1)]))


def gguf_weights(blocks: torch.Tensor, name: str) -> torch.Tensor:
    from gguf import GGMLQuantizationType, quants

    return torch.from_numpy(np.ascontiguousarray(quants.dequantize(blocks.numpy(), GGMLQuantizationType[name])))


def kernel(x: torch.Tensor, p: GGUFPacked) -> torch.Tensor:
    """``gguf_linear_triton``: the interpreter's small tiles on CPU; on a GPU each path's first
    GPU config, pinned (autotuning all eleven types would compile four times the kernels, and
    the GPU check's tests have minutes, not ten)."""
    if not ON_GPU:
        return gguf_linear_triton(x, p)
    import importlib

    gl = importlib.import_module("localllm.kernels.gguf_linear")
    path = gl._path(x.numel() // x.shape[-1])
    config = {"gemv": gl._GEMV_CONFIGS, "small": gl._SMALL_CONFIGS, "gemm": gl._GEMM_CONFIGS}[path][0]
    return gguf_linear_triton(x, p, config=config)


def assert_product(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, tol: float) -> None:
    """y ~= x @ w.T, each entry within ``tol`` of the sum of its terms' magnitudes."""
    x, y = x.cpu(), y.cpu()
    ref = x.double() @ w.double().T
    scale = (x.double().abs() @ w.double().abs().T).clamp_min(1e-6)
    assert y.shape == ref.shape and y.dtype == x.dtype
    assert ((y.double() - ref).abs() / scale).max() < tol


@pytest.mark.parametrize("name", ORDER)
def test_the_layout_is_the_files_bytes_and_dequantizes_as_gguf(name: str) -> None:
    blocks = file_blocks(name)
    p = pack_gguf_blocks(blocks, name)
    assert (p.out_features, p.in_features) == (32, 512)
    assert p.nbytes() == blocks.numel() == 32 * gpu_layout(name).row_bytes(512) == 32 * gf.fmt(name).row_bytes(512)
    exact = gguf_weights(blocks, name)
    assert torch.equal(dequantize_packed(p).view(torch.int32), exact.view(torch.int32))  # signed zeros too
    ids = torch.tensor([31, 0, 17, 17])
    assert torch.equal(dequantize_rows(p, ids), exact[ids])
    assert dequantize_rows(p, ids, torch.float16).dtype == torch.float16


@pytest.mark.parametrize("name", ORDER)
def test_the_kernel_multiplies_by_the_files_weights(name: str) -> None:
    """fp32 activations: decode GEMV at M = 1 and 3, the split-K dot of a batch of decodes
    (a 32-row tile), the prefill GEMM."""
    blocks = file_blocks(name, seed=1)
    p = pack_gguf_blocks(blocks.to(DEV), name)
    w = gguf_weights(blocks, name)
    for m in (1, 3, 17, 70):
        x = torch.randn(m, 512, device=DEV)
        assert_product(kernel(x, p), x, w, 2e-6)
    # a row's result does not depend on which path or batch it ran in, beyond fp32 sums
    x = torch.randn(17, 512, device=DEV)
    torch.testing.assert_close(kernel(x[:1], p)[0], kernel(x, p)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0"])
def test_half_activations(name: str) -> None:
    """fp16 x: the GEMV multiplies in fp32, the dot in fp16 with the weights rounded once."""
    blocks = file_blocks(name, seed=2)
    p = pack_gguf_blocks(blocks.to(DEV), name)
    w = gguf_weights(blocks, name)
    for m in (1, 17):
        x = torch.randn(m, 512, device=DEV).half()
        assert_product(kernel(x, p), x, w, 2e-3)


@pytest.mark.parametrize("name", ["Q5_0", "Q4_1"])
def test_ragged_shapes(name: str) -> None:
    """K not a multiple of the K tile (three 32-weight blocks) and N not a multiple of the N
    tile: the masked tails read nothing outside the weight. Also 3-D x."""
    blocks = file_blocks(name, rows=40, k=96, seed=3)
    p = pack_gguf_blocks(blocks.to(DEV), name)
    w = gguf_weights(blocks, name)
    for m in (1, 17):
        x = torch.randn(m, 96, device=DEV)
        assert_product(kernel(x, p), x, w, 2e-6)
    x3 = torch.randn(2, 3, 96, device=DEV)
    assert kernel(x3, p).shape == (2, 3, 40)
    torch.testing.assert_close(kernel(x3, p).reshape(6, 40), gguf_linear_reference(x3.reshape(6, 96), p))


def test_the_dispatcher_runs_the_reference_off_gpu() -> None:
    blocks = file_blocks("Q4_K", seed=4)
    p = pack_gguf_blocks(blocks, "Q4_K")
    x = torch.randn(3, 512)
    assert_product(gguf_linear(x, p), x, gguf_weights(blocks, "Q4_K"), 2e-6)


@pytest.mark.parametrize("name", ORDER)
def test_the_dequantize_kernel_writes_the_files_weights(name: str) -> None:
    """Prefill's dequantize-then-matmul: the Triton dequantization is the gguf package's
    bit for bit in fp32, and the product through it (in row chunks, too) is x @ W.T."""
    import importlib

    from localllm.kernels.gguf_linear import dequantize_triton, gguf_linear_dequant_mm

    blocks = file_blocks(name, seed=6)
    p = pack_gguf_blocks(blocks.to(DEV), name)
    exact = gguf_weights(blocks, name)
    assert torch.equal(dequantize_triton(p).cpu().view(torch.int32), exact.view(torch.int32))
    assert torch.equal(dequantize_triton(p, torch.float16).cpu(), exact.half())
    x = torch.randn(5, 512, device=DEV)
    assert_product(gguf_linear_dequant_mm(x, p), x, exact, 2e-6)
    module = importlib.import_module("localllm.kernels.gguf_linear")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(module, "DEQUANT_CHUNK_WEIGHTS", 7 * 512)  # 7 rows a chunk, a ragged last one
        assert_product(gguf_linear_dequant_mm(x, p), x, exact, 2e-6)


def test_a_type_without_a_kernel_and_partial_blocks_are_refused() -> None:
    with pytest.raises(ValueError, match="Q3_K has no GPU kernel"):
        pack_gguf_blocks(torch.zeros(4, 110, dtype=torch.uint8), "Q3_K")
    with pytest.raises(ValueError, match="whole blocks of 144 bytes"):
        pack_gguf_blocks(torch.zeros(4, 150, dtype=torch.uint8), "Q4_K")


def test_packing_in_row_chunks_is_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """A large matrix packs a few rows at a time (bounded transient memory): same tensors."""
    import importlib

    module = importlib.import_module("localllm.kernels.gguf_linear")  # the package re-exports a function of that name
    for name in ("Q6_K", "Q5_0"):
        blocks = file_blocks(name, seed=5)
        whole = pack_gguf_blocks(blocks, name)
        monkeypatch.setattr(module, "_PACK_WEIGHTS", 5 * 512 + 7)  # 5 rows a chunk, a ragged last chunk
        chunked = pack_gguf_blocks(blocks, name)
        monkeypatch.undo()
        for field, t in whole.tensors().items():
            assert torch.equal(t, chunked.tensors()[field]), (name, field)


GEMMA = Path(os.environ.get("LOCALLLM_GEMMA_Q4_K_M", "~/.cache/localllm-fixtures/gemma-3-270m-q4_k_m.gguf")).expanduser()


@pytest.mark.skipif(not GEMMA.is_file(), reason=f"the Gemma 3 270M Q4_K_M fixture is not at {GEMMA}")
def test_the_real_q4_k_m_files_tensors() -> None:
    """One tensor of each type of a real Q4_K_M file (Q4_K, Q6_K, Q5_0, Q8_0): the first 512
    weights (whole blocks) of its first 32 rows, through the GEMV and the GEMM."""
    from localllm.models.gguf_file import read_gguf

    seen: set[str] = set()
    for t in read_gguf(GEMMA)[1].values():
        name = t.tensor_type.name
        if name in seen or name not in FORMATS or t.name == "token_embd.weight":
            continue
        seen.add(name)
        blocks = torch.from_numpy(np.array(t.data[:32, :gf.fmt(name).row_bytes(512)]))
        p = pack_gguf_blocks(blocks.to(DEV), name)
        w = gguf_weights(blocks, name)
        assert torch.equal(dequantize_packed(p).cpu().view(torch.int32), w.view(torch.int32)), name
        for m in (1, 17):
            x = torch.randn(m, p.in_features, device=DEV)
            assert_product(kernel(x, p), x, w, 2e-6)
    assert {"Q4_K", "Q6_K", "Q5_0", "Q8_0"} <= seen


def test_the_real_compiler_takes_the_kernel(tmp_path: Path) -> None:
    """The interpreter runs Python, not PTX: Triton's own compiler and bundled ptxas (no GPU
    needed) must take the decode GEMV (1 and 4 rows, split-K) and the prefill GEMM for sm90
    without spills, the split-K stores ordered before the arrival atomic. bench/aot_check.py
    --only gguf checks every config, type and architecture."""
    import json
    import subprocess
    import sys

    triton = pytest.importorskip("triton")
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").is_file():
        pytest.skip("Triton without its bundled ptxas")
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LOCALLLM_TRITON_ON_CPU")}
    proc = subprocess.run(
        [sys.executable, str(root / "bench" / "aot_check.py"), "--arch", "90", "--only", "gguf",
         "--match", "gguf Q4_K fp16 gemv[0],gguf Q4_K fp16 gemm[0]", "--json", str(tmp_path / "r.json")],
        cwd=root, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "r.json").read_text())
    assert len(rows) == 3  # GEMV at 1 and 4 rows, GEMM
    assert all(r.get("spill_store_bytes", 0) == 0 and "error" not in r for r in rows)
    assert [r["splitk_order"] for r in rows if "gemv" in r["case"]] == ["ok", "ok"]


# ---- grouped: a MoE's routed experts, one launch per projection ----


@pytest.mark.parametrize("name", ["MXFP4", "Q4_K", "Q6_K", "Q5_0"])
def test_the_grouped_kernel_runs_each_routed_expert_on_its_rows(name: str) -> None:
    """Rows sorted by expert, expert e's rows multiplied by its slice of the stacked weight
    (4 experts x 32 rows), in one launch: a few rows per expert (the decode's FMA tiles) and
    many (dot tiles split at expert boundaries), experts without rows skipped, a tile count
    bound that leaves tiles unused; and unsorted rows, each its own tile naming its expert
    (a one-token decode). Equal to x @ W_e.T within fp32 rounding, and to the torch reference."""
    from localllm.kernels._triton import gpu_tiles
    from localllm.kernels.gguf_linear import gguf_grouped_reference, gguf_grouped_triton, grouped_path, route_rows

    experts, n = 4, 32
    blocks = file_blocks(name, rows=experts * n, seed=5)
    p = pack_gguf_blocks(blocks.to(DEV), name)
    w = gguf_weights(blocks, name).view(experts, n, -1)
    for counts in ([1, 0, 2, 1], [0, 17, 0, 5], [16, 3, 0, 0]):
        offsets = torch.tensor([0, *np.cumsum(counts)], dtype=torch.int64, device=DEV)
        x = torch.randn(sum(counts), 512, device=DEV)
        routing = route_rows(x.shape[0], experts, gpu_tiles(x), offsets=offsets)
        y = gguf_grouped_triton(x, p, routing).cpu()
        for e in range(experts):
            lo, hi = int(offsets[e]), int(offsets[e + 1])
            if hi > lo:
                assert_product(y[lo:hi], x[lo:hi].cpu(), w[e], 2e-6)
        torch.testing.assert_close(y, gguf_grouped_reference(x, p, routing).cpu(), rtol=1e-5, atol=1e-5)
    row_expert = torch.tensor([2, 0, 3, 2, 1], device=DEV)  # unsorted, one expert twice
    x = torch.randn(5, 512, device=DEV)
    routing = route_rows(5, experts, gpu_tiles(x), row_expert=row_expert)
    y = gguf_grouped_triton(x, p, routing).cpu()
    for i, e in enumerate(row_expert.tolist()):
        assert_product(y[i:i + 1], x[i:i + 1].cpu(), w[e], 2e-6)
    torch.testing.assert_close(y, gguf_grouped_reference(x, p, routing).cpu(), rtol=1e-5, atol=1e-5)
    assert grouped_path(4, 32) == "gemv" and grouped_path(64, 32) == "gemv" and grouped_path(2048, 32) == "gemm"


def test_per_row_routing_only_for_a_few_rows() -> None:
    """Unsorted rows where an expert is rarely chosen twice: one token always; a Qwen3-30B-A3B
    layer (128 experts, top-8) up to 2 tokens, gpt-oss-20b's (32, top-4) 1; a prefill never.
    Sorted tiles take 1, 2 or 4 rows on the FMA path, as many as an expert gets on average."""
    from localllm.kernels.gguf_linear import grouped_config, per_row_routing

    assert per_row_routing(1, 8, 128) and per_row_routing(2, 8, 128) and not per_row_routing(3, 8, 128)
    assert per_row_routing(1, 4, 32) and not per_row_routing(2, 4, 32) and not per_row_routing(512, 8, 128)
    assert [grouped_config(r, 128, True).kwargs["BLOCK_M"] for r in (24, 128, 256, 512, 1024)] == [1, 1, 2, 4, 16]


def test_grouped_tiles_never_straddle_experts() -> None:
    """The device-side tile table: each expert's rows in tiles of BLOCK_M from its first row,
    then -1 for the slots past the last tile."""
    from localllm.kernels.gguf_linear import grouped_tiles

    offsets = torch.tensor([0, 5, 5, 6, 14])  # 5, 0, 1, 8 rows
    expert, row0 = grouped_tiles(offsets, 4, 8)
    assert expert.tolist() == [0, 0, 2, 3, 3, -1, -1, -1]
    assert row0[:5].tolist() == [0, 4, 5, 6, 10]
