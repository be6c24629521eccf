#!/usr/bin/env python
"""Top-1 agreement with llama.cpp on the same GGUF file: llama-server writes 256 greedy tokens
after a chat prompt, and localllm, fed that same text token by token (teacher forcing, the
prefix cache making each step one token), says which token it would pick at each position.

    python bench/gguf_agreement.py --model ~/.cache/localllm-fixtures/smollm2-135m-instruct.Q4_K_M.gguf
    python bench/gguf_agreement.py --model FILE.gguf --tokens 256 --json

Agreement = positions where localllm's argmax is llama.cpp's token / positions. Both run
greedy with EOS ignored; llama.cpp rounds activations to 8 bits once per block, localllm to
two 8-bit levels, so a near-tie between the top two can go either way: a file's own noise.
Also reported: the first position where the two would part (free-running greedy texts are
identical up to there). llama-server comes from bench/peers.py --build.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/peers: finding llama.cpp

from peers import PeerError, Server, find_llama_cpp, free_port, machine, resolve_gguf  # noqa: E402

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from pathlib import Path  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


async def llama_cpp_tokens(server_bin: Path, gguf: Path, prompt: list[int], n: int, threads: int) -> list[int]:
    import httpx

    port = free_port()
    argv = [str(server_bin), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
            "-c", str(len(prompt) + n + 16), "-np", "1"]
    async with Server("llama-server", argv, port, dict(os.environ), 600) as server:
        async with httpx.AsyncClient(timeout=600) as http:
            r = await http.post(f"{server.base}/completion", json={
                "prompt": prompt, "n_predict": n, "temperature": 0, "top_k": 1, "ignore_eos": True,
                "cache_prompt": False, "return_tokens": True, "samplers": ["top_k"]})
            r.raise_for_status()
            tokens = r.json().get("tokens")
    if not isinstance(tokens, list) or len(tokens) != n:
        raise PeerError(f"llama-server returned {len(tokens) if isinstance(tokens, list) else 'no'} tokens, not {n}")
    return [int(t) for t in tokens]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", "-m", default=None, help="a GGUF file (default: the default model's)")
    p.add_argument("--tokens", type=int, default=256, help="greedy tokens to compare (default 256)")
    p.add_argument("--threads", "-t", type=int, default=os.cpu_count() or 2)
    p.add_argument("--llama-cpp-dir", type=Path, default=None)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    from localllm import LLM, SamplingParams
    from localllm.errors import LocalLLMError

    try:
        gguf = resolve_gguf(args.model)
        tools = find_llama_cpp(args.llama_cpp_dir)
        if tools.server is None:
            raise PeerError(tools.missing("llama-server"))
        llm = LLM(str(gguf), device="cpu", compile=False)
        tok = llm.tokenizer
        messages = [{"role": "user", "content": PROMPT}]
        prompt = tok.encode_chat(messages) if tok.chat_template else tok.encode(PROMPT)
        t0 = time.monotonic()
        theirs = asyncio.run(llama_cpp_tokens(tools.server, gguf, prompt, args.tokens, args.threads))
        t1 = time.monotonic()
        greedy = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        ours = [llm.generate([prompt + theirs[:i]], greedy)[0].outputs[0].token_ids[0] for i in range(args.tokens)]
        t2 = time.monotonic()
    except (PeerError, LocalLLMError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    same = [a == b for a, b in zip(ours, theirs)]
    first = next((i for i, s in enumerate(same) if not s), None)
    report = {"model": str(gguf), "precision": llm.engine.precision,
              "tokens": args.tokens, "agreement": sum(same) / len(same), "first_difference": first,
              "llama_cpp_s": round(t1 - t0, 1), "localllm_s": round(t2 - t1, 1), "machine": machine()}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"{gguf.name}: top-1 agreement with llama.cpp {100 * report['agreement']:.1f}% over {args.tokens} "
              f"greedy tokens (teacher-forced); first difference at {first}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
