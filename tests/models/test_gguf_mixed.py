"""A GGUF file's mix of block types loads as stored on a CPU plan: each tensor whose type the
CPU kernels take keeps the file's blocks (no second rounding), a type without one is named in
the plan's reason line with what happens to it (rounded again to Q8_0), fused shards of
different types stay as stored side by side, and the embedding lookup reads blocks.

The file is a tiny llama written here: blocks of the types the ``gguf`` package quantizes come
from its quantizer; the K-quant and IQ4 blocks are llama.cpp's own, from the committed
tests/fixtures/gguf_blocks.gguf, their 512-weight rows repeated down each matrix. What is
expected follows the traits table (localllm.quant.gguf_formats), so the test holds whichever
kernels exist: a type gains a kernel there, and its tensors must then come through as stored.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from localllm.kernels import cpu_ops
from localllm.quant import gguf_formats as gf
from tests.models.gguf_files import (
    LlamaDims, llama_cpp_blocks, random_llama_weights, spm_vocab, train_sentencepiece, write_llama_gguf,
)

pytestmark = pytest.mark.skipif(not cpu_ops.has_gguf_kernels(), reason="GGUF kernels need an x86-64-v3 CPU")

LLAMA_CPP_ONLY = ("Q4_K", "Q5_K", "Q6_K", "IQ4_XS")
DIMS = LlamaDims(hidden=512, ffn=512, heads=4, kv_heads=2, layers=2)  # every row 512 weights: 2 super-blocks
# llama.cpp's tensor name -> its type in this file: per layer, a Q4_K_M-like mix (q/k/v of two or
# three types in one fused qkv_proj), and every type the loader may meet
MIX = {
    "blk.0.attn_q.weight": "Q4_K", "blk.0.attn_k.weight": "Q4_K", "blk.0.attn_v.weight": "Q6_K",
    "blk.0.attn_output.weight": "Q5_0", "blk.0.ffn_gate.weight": "Q5_1", "blk.0.ffn_up.weight": "Q5_1",
    "blk.0.ffn_down.weight": "IQ4_XS",
    "blk.1.attn_q.weight": "Q5_0", "blk.1.attn_k.weight": "Q5_0", "blk.1.attn_v.weight": "Q8_0",
    "blk.1.attn_output.weight": "Q4_K", "blk.1.ffn_gate.weight": "Q4_0", "blk.1.ffn_up.weight": "Q4_1",
    "blk.1.ffn_down.weight": "Q5_K",
    "token_embd.weight": "Q8_0", "output.weight": "Q6_K",
}
HF = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
      "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
      "ffn_down": "mlp.down_proj"}


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gguf import GGMLQuantizationType, quants

    def encode(name: str, t: torch.Tensor) -> tuple[np.ndarray, int] | None:
        kind = GGMLQuantizationType[MIX[name]]
        if MIX[name] in LLAMA_CPP_ONLY:  # no quantizer in the gguf package: llama.cpp's blocks
            return llama_cpp_blocks(MIX[name], *t.shape), int(kind)
        return np.ascontiguousarray(quants.quantize(t.numpy(), kind)), int(kind)

    tokens, scores, types = spm_vocab(train_sentencepiece("unigram"))
    pad = -len(tokens) % 64  # the head's rows tile by 8 for the block linears
    tokens, scores, types = tokens + [f"<unused{i}>" for i in range(pad)], scores + [-1000.0] * pad, types + [5] * pad
    path = tmp_path_factory.mktemp("mixed") / "mixed.gguf"
    write_llama_gguf(path, tokens, scores, types, random_llama_weights(len(tokens), dims=DIMS), dims=DIMS,
                     encode=encode)
    return path


@pytest.fixture(scope="module")
def loaded(mixed: Path):  # noqa: ANN201 - a LoadedModel
    from localllm.models.loader import load_model

    return load_model(str(mixed), device="cpu", compile=False)


def _memory_type(name: str) -> str:
    f = gf.fmt(MIX[name])
    return f.name if f.cpu_kernel else gf.FALLBACK


def test_the_reason_line_names_each_type_and_what_runs_it(loaded) -> None:  # noqa: ANN001
    assert loaded.plan.quant == "gguf"
    (line,) = [r for r in loaded.plan.reasons if r.startswith("gguf blocks") or r.startswith("no CPU kernel")]
    counts: dict[str, int] = {}
    for name, kind in MIX.items():
        if name != "token_embd.weight":  # the untied model's head is output.weight
            counts[kind] = counts.get(kind, 0) + 1
    kept_part, _, rest = line.partition("; no CPU kernel, rounded again to Q8_0: ")
    for kind, n in counts.items():
        where = kept_part if gf.fmt(kind).cpu_kernel else rest
        assert re.search(rf"\b{kind} x{n}\b", where), (kind, line)
    assert "head Q6_K, embedding lookups from its own Q8_0 blocks" in line
    assert len(line) < 400  # one short line, not one entry per module
    linears = {_memory_type(n) for n in MIX if n != "token_embd.weight"}
    assert loaded.precision == "gguf-" + "/".join(sorted(linears)).lower()


def test_each_tensor_keeps_the_files_blocks_where_a_kernel_takes_its_type(loaded, mixed: Path) -> None:  # noqa: ANN001
    from localllm.models.gguf_file import dequantize, read_gguf, unpermute
    from localllm.quant.gguf import GGUFLinear, quantize_blocks, dequantize_blocks
    from localllm.quant.gguf_modules import GGUFEmbedding, GGUFShardedLinear

    model = loaded.model
    _, tensors = read_gguf(mixed)

    def file_weight(name: str) -> torch.Tensor:
        w = torch.from_numpy(dequantize(tensors[name], mixed))
        heads = {"attn_q": DIMS.heads, "attn_k": DIMS.kv_heads}.get(name.split(".")[-2])
        return unpermute(w, heads) if heads else w

    def check(module: torch.nn.Module, names: list[str]) -> None:
        """``module`` holds ``names`` (its shards, in order) each in its in-memory type, with
        exactly the file's values where kept, the values rounded once more to Q8_0 where not."""
        wanted = [_memory_type(n) for n in names]
        if len(set(wanted)) > 1:
            assert isinstance(module, GGUFShardedLinear)
            parts = list(module.parts)
        else:
            assert isinstance(module, GGUFLinear)
            parts = [module]
        got = [gf.type_name(p.block_type) for p in parts]
        assert got == (wanted if len(parts) > 1 else wanted[:1]), (names, got)
        actual = module.dequantize()
        start = 0
        for name in names:
            w = file_weight(name)
            rows = actual[start : start + w.shape[0]]
            start += w.shape[0]
            if gf.fmt(MIX[name]).cpu_kernel:
                assert torch.equal(rows, w), name  # the file's blocks: no second rounding
            else:
                assert torch.equal(rows, dequantize_blocks(quantize_blocks(w, 8), 8)), name

    for i in range(DIMS.layers):
        layer = model.model.layers[i]
        check(layer.self_attn.qkv_proj, [f"blk.{i}.attn_{s}.weight" for s in "qkv"])
        check(layer.self_attn.o_proj, [f"blk.{i}.attn_output.weight"])
        check(layer.mlp.gate_up_proj, [f"blk.{i}.ffn_gate.weight", f"blk.{i}.ffn_up.weight"])
        check(layer.mlp.down_proj, [f"blk.{i}.ffn_down.weight"])
    check(model.lm_head, ["output.weight"])
    # the untied embedding: its own Q8_0 blocks, looked up row by row (no float table)
    embed = model.model.embed_tokens
    assert isinstance(embed, GGUFEmbedding) and embed.weight.numel() == 0
    ids = torch.tensor([[0, 5, 63], [64, 200, embed.num_embeddings - 1]])
    assert torch.equal(embed(ids), file_weight("token_embd.weight")[ids])


def test_a_kept_linear_multiplies_like_its_file_weight(loaded, mixed: Path) -> None:  # noqa: ANN001
    """The kernels run the stored blocks: each kept shard's output is the file weight's product
    up to the int8 activations' rounding."""
    from localllm.quant.gguf_modules import GGUFShardedLinear

    model = loaded.model
    x = torch.randn(3, DIMS.hidden, generator=torch.Generator().manual_seed(0))
    for module in (model.model.layers[0].self_attn.qkv_proj, model.model.layers[1].mlp.down_proj, model.lm_head):
        parts = list(module.parts) if isinstance(module, GGUFShardedLinear) else [module]
        y = module(x)
        ref = x @ torch.cat([p.dequantize() for p in parts]).T
        assert y.shape == ref.shape
        assert (y - ref).norm() <= 1e-2 * ref.norm()


def test_the_plan_sizes_the_file_as_it_is_held(loaded, mixed: Path) -> None:  # noqa: ANN001
    """Planned weights: each tensor's stored bytes, a type without a kernel at Q8_0's size, no
    float embedding table; what the modules hold is that, up to the packed layouts' own scales."""
    from localllm.models.gguf_file import gguf_weights_from_file

    weights = gguf_weights_from_file(mixed)
    assert loaded.plan.weight_bytes == weights.memory_bytes(loaded.model.config, 4)
    in_memory = sum(t.numel() * t.element_size() for t in [*loaded.model.buffers(), *loaded.model.parameters()]
                    if t.device.type != "meta")
    rope = loaded.model.cos_sin.numel() * loaded.model.cos_sin.element_size()
    assert 0.9 * loaded.plan.weight_bytes <= in_memory - rope <= 1.15 * loaded.plan.weight_bytes
