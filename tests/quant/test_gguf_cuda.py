"""GGUF blocks kept as stored on the GPU's code path: a Q4_K_M-like file (Q4_K, Q6_K, Q5_0,
Q8_0, and a Q3_K tensor no kernel takes) planned and loaded for the Triton kernels, run in a
rehearsal (``LOCALLLM_TRITON_ON_CPU``: the CUDA code path on CPU tensors, the kernels under
the interpreter) against the CPU's own GGUF path on the same file.

The file is a tiny llama (hidden 256: one K-quant super-block per row) written here; its
K-quant blocks are llama.cpp's own (tests/fixtures/gguf_blocks.gguf), the other types come
from the ``gguf`` package's quantizer. Shapes are tiny: the interpreter costs milliseconds per
program.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from localllm.kernels import _triton, cpu_ops
from localllm.quant import gguf_formats as gf
from tests.models.gguf_files import BLOCKS_FIXTURE, LlamaDims, random_llama_weights, spm_vocab, train_sentencepiece
from tests.models.gguf_files import write_llama_gguf

gguf_linear_mod = pytest.importorskip("localllm.kernels.gguf_linear")

DIMS = LlamaDims(hidden=256, ffn=256, heads=4, kv_heads=2, layers=1)  # ~0.2 s per kernel launch interpreted
# llama.cpp's tensor name -> its type here: the Q4_K_M recipe's types (attn_v and ffn_down in
# Q6_K, token_embd Q4_K), a fused q/k/v of three types, and a Q3_K ffn_up no kernel takes (a
# fused gate/up of Q4_K and Q8_0 then). The head is Q8_0 from random floats: the fixture's
# K-quant rows repeat, which would tie logits.
MIX = {
    "blk.0.attn_q.weight": "Q4_K", "blk.0.attn_k.weight": "Q5_0", "blk.0.attn_v.weight": "Q6_K",
    "blk.0.attn_output.weight": "Q8_0", "blk.0.ffn_gate.weight": "Q4_K", "blk.0.ffn_up.weight": "Q3_K",
    "blk.0.ffn_down.weight": "Q6_K",
    "token_embd.weight": "Q4_K", "output.weight": "Q8_0",
}
LLAMA_CPP_ONLY = ("Q3_K", "Q4_K", "Q6_K")  # no quantizer in the gguf package


def _llama_cpp_super_blocks(kind: str, rows: int, cols: int) -> np.ndarray:
    """``[rows, cols]`` of ``kind`` from the fixture's llama.cpp blocks, one 256-weight super-block
    at a time (a super-block is self-contained, so any sequence of them is a valid row)."""
    from localllm.models.gguf_file import read_gguf

    _, tensors = read_gguf(BLOCKS_FIXTURE)
    f = gf.fmt(kind)
    src = np.array(tensors[kind].data).reshape(-1, f.block_bytes)  # every super-block of the fixture
    per_row = cols // f.block_weights
    pick = (np.arange(rows)[:, None] * per_row + np.arange(per_row)[None, :] * 7) % src.shape[0]
    return np.ascontiguousarray(src[pick].reshape(rows, per_row * f.block_bytes))


@pytest.fixture(scope="module")
def q4_k_m_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gguf import GGMLQuantizationType, quants

    def encode(name: str, t: torch.Tensor) -> tuple[np.ndarray, int] | None:
        kind = GGMLQuantizationType[MIX[name]]
        if MIX[name] in LLAMA_CPP_ONLY:
            return _llama_cpp_super_blocks(MIX[name], *t.shape), int(kind)
        return np.ascontiguousarray(quants.quantize(t.numpy(), kind)), int(kind)

    tokens, scores, types = spm_vocab(train_sentencepiece("unigram"))
    pad = -len(tokens) % 64  # the CPU's head tiles rows by 8
    tokens, scores, types = tokens + [f"<unused{i}>" for i in range(pad)], scores + [-1000.0] * pad, types + [5] * pad
    path = tmp_path_factory.mktemp("q4km") / "tiny-q4_k_m.gguf"
    write_llama_gguf(path, tokens, scores, types, random_llama_weights(len(tokens), seed=3, dims=DIMS), dims=DIMS,
                     encode=encode)
    return path


@pytest.fixture
def rehearse(monkeypatch: pytest.MonkeyPatch) -> Callable[[bool], None]:
    """rehearse(True) sends CPU tensors through the Triton path, as LOCALLLM_TRITON_ON_CPU=1 does."""
    if not (_triton.HAS_TRITON and _triton.INTERPRET):
        pytest.skip("a rehearsal needs Triton and TRITON_INTERPRET=1")

    def switch(on: bool) -> None:
        monkeypatch.setattr(_triton, "REHEARSAL", on)

    return switch


class GGUFLaunches:
    """Counts launches of the GGUF Triton kernel by path (GEMV for decode rows, dot tiles above)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.counts: Counter[str] = Counter()
        kernel = gguf_linear_mod._gguf_matmul_kernel
        original = kernel.run

        def run(*args: Any, **kw: Any) -> Any:
            self.counts["gemm" if kw["USE_DOT"] else "gemv"] += 1
            self.counts[gf.type_name(kw["FORMAT"])] += 1
            return original(*args, **kw)

        monkeypatch.setattr(kernel, "run", run)


def _modules(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    from localllm.quant.gguf_modules import GGUFShardedLinear

    for name, m in model.named_modules():
        if isinstance(m, GGUFShardedLinear):
            yield from ((f"{name}.parts.{i}", p) for i, p in enumerate(m.parts))
        elif getattr(m, "method", None) == "gguf" and ".parts." not in name:  # parts: yielded above
            yield name, m


def test_the_traits_tables_gpu_types_are_the_kernels() -> None:
    assert {gf.type_name(t) for t in gf.triton_kernel_types()} == set(gguf_linear_mod.FORMATS)
    assert gf.fmt(gf.FALLBACK).gpu  # a type without a kernel is rounded again to one that has one


def test_a_gpu_linear_holds_the_files_blocks_and_its_packed_view_follows_its_buffers() -> None:
    from localllm.quant.gguf import GGUFBlocks
    from localllm.quant.gguf_cuda import GGUFLinearCUDA

    raw = torch.from_numpy(_llama_cpp_super_blocks("Q6_K", 24, 512))
    with torch.device("meta"):
        lin = GGUFLinearCUDA(512, 24 + 8, gf.fmt("Q6_K").type_id, [24, 8])
    lin = lin.to_empty(device="cpu")  # where the loader puts the model
    assert lin.blocks.device.type == "cpu" and lin.packed is None
    lin.load_weight("weight", GGUFBlocks(gf.fmt("Q6_K").type_id, raw), 0)
    lin.load_weight("weight", GGUFBlocks(gf.fmt("Q6_K").type_id, raw[:8]), 1)
    assert lin.packed is not None and "blocks" not in dict(lin.named_buffers())
    want = torch.cat([gguf_linear_mod.dequantize_packed(gguf_linear_mod.pack_gguf_blocks(r, "Q6_K"))
                      for r in (raw, raw[:8])])
    assert torch.equal(lin.dequantize(), want)
    assert torch.equal(lin.dequantize_rows(torch.tensor([30, 1])), want[[30, 1]])
    assert lin.packed.nbytes() == raw.numel() + raw[:8].numel()  # the file's bytes, no more
    x = torch.randn(3, 512)
    assert torch.allclose(lin(x), x @ want.T, atol=1e-4, rtol=1e-4)
    lin.to("meta")
    assert lin.packed.codes.device.type == "meta" and lin.packed.codes is lin.codes
    with pytest.raises(Exception, match="Q3_K has no GPU kernel"):
        GGUFLinearCUDA(512, 8, gf.fmt("Q3_K").type_id)


# ---- planning: what a GPU plan is given for the file ----


def test_a_gpu_plan_keeps_the_files_blocks_and_sizes_them_as_stored(q4_k_m_file: Path) -> None:
    from tests.hardware.hwfixtures import gpu_hw

    from localllm.hardware.planner import plan
    from localllm.models.formats import open_checkpoint
    from localllm.models.gguf_file import gguf_weights_from_file
    from localllm.models.loader import gguf_plan_inputs

    ckpt = open_checkpoint(q4_k_m_file)
    hw = gpu_hw("RTX 4090")
    cpu_line, gpu_line, weights = gguf_plan_inputs(ckpt, hw)
    assert cpu_line is None and gpu_line is not None and weights is not None and weights.kernels == "triton"
    p = plan(ckpt.config, hw, gguf=weights, gpu_gguf=gpu_line, name="tiny")
    assert p.device == "cuda" and p.quant == "gguf" and p.weight_dtype == "bfloat16"
    # the reason line: each stored type on the Triton kernels, the Q3_K named with its fate
    assert p.precision_reason.startswith("gguf blocks as stored (Triton kernels on the GPU")
    assert "no Triton kernel, rounded again to Q8_0: Q3_K x1" in p.precision_reason
    linears = Counter(kind for name, kind in MIX.items() if name != "token_embd.weight")  # the head: output
    assert all(re.search(rf"\b{kind} x{n}\b", p.precision_reason) for kind, n in linears.items())
    assert "head Q8_0, embedding lookups from its own Q4_K blocks" in p.precision_reason
    # VRAM weights: the file's tensor bytes, the Q3_K tensor at Q8_0's size
    stored = gguf_weights_from_file(q4_k_m_file)
    q3 = next(t for t in ckpt.block_types.items() if t[1] == gf.fmt("Q3_K").type_id)[0]
    q3_weights = DIMS.ffn * DIMS.hidden
    grown = gf.fmt("Q8_0").nbytes(q3_weights) - gf.fmt("Q3_K").nbytes(q3_weights)
    assert q3.endswith("up_proj.weight") and p.weight_bytes == stored.tensor_bytes + grown
    # asked for another dtype, a GPU still keeps the blocks (the activations take it)
    assert gguf_plan_inputs(ckpt, hw, "float16")[1] == gpu_line


def test_the_probe_sizes_the_file_for_a_gpu_as_the_engine_would_load_it(
    q4_k_m_file: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    import json

    from localllm.cli import main

    assert main(["probe", "--model", str(q4_k_m_file), "--gpu", "RTX 4090", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["models"]
    assert row["precision"] == "gguf" and row["reason"].startswith("gguf blocks as stored (Triton kernels on the GPU")
    assert "no Triton kernel, rounded again to Q8_0: Q3_K x1" in row["reason"]


# ---- the rehearsal: the CUDA code path, end to end ----


def _engine(path: Path, **kw: Any) -> Any:
    from localllm.engine.engine import EngineConfig, LLMEngine

    cfg = dict(model=str(path), device="cpu", max_model_len=128, block_size=8, compile=False, max_num_seqs=4)
    return LLMEngine(EngineConfig(**{**cfg, **kw}))


def _greedy(engine: Any) -> list[list[int]]:
    from localllm.engine.sequence import SamplingParams

    prompts = [[1, 45, 300, 17, 88, 230, 9, 140, 61, 77, 12, 5], [1, 33, 200]]  # 12 rows: the GEMM; a decode of 2: GEMV
    # two tokens: the prefill's and one decode step's (each interpreted launch costs ~0.2 s)
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.skipif(not cpu_ops.has_gguf_kernels(), reason="the CPU's GGUF path needs an x86-64-v3 CPU")
def test_the_rehearsal_runs_the_blocks_on_the_triton_kernels_with_the_cpu_paths_tokens(
    q4_k_m_file: Path, rehearse: Callable[[bool], None], monkeypatch: pytest.MonkeyPatch,
) -> None:
    from localllm.models import gguf_file
    from localllm.quant.gguf import GGUFLinear
    from localllm.quant.gguf_cuda import GGUFLinearCUDA
    from localllm.quant.gguf_modules import GGUFEmbedding, GGUFShardedLinear

    cpu = _engine(q4_k_m_file)
    assert cpu.runner.model.lm_head.__class__ is GGUFLinear
    want = _greedy(cpu)
    del cpu

    rehearse(True)
    launches = GGUFLaunches(monkeypatch)
    dequantized: list[str] = []  # tensors the checkpoint dequantized to float on the way in
    real = gguf_file.dequantize
    monkeypatch.setattr(gguf_file, "dequantize", lambda t, path: dequantized.append(t.name) or real(t, path))
    engine = _engine(q4_k_m_file)
    model = engine.runner.model
    got = _greedy(engine)
    assert got == want

    # every linear holds the file's blocks for the Triton kernels; the Q3_K one rounded to Q8_0
    kinds = {name: m.fmt for name, m in _modules(model)}
    assert all(isinstance(m, GGUFLinearCUDA) for _, m in _modules(model)), kinds
    assert kinds["model.layers.0.self_attn.qkv_proj.parts.2"] == "Q6_K"
    assert kinds["model.layers.0.mlp.gate_up_proj.parts.1"] == "Q8_0"  # Q3_K: no kernel
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, GGUFShardedLinear)
    assert isinstance(model.model.embed_tokens, GGUFEmbedding) and model.model.embed_tokens.weight.numel() == 0
    assert model.model.embed_tokens.table.fmt == "Q4_K" and kinds["lm_head"] == "Q8_0"
    # nothing was dequantized at load but the float tensors and the one type without a kernel
    assert sorted(n for n in dequantized if not n.endswith("norm.weight")) == ["blk.0.ffn_up.weight"]
    # both kernel paths ran, on every kept type
    assert launches.counts["gemv"] and launches.counts["gemm"], dict(launches.counts)
    assert all(launches.counts[k] for k in ("Q4_K", "Q6_K", "Q5_0", "Q8_0")), dict(launches.counts)


def test_the_rehearsal_holds_the_files_bytes_and_its_weights(
    q4_k_m_file: Path, rehearse: Callable[[bool], None],
) -> None:
    """Each module dequantizes to exactly the file's weight (Q/K rows in HF order); the model
    holds what the plan sized: the file's tensor bytes, the Q3_K tensor at Q8_0's size."""
    from localllm.models.gguf_file import dequantize, gguf_weights_from_file, read_gguf, unpermute
    from localllm.models.loader import load_model
    from localllm.quant.gguf import dequantize_blocks, quantize_blocks

    rehearse(True)
    loaded = load_model(str(q4_k_m_file), device="cpu", compile=False)
    assert loaded.plan.quant == "gguf" and loaded.precision == "gguf-q4_k/q5_0/q6_k/q8_0"
    assert "Triton kernels" in loaded.plan.precision_reason
    _, tensors = read_gguf(q4_k_m_file)

    def file_weight(name: str) -> torch.Tensor:
        w = torch.from_numpy(dequantize(tensors[name], q4_k_m_file))
        heads = {"attn_q": DIMS.heads, "attn_k": DIMS.kv_heads}.get(name.split(".")[-2])
        w = unpermute(w, heads) if heads else w
        return w if MIX[name] != "Q3_K" else dequantize_blocks(quantize_blocks(w, 8), 8)

    model = loaded.model
    layer = model.model.layers[0]
    for module, names in ((layer.self_attn.qkv_proj, [f"blk.0.attn_{s}.weight" for s in "qkv"]),
                          (layer.mlp.gate_up_proj, ["blk.0.ffn_gate.weight", "blk.0.ffn_up.weight"]),
                          (layer.mlp.down_proj, ["blk.0.ffn_down.weight"]), (model.lm_head, ["output.weight"])):
        assert torch.equal(module.dequantize(), torch.cat([file_weight(n) for n in names])), names
    ids = torch.tensor([[0, 5, 63], [64, 200, model.model.embed_tokens.num_embeddings - 1]])
    assert torch.equal(model.model.embed_tokens(ids), file_weight("token_embd.weight")[ids])

    sized = gguf_weights_from_file(q4_k_m_file)
    assert loaded.plan.weight_bytes == sized.memory_bytes(model.config, 4)  # the CPU plan, Triton's sizes
    held = sum(t.numel() * t.element_size() for t in [*model.buffers(), *model.parameters()])
    rope = model.cos_sin.numel() * model.cos_sin.element_size()
    luts = sum(m.lut.numel() * 4 for _, m in _modules(model))
    assert held - rope - luts == loaded.plan.weight_bytes


def test_a_decode_bucket_on_gguf_blocks_makes_no_host_sync(
    q4_k_m_file: Path, rehearse: Callable[[bool], None], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What CUDA-graph capture needs of the GPU's GGUF path: a decode bucket's forward (the
    embedding's row lookup from blocks, the GEMVs of every type, the fused shards) never
    reads a value back or copies across devices, after the warm-ups made every choice."""
    from tests.engine.test_rehearsal import NoHostSync

    rehearse(True)
    runner = _engine(q4_k_m_file, max_num_seqs=1).runner
    runner._capture_graphs(1)
    launches = GGUFLaunches(monkeypatch)
    with NoHostSync() as mode:
        out = runner._decode_call(1).clone()
    assert mode.ops and out.shape[0] == 1 and torch.isfinite(out).all()
    assert launches.counts["gemv"] >= 7 and not launches.counts["gemm"], dict(launches.counts)  # every linear's GEMV
