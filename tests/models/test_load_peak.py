"""Loading never holds more than the final weights plus one tensor's worth of temporaries.

A GPU allocator makes every allocation resident, so what decides whether a 7-8B model loads
on a 24 GB card is the peak of live allocations while it loads. Here the device is the CPU
and the peak is glibc's: with ``MALLOC_MMAP_THRESHOLD_`` fixed at 64 KiB every tensor above
that is its own mmap, and ``malloc_stats()`` reports the most bytes ever mapped at once
("max mmap bytes"), touched or not, exactly like a device allocator's peak. Memory-mapped
checkpoint files (safetensors, GGUF) are mapped by the readers themselves, not by malloc, so
they do not count: they are not device memory either.

Each checkpoint kind loads in its own fresh process (the peak cannot be reset), all at once.
A bf16 model of hidden 512 and 8 layers (~84 MB in bf16) makes the old failure, an fp32
model materialised before the cast (~168 MB), at least 35 MB above each bound (measured), in
every case but GGUF blocks: there every matrix is a block linear and the embedding lookup
reads blocks too, so those cases (a Q4_1 file, and a Q4_K_M-like mix of llama.cpp's K-quant
blocks, each tensor repacked from the memory-mapped file one at a time) bound the block
layouts' own transients.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.models.gguf_files import (
    LlamaDims, llama_cpp_blocks, random_llama_weights, spm_vocab, train_sentencepiece, write_llama_gguf,
)
from tests.quant.conftest import tiny_config, tiny_weights, write_hf_model

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="measures glibc's malloc")

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS, VOCAB = 512, 1536, 8, 4, 8, 16384
Q4_1 = 3  # GGMLQuantizationType, the default model's block type
MiB = 1 << 20

# Runs in a fresh process: loads one checkpoint in bf16 the way load_model does for that kind
# and prints the allocation figures; malloc_stats() then writes the peak to stderr.
SCRIPT = textwrap.dedent('''
    import ctypes, json, sys
    from pathlib import Path
    import torch
    from localllm.hardware.sizing import weight_bytes
    from localllm.models.formats import open_checkpoint
    from localllm.models.loader import build_model
    from localllm.quant import prepare_for_checkpoint, prepare_online
    from localllm.quant.gguf_modules import plan_gguf_modules

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    path, mode = Path(sys.argv[1]), sys.argv[2]
    ckpt = open_checkpoint(path)
    cfg = ckpt.config
    qcfg = cfg.quantization or {}
    swap, options, planned_quant, gguf = None, {}, None, None
    if qcfg:  # a quantized checkpoint: its packed layout is loaded as stored
        swap = lambda m: prepare_for_checkpoint(m, qcfg)
        planned_quant = "fp8" if qcfg["quant_method"] == "compressed-tensors" else qcfg["quant_method"]
    elif mode.startswith("online:"):  # --quant int8/awq: each linear quantized as it arrives
        method = mode.split(":")[1]
        swap = lambda m: prepare_online(m, method)
        planned_quant = {"rtn4": "awq"}.get(method, method)
    elif mode == "gguf-blocks":  # the CPU plan: the file's blocks as stored, sized from the file
        from localllm.models.gguf_file import gguf_weights_from_file
        raw = set()
        swap = lambda m: raw.update(plan_gguf_modules(m, ckpt.block_types, cfg.tie_word_embeddings))
        options = {"raw": raw, "head_from_embedding": cfg.tie_word_embeddings}
        planned_quant, gguf = "gguf", gguf_weights_from_file(path)
    # else: float weights cast to bf16 (an HF float checkpoint, or a GGUF dequantized for a GPU)
    base = libc.mallinfo2().hblkhd
    model = build_model(ckpt, torch.bfloat16, torch.device("cpu"), 64, quantize=swap, weight_options=options)
    final = libc.mallinfo2().hblkhd
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]) - (
        model.cos_sin.numel() * model.cos_sin.element_size())
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    print(json.dumps({"base": base, "final": final - base, "held": held,
                      "planned": weight_bytes(cfg, "bfloat16", planned_quant, gguf)}), flush=True)
    libc.malloc_stats()
''')


@dataclass(frozen=True, slots=True)
class Peak:
    planned: int  # the planner's weight bytes for this model and precision
    final: int  # mmapped allocations alive after loading
    held: int  # the model's own tensors (parameters and buffers, less the rotary table)
    peak: int  # the most ever alive at once while loading


# "Plus one tensor": above the final weights a load may hold one checkpoint matrix in fp32 and
# its temporaries (the online quantizer's, or gguf's dequantizer's: measured up to 3 copies of
# the largest, FFN x hidden), plus rotary tables and allocator rounding. Materialising the
# model in fp32 first, as loading once did, breaks these bounds by 35 MB or more (but GGUF blocks).
MARGIN = 4 * (4 * FFN * HIDDEN) + 4 * MiB


def _q4_k_m_mix(name: str, t: torch.Tensor) -> tuple[np.ndarray, int]:
    from gguf import GGMLQuantizationType, quants

    if name == "token_embd.weight":
        q8 = GGMLQuantizationType.Q8_0
        return np.ascontiguousarray(quants.quantize(t.numpy(), q8)), int(q8)
    kind = "Q6_K" if name.endswith(("attn_v.weight", "ffn_down.weight", "output.weight")) else "Q4_K"
    return llama_cpp_blocks(kind, *t.shape), int(GGMLQuantizationType[kind])


def _write_checkpoints(root: Path) -> dict[str, tuple[Path, str]]:
    from localllm.models.formats import open_checkpoint
    from localllm.models.loader import build_model
    from localllm.quant import prepare_online
    from localllm.quant.checkpoint import save_quantized

    cfg = tiny_config(hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HIDDEN // HEADS,
                      vocab_size=VOCAB)  # above the byte tokenizer's 258: a padded embedding
    weights = tiny_weights(cfg)
    fp32 = write_hf_model(root / "fp32", cfg, weights)
    bf16 = write_hf_model(root / "bf16", cfg, {k: v.bfloat16() for k, v in weights.items()})
    del weights
    float_ckpt = open_checkpoint(bf16)
    for method in ("rtn4", "fp8"):  # AutoAWQ GEMM and compressed-tensors FP8, as `localllm quantize` writes
        model = build_model(float_ckpt, torch.bfloat16, torch.device("cpu"), 64,
                            quantize=lambda m, method=method: prepare_online(m, method))
        save_quantized(model, float_ckpt, root / method, method, 128 if method == "rtn4" else None)
        del model
    tokens, scores, types = spm_vocab(train_sentencepiece("unigram"))
    pad = -len(tokens) % 64  # the head's rows must tile by 8 for GGUF block linears
    tokens, scores, types = tokens + [f"<unused{i}>" for i in range(pad)], scores + [-1000.0] * pad, types + [5] * pad
    dims = LlamaDims(HIDDEN, FFN, HEADS, KV_HEADS, LAYERS)
    gguf = write_llama_gguf(root / "q4_1.gguf", tokens, scores, types,
                            random_llama_weights(len(tokens), dims=dims), dims=dims, block_type=Q4_1)[0]
    # a Q4_K_M-like file: Q4_K linears, Q6_K attn_v, ffn_down and head, Q8_0 embedding (llama.cpp's blocks)
    kquant = write_llama_gguf(root / "q4_k_m.gguf", tokens, scores, types,
                              random_llama_weights(len(tokens), dims=dims), dims=dims, encode=_q4_k_m_mix)[0]
    return {
        "gguf-kquant-blocks": (kquant, "gguf-blocks"),
        "hf-bf16": (bf16, "float"),
        "hf-fp32": (fp32, "float"),
        "awq": (root / "rtn4", "float"),
        "fp8": (root / "fp8", "float"),
        "gguf-dequantized": (gguf, "float"),
        "gguf-blocks": (gguf, "gguf-blocks"),
        "quant-int8": (bf16, "online:int8"),
        "quant-awq": (fp32, "online:awq"),
    }


@pytest.fixture(scope="module")
def peaks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Peak]:
    cases = _write_checkpoints(tmp_path_factory.mktemp("peak"))
    # No derived CPU-only int4 layout (the GPU keeps the checkpoint's): the measure is the load.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "LOCALLLM_QUANT_CPU_INT4": "dequant",
           "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    procs = {kind: subprocess.Popen([sys.executable, "-c", SCRIPT, str(path), mode], env=env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for kind, (path, mode) in cases.items()}
    out: dict[str, Peak] = {}
    for kind, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{kind}: {stderr[-3000:]}"
        figures = json.loads(stdout.strip().splitlines()[-1])
        most = re.search(r"max mmap bytes\s*=\s*(\d+)", stderr)
        assert most is not None, f"{kind}: no malloc_stats in {stderr[-500:]!r}"
        out[kind] = Peak(figures["planned"], figures["final"], figures["held"], int(most[1]) - figures["base"])
    return out


@pytest.mark.parametrize("kind", ["hf-bf16", "hf-fp32", "awq", "fp8", "gguf-dequantized", "gguf-blocks",
                                  "gguf-kquant-blocks",
                                  "quant-int8", "quant-awq"])
def test_loading_peaks_at_the_planned_weights_plus_one_tensor(kind: str, peaks: dict[str, Peak]) -> None:
    p = peaks[kind]
    mb = {k: f"{v / 1e6:.1f} MB" for k, v in (("planned", p.planned), ("held", p.held), ("final", p.final),
                                               ("peak", p.peak))}
    # the measure sees the model, in the planned precision (an fp32 model would be 2x)
    # the plan predicts what the model holds (its tensors' bytes) ...
    assert 0.9 * p.planned <= p.held <= 1.1 * p.planned + 4 * MiB, (kind, mb)
    # ... and the measure sees it: all of it but tensors under the mmap threshold, in the heap
    # (a block linear's fp16 scales: up to a fifth of a GGUF model)
    assert 0.75 * p.held <= p.final <= 1.1 * p.planned + 4 * MiB, (kind, mb)
    assert p.peak <= p.planned + MARGIN, (kind, mb, f"margin {MARGIN / 1e6:.1f} MB")

