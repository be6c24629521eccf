#!/usr/bin/env python
"""Mixture-of-experts GGUFs as llama.cpp ships them, at a few hundred MB: memory against the
file, and the files for ``bench/peers.py --model FILE`` (decode speed against llama.cpp).

    python bench/moe_shaped.py                # writes both files once, then loads each
    python bench/moe_shaped.py --json

No Qwen3-30B-A3B or gpt-oss-20b can be downloaded on these machines, so the files are made
here with those families' layout at a smaller width and depth (``SHAPES``): Qwen3-MoE as a
Q4_K_M (experts Q4_K, ffn_down_exps Q6_K in llama.cpp's ``use_more_bits`` layers, attention
Q4_K/Q6_K, head Q6_K), gpt-oss as every llama.cpp file holds it (experts MXFP4, the rest Q8_0,
biases, sinks and norms F32). The blocks are random but valid (fp16/E8M0 scales set so that
weights have about a trained model's scale); the default model's tokenizer. Their text is
meaningless; their bytes, types and shapes are what memory and decode speed depend on.
Written into the fixtures cache (``--out``), never into the repository.

Each load runs in a fresh process, ``load_model`` as ``localllm run`` calls it (no compile, a
small KV pool). Reported: the file's size, its stacked experts' bytes, the plan's weight bytes,
the bytes the loaded modules hold (experts separately) and the process's anonymous resident
memory after loading (RssAnon).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True, slots=True)
class Shape:
    arch: str  # GGUF general.architecture
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    experts: int
    used: int
    width: int  # expert_feed_forward_length


SHAPES = {
    "qwen3-moe-shaped.Q4_K_M.gguf": Shape("qwen3moe", 1024, 16, 4, 128, 6, 64, 8, 512),
    "gpt-oss-shaped.MXFP4.gguf": Shape("gpt-oss", 1024, 16, 4, 64, 6, 32, 4, 1024),
}


def default_dir() -> Path:
    home = os.environ.get("LOCALLLM_HOME")
    return Path(home) / "fixtures" if home else Path.home() / ".cache" / "localllm-fixtures"


def _more_bits(i: int, n: int) -> bool:  # llama.cpp's use_more_bits (hardware/sizing.py says why)
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _tensors(s: Shape, vocab: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, ggml type, shape in weights, outermost first) of every tensor."""
    h, q, kv, e, w = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim, s.experts, s.width
    oss = s.arch == "gpt-oss"
    dense = "Q8_0" if oss else "Q4_K"
    out: list[tuple[str, str, tuple[int, ...]]] = [("token_embd.weight", dense, (vocab, h))]
    for i in range(s.layers):
        more = _more_bits(i, s.layers)
        b = f"blk.{i}"
        out += [(f"{b}.attn_norm.weight", "F32", (h,)), (f"{b}.attn_q.weight", dense, (q, h)),
                (f"{b}.attn_k.weight", dense, (kv, h)),
                (f"{b}.attn_v.weight", "Q6_K" if more and not oss else dense, (kv, h)),
                (f"{b}.attn_output.weight", dense, (h, q)), (f"{b}.ffn_gate_inp.weight", "F32", (e, h))]
        if oss:
            out += [(f"{b}.attn_q.bias", "F32", (q,)), (f"{b}.attn_k.bias", "F32", (kv,)),
                    (f"{b}.attn_v.bias", "F32", (kv,)), (f"{b}.attn_output.bias", "F32", (h,)),
                    (f"{b}.attn_sinks.weight", "F32", (s.heads,)), (f"{b}.post_attention_norm.weight", "F32", (h,)),
                    (f"{b}.ffn_gate_inp.bias", "F32", (e,)),
                    (f"{b}.ffn_gate_exps.weight", "MXFP4", (e, w, h)), (f"{b}.ffn_up_exps.weight", "MXFP4", (e, w, h)),
                    (f"{b}.ffn_down_exps.weight", "MXFP4", (e, h, w)),
                    (f"{b}.ffn_gate_exps.bias", "F32", (e, w)), (f"{b}.ffn_up_exps.bias", "F32", (e, w)),
                    (f"{b}.ffn_down_exps.bias", "F32", (e, h))]
        else:
            out += [(f"{b}.attn_q_norm.weight", "F32", (s.head_dim,)), (f"{b}.attn_k_norm.weight", "F32", (s.head_dim,)),
                    (f"{b}.ffn_norm.weight", "F32", (h,)),
                    (f"{b}.ffn_gate_exps.weight", "Q4_K", (e, w, h)), (f"{b}.ffn_up_exps.weight", "Q4_K", (e, w, h)),
                    (f"{b}.ffn_down_exps.weight", "Q6_K" if more else "Q4_K", (e, h, w))]
    out += [("output_norm.weight", "F32", (h,)), ("output.weight", "Q8_0" if oss else "Q6_K", (vocab, h))]
    return out


def _data(name: str, kind: str, shape: tuple[int, ...], gen):  # noqa: ANN001, ANN202 - numpy
    """Random valid blocks (uint8, the byte shape) or floats for ``kind``."""
    import numpy as np

    from localllm.quant import gguf_formats as gf

    if kind == "F32":
        if name.endswith("norm.weight"):
            return np.ones(shape, np.float32)
        scale = 0.5 if "ffn_gate_inp" in name else 0.02
        return (gen.standard_normal(shape) * scale).astype(np.float32)
    f = gf.fmt(kind)
    nblk = int(np.prod(shape)) // f.block_weights
    raw = gen.integers(0, 256, (nblk, f.block_bytes), dtype=np.uint8)
    if kind == "Q4_K":  # d, dmin: weights d * sc * q - dmin * m, sc, m < 64, q < 16
        raw[:, :4] = gen.uniform(3e-5, 1e-4, (nblk, 2)).astype(np.float16).view(np.uint8)
    elif kind == "Q6_K":  # d last: d * sc * (q - 32), |sc| < 128
        raw[:, 208:] = gen.uniform(5e-6, 2e-5, (nblk, 1)).astype(np.float16).view(np.uint8)
    elif kind == "Q8_0":  # d first: d * q, |q| < 128
        raw[:, :2] = gen.uniform(2e-4, 6e-4, (nblk, 1)).astype(np.float16).view(np.uint8)
    elif kind == "MXFP4":  # E8M0 exponent first: 2^(e - 127) * table[q] / 2, |table| <= 12
        raw[:, 0] = gen.integers(118, 121, nblk, dtype=np.uint8)
    return raw.reshape(*shape[:-1], shape[-1] // f.block_weights * f.block_bytes)


def synthetic_vocab(size: int) -> dict[str, Any]:
    """Tokenizer fields of a byte-level vocabulary of ``size`` tokens (the 256 byte pieces,
    the end-of-text and harmony markers, then unused pieces): for a machine without the
    default model (the GPU check's), where prompts are token ids."""
    from localllm.harmony import TOKENS

    chars = [chr(b) if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255 else chr(256 + b) for b in range(256)]
    tokens = [*chars, "\u0120t", "<|endoftext|>", *TOKENS, "<|call|>", "<|constrain|>"]  # one merge: the reader needs one
    tokens += [f"<unused{i}>" for i in range(size - len(tokens))]
    return {"tokenizer.ggml.pre": "gpt2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [1] * 257 + [3] * (size - 257), "tokenizer.ggml.merges": ["\u0120 t"],
            "tokenizer.ggml.bos_token_id": 257, "tokenizer.ggml.eos_token_id": 257, "tokenizer.chat_template": ""}


def write_file(out: Path, s: Shape, fields: dict[str, Any] | None = None) -> None:
    """Writes shape ``s`` to ``out``; the tokenizer's ``fields`` (default: the default model's)."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType

    from localllm import store
    from localllm.models.gguf_file import read_gguf

    if fields is None:
        fields, _ = read_gguf(store.resolve(None))
    tokens = list(fields["tokenizer.ggml.tokens"])
    gen = np.random.default_rng(0)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".part")
    w = GGUFWriter(str(tmp), s.arch)
    w.add_name(f"{out.stem} (random blocks, meaningless text)")
    w.add_context_length(4096)
    w.add_embedding_length(s.hidden)
    w.add_feed_forward_length(s.width)
    w.add_block_count(s.layers)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(150000.0 if s.arch == "gpt-oss" else 1000000.0)
    w.add_expert_count(s.experts)
    w.add_expert_used_count(s.used)
    w.add_expert_feed_forward_length(s.width)
    if s.arch == "gpt-oss":  # as convert_hf_to_gguf.py writes gpt-oss
        w.add_sliding_window(128)
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(32.0)
        w.add_rope_scaling_orig_ctx_len(4096)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(str(fields.get("tokenizer.ggml.pre", "default")))
    w.add_token_list(tokens)
    w.add_token_types(list(fields["tokenizer.ggml.token_type"]))
    w.add_token_merges(list(fields["tokenizer.ggml.merges"]))
    w.add_bos_token_id(int(fields["tokenizer.ggml.bos_token_id"]))
    w.add_eos_token_id(int(fields["tokenizer.ggml.eos_token_id"]))
    if fields.get("tokenizer.chat_template"):
        w.add_chat_template(str(fields["tokenizer.chat_template"]))
    tensors = _tensors(s, len(tokens))
    for name, kind, shape in tensors:
        arr = _data(name, kind, (1,) * (len(shape) - 1) + shape[-1:], gen)  # one row: its bytes
        byte_shape = list(shape[:-1]) + [arr.shape[-1]]
        nbytes = int(np.prod(byte_shape)) * arr.dtype.itemsize
        w.add_tensor_info(name, byte_shape, arr.dtype, nbytes, None if kind == "F32" else GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, kind, shape in tensors:  # one tensor in memory at a time
        w.write_tensor_data(_data(name, kind, shape, gen))
    w.close()
    os.replace(tmp, out)


LOAD = textwrap.dedent('''
    import json, sys
    from pathlib import Path

    def rss_anon():
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
        return 0

    import torch
    from localllm.models.loader import load_model
    base = rss_anon()
    loaded = load_model(sys.argv[1], device="cpu", compile=False, max_model_len=1024, chats=1, num_kv_blocks=8)
    def nbytes(ts):
        return sum(t.numel() * t.element_size() for t in ts)
    m = loaded.model
    experts = sum(nbytes(mod.buffers()) for name, mod in m.named_modules() if name.endswith(".mlp.experts"))
    print(json.dumps({"precision": loaded.precision, "plan_weight_bytes": loaded.plan.weight_bytes,
                      "held_bytes": nbytes(m.parameters()) + nbytes(m.buffers()), "held_expert_bytes": experts,
                      "rss_anon_bytes": rss_anon() - base, "reason": loaded.plan.reasons[2]}))
''')


def measure(path: Path) -> dict[str, object]:
    from localllm.models.gguf_file import read_gguf

    _, tensors = read_gguf(path)
    expert_bytes = sum(int(t.data.nbytes) for n, t in tensors.items() if "_exps.weight" in n)
    run = subprocess.run([sys.executable, "-c", LOAD, str(path)], capture_output=True, text=True, check=False,
                         env={**os.environ, "LOCALLLM_NO_COMPILE": "1"})
    if run.returncode:
        raise SystemExit(f"loading {path.name} failed:\n{run.stderr[-3000:]}")
    got = json.loads(run.stdout.strip().splitlines()[-1])
    return {"file": path.name, "file_bytes": path.stat().st_size, "file_expert_bytes": expert_bytes, **got}


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="folder for the files (default: the fixtures cache)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    folder = args.out or default_dir()
    rows = []
    for name, shape in SHAPES.items():
        path = folder / name
        if not path.is_file():
            print(f"writing {path}", file=sys.stderr, flush=True)
            write_file(path, shape)
        rows.append(measure(path))
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    mb = 1e6
    for r in rows:
        print(f"{r['file']}: file {r['file_bytes'] / mb:.1f} MB (experts {r['file_expert_bytes'] / mb:.1f} MB); "
              f"plan weights {r['plan_weight_bytes'] / mb:.1f} MB; held {r['held_bytes'] / mb:.1f} MB "
              f"(experts {r['held_expert_bytes'] / mb:.1f} MB); RssAnon after load {r['rss_anon_bytes'] / mb:.1f} MB; "
              f"{r['precision']}")
        print(f"  {r['reason']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
