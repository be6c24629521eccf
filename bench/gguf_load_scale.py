#!/usr/bin/env python
"""Loading a GGUF at 7-8B scale: time, peak memory and what stays, on a file shaped like
Llama-3.1-8B-Instruct's Q4_K_M (4.9 GB).

    python bench/gguf_load_scale.py                  # writes the file once, then loads it
    python bench/gguf_load_scale.py --json

No 8B model can be downloaded on these machines, so the file is made here: Llama-3.1-8B's
shapes and llama.cpp's Q4_K_M recipe (``hardware/sizing.py``: Q4_K, Q6_K where llama.cpp
puts more bits), every matrix filled with llama.cpp's own blocks of those types
(tests/fixtures/gguf_blocks.gguf, its 512-weight rows repeated), and the default model's
tokenizer padded to Llama 3's 128,256 entries. Its text is meaningless; its bytes, types and
shapes are those of the real file, which is what loading costs depend on. Written tensor by
tensor into the fixtures cache (``--out``), never into the repository.

The load runs in a fresh process, ``load_model`` as ``localllm run`` calls it (no compile, a
small KV pool), sampling the process's anonymous resident memory (RssAnon: what the loader
allocates; the memory-mapped file's pages are the page cache's, RssFile, reported apart) every
20 ms. Reported: load seconds, peak and final RssAnon and RssFile, the plan's weight bytes, the
file's size, the progress reports.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "fixtures" / "gguf_blocks.gguf"
# Llama-3.1-8B-Instruct (the catalog's entry)
HIDDEN, FFN, HEADS, KV_HEADS, LAYERS, VOCAB = 4096, 14336, 32, 8, 32, 128256


def default_out() -> Path:
    home = os.environ.get("LOCALLLM_HOME")
    base = Path(home) / "fixtures" if home else Path.home() / ".cache" / "localllm-fixtures"
    return base / "llama-3.1-8b-shaped.Q4_K_M.gguf"


def _more_bits(i: int, n: int) -> bool:  # llama.cpp's use_more_bits (hardware/sizing.py says why)
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def write_file(out: Path) -> None:
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter

    from localllm import store
    from localllm.models.gguf_file import read_gguf

    _, blocks = read_gguf(FIXTURE)
    fields, _ = read_gguf(store.resolve(None))
    tensors: list[tuple[str, str, int, int]] = [("token_embd.weight", "Q4_K", VOCAB, HIDDEN)]
    for i in range(LAYERS):
        more = _more_bits(i, LAYERS)
        q, kv = HEADS * HIDDEN // HEADS, KV_HEADS * HIDDEN // HEADS
        tensors += [(f"blk.{i}.attn_q.weight", "Q4_K", q, HIDDEN), (f"blk.{i}.attn_k.weight", "Q4_K", kv, HIDDEN),
                    (f"blk.{i}.attn_v.weight", "Q6_K" if more else "Q4_K", kv, HIDDEN),
                    (f"blk.{i}.attn_output.weight", "Q4_K", HIDDEN, q),
                    (f"blk.{i}.ffn_gate.weight", "Q4_K", FFN, HIDDEN), (f"blk.{i}.ffn_up.weight", "Q4_K", FFN, HIDDEN),
                    (f"blk.{i}.ffn_down.weight", "Q6_K" if more else "Q4_K", HIDDEN, FFN),
                    (f"blk.{i}.attn_norm.weight", "F32", 1, HIDDEN), (f"blk.{i}.ffn_norm.weight", "F32", 1, HIDDEN)]
    tensors += [("output_norm.weight", "F32", 1, HIDDEN), ("output.weight", "Q6_K", VOCAB, HIDDEN)]

    def data(kind: str, rows: int, cols: int) -> np.ndarray:
        if kind == "F32":
            return np.ones(cols, np.float32)
        src = np.array(blocks[kind].data)  # [16, bytes of 512 weights]
        per_row = cols // 512
        pick = (np.arange(rows)[:, None] * per_row + np.arange(per_row)[None, :]) % src.shape[0]
        return np.ascontiguousarray(src[pick].reshape(rows, -1))

    tokens = list(fields["tokenizer.ggml.tokens"])
    pad = VOCAB - len(tokens)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".part")
    w = GGUFWriter(str(tmp), "llama")
    w.add_name("llama-3.1-8b-shaped (llama.cpp blocks, meaningless text)")
    w.add_context_length(8192)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_block_count(LAYERS)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(500000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(str(fields.get("tokenizer.ggml.pre", "default")))
    w.add_token_list(tokens + [f"<|reserved_{i}|>" for i in range(pad)])
    w.add_token_types(list(fields["tokenizer.ggml.token_type"]) + [5] * pad)
    w.add_token_merges(list(fields["tokenizer.ggml.merges"]))
    w.add_bos_token_id(int(fields["tokenizer.ggml.bos_token_id"]))
    w.add_eos_token_id(int(fields["tokenizer.ggml.eos_token_id"]))
    w.add_chat_template(str(fields["tokenizer.chat_template"]))
    for name, kind, rows, cols in tensors:
        t = GGMLQuantizationType[kind]
        row_bytes = data(kind, 1, cols).nbytes
        shape = [cols] if kind == "F32" else [rows, row_bytes]  # quantized: the byte shape
        nbytes = row_bytes * (1 if kind == "F32" else rows)
        w.add_tensor_info(name, shape, np.dtype(np.float32 if kind == "F32" else np.uint8), nbytes,
                          None if kind == "F32" else t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, kind, rows, cols in tensors:  # one tensor in memory at a time
        w.write_tensor_data(data(kind, rows, cols))
    w.close()
    os.replace(tmp, out)


# Runs in a fresh process: loads the file as `localllm run` does and reports.
LOAD = textwrap.dedent('''
    import json, sys, threading, time
    from pathlib import Path

    def status(key):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
        return 0

    def rss_anon():
        return status("RssAnon")

    peak = [rss_anon()]
    peak_file = [status("RssFile")]
    done = threading.Event()
    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss_anon())
            peak_file[0] = max(peak_file[0], status("RssFile"))
            time.sleep(0.02)
    import torch
    from localllm.models.loader import load_model
    base = rss_anon()
    base_file = status("RssFile")
    threading.Thread(target=sample, daemon=True).start()
    seen = []
    t0 = time.monotonic()
    loaded = load_model(sys.argv[1], device="cpu", compile=False, max_model_len=2048, chats=1,
                        progress=lambda stage, d, t: seen.append(d))
    t1 = time.monotonic()
    done.set()
    final = rss_anon()
    final_file = status("RssFile")
    held = sum(t.numel() * t.element_size() for t in [*loaded.model.parameters(), *loaded.model.buffers()])
    print(json.dumps({"load_s": round(t1 - t0, 1), "base": base, "peak": max(peak[0], final) - base,
                      "final": final - base, "held": held,
                      "file_pages_peak": peak_file[0] - base_file, "file_pages_final": final_file - base_file, "planned": loaded.plan.weight_bytes,
                      "precision": loaded.precision, "progress_calls": len(seen),
                      "reason": next(r for r in loaded.plan.reasons if "gguf" in r)}))
''')


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="the file (default: in the fixtures cache)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    out = (args.out or default_out()).expanduser()
    if not out.is_file():
        t0 = time.monotonic()
        print(f"writing {out} (about 4.9 GB) ...", file=sys.stderr, flush=True)
        write_file(out)
        print(f"written in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    r = subprocess.run([sys.executable, "-c", LOAD, str(out)], capture_output=True, text=True)
    if r.returncode != 0:
        print(f"error: the load failed: {(r.stderr.strip().splitlines() or ['no output'])[-1]}", file=sys.stderr)
        return 2
    report = json.loads(r.stdout.strip().splitlines()[-1]) | {"file_bytes": out.stat().st_size}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        gb = 1e9
        print(f"{out.name}: {report['file_bytes'] / gb:.2f} GB file, loaded in {report['load_s']} s as "
              f"{report['precision']}; loader memory peak {report['peak'] / gb:.2f} GB, "
              f"after {report['final'] / gb:.2f} GB, model tensors {report['held'] / gb:.2f} GB, planned {report['planned'] / gb:.2f} GB")
        print(f"the file's mapped pages in RSS (the page cache's, reclaimable): peak {report['file_pages_peak'] / gb:.2f} GB, "
              f"after {report['file_pages_final'] / gb:.2f} GB; {report['progress_calls']} progress reports")
        print(f"plan: {report['reason']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
