"""localllm against llama.cpp on the same GGUF file, in one run, as ratios (issue 13, item 6).

    python bench/peers.py                          # every measure, 3 interleaved trials
    python bench/peers.py --only single,prefill --trials 5
    python bench/peers.py --only server16,prefix --json
    python bench/peers.py --build                  # build llama.cpp into the user cache first

Measures (``--only``, default all):

- ``single``: single-stream greedy decode, 128 tokens. llama.cpp: ``llama-bench -p 0 -n 128``
  (tg128); localllm: the engine in-process (what ``localllm run --json --raw --temperature 0
  --max-tokens 128`` runs), EOS ignored; llama-cpp-python in-process too, where it is installed.
- ``prefill``: cold prefill of 512 tokens. llama.cpp: ``llama-bench -p 512 -n 0`` (pp512);
  localllm: 512 / TTFT of a 512-token raw prompt with the prefix cache empty.
- ``sampled``: one stream through the servers, 128 tokens, sampled as a chat app samples:
  ``temperature=0.8, top_p=0.95, top_k=40, min_p=0.05`` (llama-server's own defaults, sent
  explicitly to both), EOS ignored. What a person chatting gets, sampler included.
- ``seq8``: 8 requests one after another, 128 tokens each, through the servers.
- ``server8``, ``server16``: 8 and 16 concurrent streams, 128 tokens each, aggregate output tok/s.
- ``prefix``: a 1,516-token prompt, cold TTFT, then the same prompt again (prefix cache hit).
- ``spec`` (only when named): three servers per trial: ours with n-gram speculation
  (``--speculative-ngram 10``), ours without, llama-server with its own (``--spec-type
  ngram-simple``); one greedy stream of a reply that copies its prompt (a code file to repeat)
  and one of prose, decode tok/s (the tokens after the first over the time after it); then,
  ours only, 16 concurrent streams. Rows: ours over llama.cpp (code, prose) and ours with
  speculation over ours without (code, prose, 16 streams).

Servers: ``llama-server -np 16 -c 32768 -t T`` and ``localllm serve --max-num-seqs 16``, each
started fresh for every trial and measured once ``/health`` answers 200 (llama-server answers
503 while it loads), after one short warm-up request and, ours, once ``/metrics`` says its
compiled decode step is in (``localllm:decode_graphs_pending 0``: a server loads its saved
graphs after its first step and answers eagerly until then). One client for both: the official
``openai`` package, ``stream=True``, ``temperature=0`` and ``ignore_eos`` so both write the same
number of tokens (checked against ``usage``). TTFT is taken at the first chunk that carries
content: both servers send a role-only chunk first, as OpenAI does.

Trials interleave, localllm then llama.cpp, and the table shows medians; ``--json`` has every
trial. A ratio is a speed, localllm's over llama.cpp's: tok/s over tok/s, and llama.cpp's TTFT
over ours, so above 1 means localllm is faster. The header gives the CPU model, its ISA flags,
the load average and the date, and the report lists the exact commands.

llama.cpp: ``llama-bench`` and ``llama-server`` built from the sources that the llama-cpp-python
sdist vendors, in the user cache and never in the repository. They are looked for in
``--llama-cpp-dir``, ``$LOCALLLM_LLAMA_CPP_DIR`` or ``<cache>/build/bin`` (``<cache>`` is
``~/.cache/localllm-peers``, or ``$LOCALLLM_HOME/peers``); ``--build`` downloads the sdist with
pip and builds them there with cmake (a few minutes on 2 cores). Where they cannot be found
or built, the llama.cpp measures are skipped with a one-line message.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from localllm.cli_common import positive_int

from .build import ENV_DIR, build_llama_cpp, find_llama_cpp, peers_cache
from .environment import PeerError, machine
from .processes import llama_cpp_python_available
from .report import format_report
from .run import EXTRA_MEASURES, MEASURES, Options, run_peers


def _measures(text: str) -> tuple[str, ...]:
    items = tuple(x.strip() for x in text.split(",") if x.strip())
    known = MEASURES + EXTRA_MEASURES
    bad = [x for x in items if x not in known]
    if bad or not items:
        raise argparse.ArgumentTypeError(f"unknown measure {', '.join(bad) or repr(text)} "
                                         f"(choose from {', '.join(known)})")
    return tuple(m for m in known if m in items)  # the documented order, whatever the order given


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench/peers.py", description=(__doc__ or "").split("\n\n")[0],
        epilog="Measures: " + ", ".join(MEASURES) + f"; only when named: {', '.join(EXTRA_MEASURES)}. "
               "See the module docstring for what each one runs.",
    )
    p.add_argument("--model", "-m", default=None,
                   help="a GGUF file or a pulled GGUF model's name (default: the default model's file in the store)")
    p.add_argument("--only", type=_measures, default=MEASURES, help="comma-separated measures (default: all)")
    p.add_argument("--trials", type=positive_int, default=3, help="interleaved trials per measure (default 3)")
    p.add_argument("--threads", "-t", type=positive_int, default=None,
                   help="threads for both (llama.cpp -t, our OMP_NUM_THREADS; default: the CPUs this process may use)")
    p.add_argument("--tokens", type=positive_int, default=128, help="tokens per decode and per stream (default 128)")
    p.add_argument("--prefill-tokens", type=positive_int, default=512, help="cold prefill length (default 512)")
    p.add_argument("--prefix-tokens", type=positive_int, default=1516, help="prefix-cache prompt length (default 1516)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto", help="ours")
    p.add_argument("--quant", default=None, help="ours: int8, rtn4, ... (default: the plan's)")
    p.add_argument("--llama-cpp-dir", type=Path, default=None,
                   help=f"a llama.cpp build (default: ${ENV_DIR}, else the user cache's build/bin)")
    p.add_argument("--build", action="store_true",
                   help="build llama-server, llama-bench and llama-quantize into the user cache from the "
                        "llama-cpp-python sdist")
    p.add_argument("--ready-timeout", type=positive_int, default=600,
                   help="seconds a server may take to load (default 600)")
    p.add_argument("--json", action="store_true", help="print the full report as JSON")
    return p


def resolve_gguf(model: str | None) -> Path:
    from localllm import store

    path = store.resolve(model)
    if path.suffix != ".gguf":
        raise PeerError(f"{model or 'the default model'} is {path}, not a .gguf file: llama.cpp needs GGUF; "
                        "pass --model FILE.gguf")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from localllm.errors import LocalLLMError

    def say(msg: str) -> None:
        print(f"peers: {msg}", file=sys.stderr, flush=True)

    try:
        if args.llama_cpp_dir is not None and not args.llama_cpp_dir.is_dir():
            raise PeerError(f"--llama-cpp-dir {args.llama_cpp_dir}: no such folder")
        gguf = resolve_gguf(args.model)
        llama = find_llama_cpp(args.llama_cpp_dir)
        if args.build:
            bin_dir = build_llama_cpp(peers_cache(), machine()["isa"], say)
            llama = find_llama_cpp(bin_dir)
        needs_bench = {"single", "prefill"} & set(args.only)
        if llama.bench is None and llama.server is None and not (needs_bench and llama_cpp_python_available() is None):
            print(f"peers: {llama.missing('llama-bench or llama-server')}", file=sys.stderr)
            return 0
        threads = args.threads or machine()["cpus"] or 2
        o = Options(gguf=gguf, only=args.only, trials=args.trials, threads=threads, tokens=args.tokens,
                    prefill_tokens=args.prefill_tokens, prefix_tokens=args.prefix_tokens, dtype=args.dtype,
                    quant=args.quant, ready_timeout_s=float(args.ready_timeout), llama=llama, say=say)
        report = run_peers(o)
    except (PeerError, LocalLLMError) as e:
        print(f"peers: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0
