#!/usr/bin/env python
"""Top-1 agreement with llama.cpp on the same GGUF file, and what the file costs in memory.

    python bench/gguf_agreement.py --model ~/.cache/localllm-fixtures/smollm2-135m-instruct.Q4_K_M.gguf
    python bench/gguf_agreement.py --model A.gguf --model B.gguf --tokens 256 --json
    python bench/gguf_agreement.py --model A.gguf --model B.gguf --markdown   # issue 28's table

For each prompt (``--prompts``, three by default: a story, an explanation, code), llama-server
writes 256 greedy tokens after the chat prompt (EOS ignored), and localllm, fed that same text
token by token (teacher forcing, the prefix cache making each step one token), says which token
it would pick at each position. Counted:

- agreement: positions where localllm's argmax is llama.cpp's token / positions, over every
  prompt (teacher-forced top-1, so one early miss does not decide the rest);
- first difference, per prompt: the first position where they would part (free-running greedy
  texts are identical up to there);
- against our own Q4_1 path (``--reference``; by default the default model's file, when the
  model under test shares its tokenizer, i.e. is a requantization of it): the reference plan,
  teacher-forced on the same llama.cpp tokens, against our argmax ("ours vs Q4_1") and against
  llama.cpp's ("Q4_1 vs llama.cpp": how far the second rounding itself moves the argmax, the
  quantization's own noise to read the first figure against).

Both run greedy; llama.cpp rounds activations to 8 bits once per block, localllm to two 8-bit
levels, so a near-tie between the top two can go either way.

Memory, measured in the same process before the reference loads: the plan's weight bytes (the
planner's prediction), the model's own tensors (parameters and buffers, each storage once), and
the growth of the process's resident memory (VmRSS, and RssAnon: what was allocated rather
than mapped from the file) after loading and at its peak over the runs, against the file size,
the plan's KV pool and its expected measurement (weights + KV + workspace + runtime). Each
file runs in a fresh process when several are given. llama-server comes from bench/peers.py
--build.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/peers: finding llama.cpp

from peers import PeerError, Server, find_llama_cpp, free_port, machine, resolve_gguf  # noqa: E402

import argparse  # noqa: E402
import asyncio  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain step by step how a refrigerator keeps food cold.",
    "Write a Python function that checks whether a string is a palindrome, and explain how it works.",
    "What are the main causes of the French Revolution?",
)
MIB = 2**20


async def llama_cpp_tokens(server_bin: Path, gguf: Path, prompts: list[list[int]], n: int,
                           threads: int) -> list[list[int]]:
    """llama-server's ``n`` greedy tokens after each prompt (one server, one slot)."""
    import httpx

    port = free_port()
    argv = [str(server_bin), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
            "-c", str(max(len(p) for p in prompts) + n + 16), "-np", "1"]
    out = []
    async with Server("llama-server", argv, port, dict(os.environ), 600) as server:
        async with httpx.AsyncClient(timeout=900) as http:
            for prompt in prompts:
                r = await http.post(f"{server.base}/completion", json={
                    "prompt": prompt, "n_predict": n, "temperature": 0, "top_k": 1, "ignore_eos": True,
                    "cache_prompt": False, "return_tokens": True, "samplers": ["top_k"]})
                r.raise_for_status()
                tokens = r.json().get("tokens")
                if not isinstance(tokens, list) or len(tokens) != n:
                    raise PeerError(f"llama-server returned {len(tokens) if isinstance(tokens, list) else 'no'} "
                                    f"tokens, not {n}")
                out.append([int(t) for t in tokens])
    return out


def teacher_forced(llm: Any, prompt: list[int], theirs: list[int]) -> list[int]:
    """The model's greedy pick after ``prompt`` + each prefix of ``theirs``."""
    from localllm import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    return [llm.generate([prompt + theirs[:i]], greedy)[0].outputs[0].token_ids[0] for i in range(len(theirs))]


class Memory:
    """The process's VmRSS and RssAnon (bytes), sampled every 20 ms for their peaks."""

    def __init__(self) -> None:
        self.peak = self.now()
        self._stop = threading.Event()
        threading.Thread(target=self._sample, daemon=True).start()

    @staticmethod
    def now() -> dict[str, int]:
        out = {}
        for line in Path("/proc/self/status").read_text().splitlines():
            key = line.split(":")[0]
            if key in ("VmRSS", "RssAnon"):
                out[key] = int(line.split()[1]) * 1024
        return out

    def _sample(self) -> None:
        while not self._stop.is_set():
            now = self.now()
            self.peak = {k: max(v, now.get(k, 0)) for k, v in self.peak.items()}
            time.sleep(0.02)

    def stop(self) -> dict[str, int]:
        self._stop.set()
        return self.peak


def held_bytes(model: Any) -> int:
    """Bytes of the model's parameters and buffers, each storage once (a tied head shares its table)."""
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def measure(gguf: Path, reference: Path | None, server_bin: Path, n: int, n_prompts: int,
            threads: int) -> dict[str, Any]:
    """One file, in this process: memory first, then the agreement figures."""
    from localllm import LLM
    from localllm.models.gguf_file import read_gguf_model
    from localllm.quant.gguf_formats import type_name

    _, tensors = read_gguf_model(gguf)
    mix: dict[str, int] = {}
    for t in tensors.values():
        mix[type_name(int(t.tensor_type))] = mix.get(type_name(int(t.tensor_type)), 0) + 1
    gc.collect()
    base = Memory.now()
    mem = Memory()
    t0 = time.monotonic()
    llm = LLM(str(gguf), device="cpu", compile=False)
    load_s = time.monotonic() - t0
    after_load = Memory.now()
    plan = llm.engine.plan
    tok = llm.tokenizer
    texts = PROMPTS[:n_prompts]
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) if tok.chat_template else tok.encode(p) for p in texts]
    t0 = time.monotonic()
    theirs = asyncio.run(llama_cpp_tokens(server_bin, gguf, prompts, n, threads))
    t1 = time.monotonic()
    ours = [teacher_forced(llm, p, t) for p, t in zip(prompts, theirs)]
    t2 = time.monotonic()
    peak = mem.stop()
    report: dict[str, Any] = {
        "model": str(gguf), "file_bytes": gguf.stat().st_size,
        "types": dict(sorted(mix.items(), key=lambda kv: -kv[1])), "precision": llm.engine.precision,
        "reason": next((r for r in plan.reasons if "gguf" in r), plan.precision_reason),
        "planned_weight_bytes": plan.weight_bytes, "held_bytes": held_bytes(llm.engine.runner.model),
        "kv_bytes": plan.kv_bytes, "expected_measured_bytes": plan.expected_measured_bytes,
        "rss_after_load": after_load["VmRSS"] - base["VmRSS"],
        "anon_after_load": after_load["RssAnon"] - base["RssAnon"],
        "rss_peak": peak["VmRSS"] - base["VmRSS"], "anon_peak": peak["RssAnon"] - base["RssAnon"],
        "load_s": round(load_s, 1), "tokens": n, "prompts": len(prompts),
        "per_prompt": [], "llama_cpp_s": round(t1 - t0, 1), "localllm_s": round(t2 - t1, 1),
    }
    vocab = tok.vocab_size
    del llm
    gc.collect()
    refs: list[list[int]] | None = None
    if reference is not None and reference.resolve() != gguf.resolve():
        ref = LLM(str(reference), device="cpu", compile=False)
        # only a requantization of the reference (same tokenizer: same ids for the same prompts) compares
        same_tok = ref.tokenizer.vocab_size == vocab and all(
            (ref.tokenizer.encode_chat([{"role": "user", "content": p}]) if ref.tokenizer.chat_template
             else ref.tokenizer.encode(p)) == ids for p, ids in zip(texts, prompts))
        if same_tok:
            refs = [teacher_forced(ref, p, t) for p, t in zip(prompts, theirs)]
            report["reference"] = str(reference)
            report["reference_precision"] = ref.engine.precision
        del ref
    agree = total = ref_ours = ref_theirs = 0
    for k, (o, t) in enumerate(zip(ours, theirs)):
        same = [a == b for a, b in zip(o, t)]
        row: dict[str, Any] = {"agreement": sum(same) / n,
                               "first_difference": next((i for i, s in enumerate(same) if not s), None)}
        agree, total = agree + sum(same), total + n
        if refs is not None:
            ro = sum(a == b for a, b in zip(refs[k], o))
            rt = sum(a == b for a, b in zip(refs[k], t))
            row |= {"ours_vs_reference": ro / n, "reference_vs_llama_cpp": rt / n}
            ref_ours, ref_theirs = ref_ours + ro, ref_theirs + rt
        report["per_prompt"].append(row)
    report["agreement"] = agree / total
    if refs is not None:
        report["ours_vs_reference"] = ref_ours / total
        report["reference_vs_llama_cpp"] = ref_theirs / total
    return report


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def markdown(reports: list[dict[str, Any]]) -> str:
    """Issue 28's table: one row per file. "within 10%": the planned weights and the model's
    tensors each within 10% of the file, and the peak RSS growth within 10% of file + KV pool."""
    head = ("| file | file size | planned weights | model tensors | RSS growth peak (anon) / file + KV | within 10% | "
            "plan's reason line (types as stored, kernels) | top-1 vs llama.cpp (per prompt) | first difference | "
            "ours vs our Q4_1 | Q4_1 vs llama.cpp |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in reports:
        f, w, h = r["file_bytes"], r["planned_weight_bytes"], r["held_bytes"]
        total = f + r["kv_bytes"]
        within = all(abs(x - 1) <= 0.10 for x in (w / f, h / f, r["rss_peak"] / total))
        reason = r["reason"].split(" (sized from")[0].removeprefix("gguf blocks as stored ")
        firsts = ", ".join("-" if p["first_difference"] is None else str(p["first_difference"]) for p in r["per_prompt"])
        lines.append(
            f"| {Path(r['model']).name} | {f / MIB:.1f} MiB | {w / MIB:.1f} MiB ({100 * (w / f - 1):+.1f}%) | "
            f"{h / MIB:.1f} MiB ({100 * (h / f - 1):+.1f}%) | {r['rss_peak'] / MIB:.0f} ({r['anon_peak'] / MIB:.0f}) / "
            f"{total / MIB:.0f} MiB ({100 * (r['rss_peak'] / total - 1):+.1f}%) | {'yes' if within else 'no'} | "
            f"{reason} | **{_pct(r['agreement'])}** ({', '.join(_pct(p['agreement']) for p in r['per_prompt'])}) | "
            f"{firsts} | "
            f"{_pct(r.get('ours_vs_reference'))} | {_pct(r.get('reference_vs_llama_cpp'))} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", "-m", action="append", default=None,
                   help="a GGUF file (repeatable; default: the default model's)")
    p.add_argument("--tokens", type=int, default=256, help="greedy tokens per prompt (default 256)")
    p.add_argument("--prompts", type=int, default=3, help=f"prompts, 1-{len(PROMPTS)} (default 3)")
    p.add_argument("--reference", default="default",
                   help="our Q4_1 path to compare with: a GGUF file, 'default' (the default model's) or 'none'")
    p.add_argument("--threads", "-t", type=int, default=os.cpu_count() or 2)
    p.add_argument("--llama-cpp-dir", type=Path, default=None)
    p.add_argument("--json", action="store_true")
    p.add_argument("--markdown", action="store_true", help="print the table docs/benchmarks.md holds")
    args = p.parse_args(argv)
    from localllm.errors import LocalLLMError

    if not 1 <= args.prompts <= len(PROMPTS) or args.tokens < 1:
        print(f"error: --prompts takes 1-{len(PROMPTS)} and --tokens a positive count", file=sys.stderr)
        return 2
    try:
        files = [resolve_gguf(m) for m in (args.model or [None])]
        reference = None if args.reference == "none" else resolve_gguf(
            None if args.reference == "default" else args.reference)
        tools = find_llama_cpp(args.llama_cpp_dir)
        if tools.server is None:
            raise PeerError(tools.missing("llama-server"))
        if len(files) == 1:
            reports = [measure(files[0], reference, tools.server, args.tokens, args.prompts, args.threads)]
        else:  # a fresh process per file: each one's memory growth is its own
            reports = []
            for f in files:
                cmd = [sys.executable, os.path.abspath(__file__), "--model", str(f), "--json",
                       "--tokens", str(args.tokens), "--prompts", str(args.prompts),
                       "--reference", str(reference or "none"), "--threads", str(args.threads)]
                if args.llama_cpp_dir:
                    cmd += ["--llama-cpp-dir", str(args.llama_cpp_dir)]
                r = subprocess.run(cmd, capture_output=True, text=True)
                if r.returncode != 0:
                    raise PeerError(f"{f.name}: {(r.stderr.strip().splitlines() or ['no output'])[-1]}")
                reports.append(json.loads(r.stdout)["files"][0])
                print(f"{f.name}: done", file=sys.stderr, flush=True)
    except (PeerError, LocalLLMError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"files": reports, "machine": machine()}, indent=2))
    elif args.markdown:
        print(markdown(reports))
    else:
        for r in reports:
            print(f"{Path(r['model']).name}: top-1 agreement with llama.cpp {_pct(r['agreement'])} over "
                  f"{r['prompts']} x {r['tokens']} greedy tokens (teacher-forced); first differences at "
                  f"{[p['first_difference'] for p in r['per_prompt']]}"
                  + (f"; ours vs our Q4_1 {_pct(r['ours_vs_reference'])}, Q4_1 vs llama.cpp "
                     f"{_pct(r['reference_vs_llama_cpp'])}" if "ours_vs_reference" in r else ""))
            print(f"  memory: file {r['file_bytes'] / MIB:.1f} MiB, "
                  f"planned weights {r['planned_weight_bytes'] / MIB:.1f} MiB, "
                  f"model tensors {r['held_bytes'] / MIB:.1f} MiB, RSS growth peak {r['rss_peak'] / MIB:.0f} MiB "
                  f"(anon {r['anon_peak'] / MIB:.0f}) against a plan of {r['expected_measured_bytes'] / MIB:.0f} MiB "
                  f"(KV {r['kv_bytes'] / MIB:.0f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
