#!/usr/bin/env python
"""Speculative decoding on a GPU: whether its verify step (a decode step of one row per
position, ``1 + k`` rows a request) runs through the captured CUDA graphs, yields the tokens
decoding without it yields, and pays. One device call (the image lacks platformdirs and gguf:
their wheels travel in ``.whl``, as for bench/gpu_check.py):

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
      && export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 && python3 bench/gpu_spec.py --budget 420

    python bench/gpu_spec.py --smoke   # CPU, tiny shapes, Triton interpreter: this script's own paths

The models are gpu_check's random-weight Llama-3.1-8B-shaped ones (a few layers; the GPU
machine cannot download a real model), as cases (``--cases``): ``copy``, the bf16 target made
to copy its prompt (``build_counting_copy``: the speed-up at full acceptance); ``bf16`` and
``bf16-det`` (``deterministic``: a row's numbers do not depend on the rows beside it, so greedy
output must be the same bit for bit); ``draft``, a draft model made of the bf16 target's first
layer (layer-skip drafting: its own CUDA graphs); ``gguf``, the same shapes as a Q4_K_M GGUF
(``--deterministic`` does not cover GGUF plans on a GPU).
One engine per case; speculation is switched on and off in it (``LLMEngine.set_speculative``)
so both sides share the model, the pool and the graphs. Per case:
- greedy: six prompts together (two pairs sharing a prefix: prefix hits) and one alone, off
  then on: equal token lists, or where the first difference is;
- speed: one request, on and off alternating; decode rate = tokens after the first over the
  time after it; acceptance from the engine's counters;
- verify cost: the engine's own measure of a decode step's time by rows (``SpecCosts``):
  a ``1 + k``-row verify step against a one-row step, which is what speculation spends;
- 16 requests at once, off and on (speculation must step aside).
A random model's acceptance is whatever its greedy output repeats: the figures are about the
machinery (graphs, exactness, verify cost), not a real workload's speed-up.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_check  # noqa: E402 - the model builders and the package install live there

K = 5  # proposals per verify step at most (the n-gram default)


def build_layer_skip_draft(target: Path, folder: Path, layers: int) -> dict[str, Any]:
    """A draft of the target's first ``layers`` layers, its embedding, final norm and head:
    the same tokenizer files, so the engine takes it as a draft of the target's family."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((target / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (folder / name).write_bytes((target / name).read_bytes())
    index = json.loads((target / "model.safetensors.index.json").read_text())["weight_map"]
    keep = [n for n in index if not n.startswith("model.layers.") or int(n.split(".")[2]) < layers]
    tensors: dict[str, Any] = {}
    for file in sorted({index[n] for n in keep}):
        with safe_open(str(target / file), "pt") as f:
            tensors.update({n: f.get_tensor(n) for n in keep if index[n] == file})
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return {"folder": str(folder), "layers": layers, "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}


def build_counting_copy(target: Path, folder: Path) -> dict[str, Any]:
    """The target with every layer's output projections zeroed (attention and MLP add nothing,
    but are still read: a step costs what the target's does) and its head set to the embedding
    shifted by one, so that its greedy next token is always the current one plus one. A prompt
    holding a span of consecutive ids then gets copied from where its end matches: the
    machinery's copy workload (a code edit, a quote) with a known answer."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
                 "model.safetensors.index.json"):
        (folder / name).write_bytes((target / name).read_bytes())
    index = json.loads((target / "model.safetensors.index.json").read_text())["weight_map"]
    embed = None
    for file in sorted(set(index.values())):
        with safe_open(str(target / file), "pt") as f:
            if "model.embed_tokens.weight" in f.keys():
                embed = f.get_tensor("model.embed_tokens.weight")
    assert embed is not None
    for file in sorted(set(index.values())):
        tensors: dict[str, Any] = {}
        with safe_open(str(target / file), "pt") as f:
            for n in f.keys():
                t = f.get_tensor(n)
                if n.endswith(("o_proj.weight", "down_proj.weight")):
                    t = torch.zeros_like(t)
                elif n == "lm_head.weight":
                    t = torch.roll(embed, 1, dims=0)  # row s = embed[s - 1]: token t scores t + 1 highest
                tensors[n] = t
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
    return {"folder": str(folder)}


def copy_prompt(torch: Any, vocab: int, gen: Any, tail: int = 4) -> list[int]:
    """Random ids, a span of consecutive ids, random ids, then the span's ids 50..50+tail: the
    counting model's reply continues the span, which prompt lookup finds in the prompt."""
    start, span = min(2000, vocab // 4), min(300, vocab // 2)
    rand = lambda n: torch.randint(10, start - 10, (n,), generator=gen).tolist()  # noqa: E731
    return rand(64) + list(range(start, start + span)) + rand(32) + list(range(start + 50, start + 50 + tail))


def run_case(torch: Any, model: str, options: dict[str, Any], spec: dict[str, Any], smoke: bool,
             out: dict[str, Any], copy: bool = False) -> None:
    from localllm import LLM

    device = "cpu" if smoke else "cuda"
    t0 = time.monotonic()
    # smoke: eager (a CPU compile is minutes); on CUDA the decode buckets are captured graphs
    llm = LLM(model=model, device=device, max_model_len=1024, max_num_seqs=32,
              speculative_config=spec, **({"compile": False} if smoke else {}), **options)
    engine = llm.engine
    config = engine.speculative
    out["load_s"] = round(time.monotonic() - t0, 1)
    out["graphs"] = sorted(engine.runner.graphs)  # captured buckets (empty: eager)
    out["buckets_top"] = engine.runner.buckets[-1] if engine.runner.buckets else None
    vocab = engine.tokenizer.vocab_size
    gen = torch.Generator().manual_seed(7)
    plen, new = (16, 24) if smoke else (128, 160)

    def rand(n: int) -> list[int]:
        return torch.randint(10, vocab - 10, (n,), generator=gen).tolist()

    def generate(prompts: list[list[int]], max_tokens: int, on: bool) -> tuple[list[Any], float]:
        engine.set_speculative(config if on else None)
        return gpu_check.timed_greedy(torch, llm, prompts, max_tokens)

    def tokens(outs: list[Any]) -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in outs]

    def compare(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
        firsts = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), None) for p, q in zip(a, b)]
        return {"equal": sum(f is None and len(p) == len(q) for f, p, q in zip(firsts, a, b)), "of": len(a),
                "first_difference_at": [f for f in firsts if f is not None]}

    def counters() -> tuple[int, int, int]:
        s = engine.stats()
        return s.spec_num_drafts, s.spec_num_draft_tokens, s.spec_num_accepted_tokens

    # warm-up, both ways (the first steps of a size tune kernels outside any capture)
    generate([rand(plen)], 8, False)
    generate([rand(plen)], 8, True)

    shared = [rand(plen * 3 // 4), rand(plen * 3 // 4)]
    batch = [shared[0] + rand(plen // 4), shared[0] + rand(plen // 4), shared[1] + rand(plen // 4),
             shared[1] + rand(plen // 4), rand(plen), rand(plen)]
    c0 = counters()
    off, _ = generate(batch, new, False)
    on, _ = generate(batch, new, True)
    c1 = counters()
    out["greedy_batch6"] = dict(compare(tokens(off), tokens(on)), drafts=c1[0] - c0[0],
                                acceptance=round((c1[2] - c0[2]) / max(c1[1] - c0[1], 1), 3))
    one = [batch[4]]
    off1, _ = generate(one, new, False)
    on1, _ = generate(one, new, True)
    out["greedy_alone"] = compare(tokens(off1), tokens(on1))
    # the same request in the batch and alone: whether rows beside it move its tokens
    out["alone_vs_batched_off"] = compare(tokens(off1), tokens([off[4]]))

    rates: dict[str, list[float]] = {"off": [], "on": []}
    accept: list[float] = []
    per_step: list[float] = []
    speed_prompt = copy_prompt(torch, vocab, gen) if copy else rand(plen)
    if copy:  # the counting model's answer is known: the span continued
        (o,), _ = generate([speed_prompt], new, True)
        want = list(range(speed_prompt[-1] + 1, speed_prompt[-1] + 1 + new))
        out["copy_answer_right"] = list(o.outputs[0].token_ids) == want
    for trial in range(3):
        for mode in (("off", "on") if trial % 2 == 0 else ("on", "off")):
            c0 = counters()
            (o,), _ = generate([speed_prompt], 2 * new, mode == "on")
            c1 = counters()
            m = o.metrics
            n = len(o.outputs[0].token_ids)
            rates[mode].append((n - 1) / (m.last_token_time - m.first_token_time))
            if mode == "on" and c1[1] > c0[1]:
                accept.append((c1[2] - c0[2]) / (c1[1] - c0[1]))
                per_step.append(1 + (c1[2] - c0[2]) / (c1[0] - c0[0]))
    med = {k: statistics.median(v) for k, v in rates.items()}
    out["batch1"] = {"decode_tok_s_off": round(med["off"], 1), "decode_tok_s_on": round(med["on"], 1),
                     "on_over_off": round(med["on"] / med["off"], 3),
                     "acceptance": [round(a, 3) for a in accept],
                     "tokens_per_verify_step": [round(a, 2) for a in per_step],
                     "trials_tok_s": {k: [round(x, 1) for x in v] for k, v in rates.items()}}
    costs = engine.scheduler.spec_costs
    rows = sorted(costs.times)
    out["step_ms_by_rows"] = {r: round(costs.times[r] * 1e3, 3) for r in rows}
    if 1 in costs.times:
        out["verify_cost_over_one_row"] = {r: round(costs.times[r] / costs.times[1], 3) for r in rows if r <= K + 1}

    streams = [rand(plen) for _ in range(16)]
    generate(streams, 8, False)  # warm-up: a 16-prompt prefill's kernel shapes
    tput: dict[str, list[float]] = {"off": [], "on": []}
    c0 = counters()
    for trial in range(2):
        for mode in (("off", "on") if trial % 2 == 0 else ("on", "off")):
            outs, wall = generate(streams, 64, mode == "on")
            tput[mode].append(sum(len(o.outputs[0].token_ids) for o in outs) / wall)
    c1 = counters()
    out["streams16"] = {"tok_s_off": [round(x, 1) for x in tput["off"]], "tok_s_on": [round(x, 1) for x in tput["on"]],
                        "on_over_off": round(statistics.mean(tput["on"]) / statistics.mean(tput["off"]), 3),
                        "drafts": c1[0] - c0[0]}
    s = engine.stats()
    out["case_counters"] = {"verify_steps": s.spec_num_drafts, "proposed": s.spec_num_draft_tokens,
                            "accepted": s.spec_num_accepted_tokens}
    del llm, engine
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, Triton interpreter")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds; cases stop starting past it")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of the 8B-shaped target")
    ap.add_argument("--cases", default="copy,bf16-det,bf16,draft,gguf")
    ap.add_argument("--out", default=None, help="JSON path (default $OUT/gpu_spec.json)")
    args = ap.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("gpu_spec: no GPU here; use --smoke to exercise the script on CPU")
        return 0
    report = gpu_check.Report(Path(args.out) if args.out else Path(os.environ.get("OUT", ".")) / "gpu_spec.json")
    report.data["package"] = gpu_check.package_or_error()
    watchdog = gpu_check.start_watchdog(report, args.budget + 60)
    deadline = gpu_check.Deadline(args.budget)
    device = "cpu" if args.smoke else "cuda"
    if not args.smoke:
        report.data["device"] = torch.cuda.get_device_name()
    cfg = dict(gpu_check.LLAMA31_8B, num_hidden_layers=args.layers)
    if args.smoke:
        cfg.update(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=64, bos_token_id=1, eos_token_id=2)
    root = Path(os.environ.get("TMPDIR", "/tmp")) / "localllm_gpu_spec"
    folder = root / ("tiny" if args.smoke else f"llama31_8b_{args.layers}l")
    dtype = "float32" if args.smoke else "bfloat16"
    t0 = time.monotonic()
    report.data["model"] = gpu_check.build_random_llama(torch, folder, cfg, device, getattr(torch, dtype))
    report.data["model"]["build_s"] = round(time.monotonic() - t0, 1)
    report.save()
    # 8: the six greedy prompts together speculate (up to 48 verify rows: the graphs cover them),
    # the 16 streams do not
    ngram = {"method": "ngram", "num_speculative_tokens": K, "disable_by_batch_size": 8}
    gguf_path: Path | None = None
    for name in [c for c in args.cases.split(",") if c]:
        out = report.data.setdefault("cases", {}).setdefault(name, {})
        if deadline.left() < (10 if args.smoke else 45):
            out["skipped"] = f"budget ({deadline.left():.0f} s left)"
            continue
        print(f"== {name}", flush=True)
        t = time.monotonic()
        try:
            det = {"deterministic": True} if name.endswith("-det") else {}
            if name.startswith("gguf"):
                if gguf_path is None:
                    gguf_path = root / f"{folder.name}.Q4_K_M.gguf"
                    report.data["gguf"] = gpu_check.build_q4_k_m_gguf(torch, gguf_path, cfg)
                run_case(torch, str(gguf_path), det, ngram, args.smoke, out)
            elif name == "copy":
                counting = build_counting_copy(folder, root / f"{folder.name}.counting")
                run_case(torch, counting["folder"], {"dtype": dtype}, ngram, args.smoke, out, copy=True)
            elif name == "draft":
                draft = build_layer_skip_draft(folder, root / f"{folder.name}.draft1", 1)
                out["draft"] = draft
                spec = {"method": "draft_model", "model": draft["folder"], "num_speculative_tokens": 4,
                        "disable_by_batch_size": 8}
                run_case(torch, str(folder), {"dtype": dtype}, spec, args.smoke, out)
            else:
                run_case(torch, str(folder), {"dtype": dtype, **det}, ngram, args.smoke, out)
        except Exception as e:  # noqa: BLE001 - a case's failure is data; the next case runs
            out["error"] = f"{type(e).__name__}: {e}"
            out["traceback"] = traceback.format_exc()[-3000:]
        out["seconds"] = round(time.monotonic() - t, 1)
        print(f"   {name}: {json.dumps(out)[:1500]}", flush=True)
        report.save()
    report.data["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    report.save()
    print(f"gpu_spec: wrote {report.path}")
    watchdog.cancel()  # its timer must not keep the process
    return 0


if __name__ == "__main__":
    sys.exit(main())
