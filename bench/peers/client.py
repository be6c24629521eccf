"""The client side of a peers run, the same for both servers: the prompts (exact token counts by
our tokenizer), one streamed chat read with the official ``openai`` client, and the aggregate
figures of a set of streams. TTFT is taken at the first chunk that carries content.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from localllm.bench import TOPICS, code_file, percentile, prose

from .environment import PeerError

if TYPE_CHECKING:
    from openai import AsyncOpenAI
    from openai.types.chat import ChatCompletionChunk

    from localllm.tokenizer import Tokenizer

# llama-server's defaults, sent to both servers for the ``sampled`` measure
CHAT_SAMPLING = {"temperature": 0.8, "top_p": 0.95, "top_k": 40, "min_p": 0.05}
SYSTEM = "You are a helpful assistant."


def load_tokenizer(gguf: Path) -> Tokenizer:
    from localllm.models.formats import open_checkpoint

    return open_checkpoint(gguf).tokenizer


def exact_ids(tokenizer: Tokenizer, tokens: int, nonce: str) -> list[int]:
    ids = tokenizer.encode(prose(tokens + 16, nonce, tokenizer), add_special_tokens=False)[:tokens]
    if len(ids) != tokens:
        raise PeerError(f"could not build a {tokens}-token prompt")
    return ids


def prompt_of(tokenizer: Tokenizer, tokens: int, nonce: str) -> list[dict[str, str]]:
    """System + user messages whose chat prompt is ``tokens`` tokens long by our tokenizer
    (llama-server applies the same template from the GGUF; usage.prompt_tokens checks it)."""
    def messages(doc_tokens: int) -> list[dict[str, str]]:
        doc = prose(max(doc_tokens, 1), nonce, tokenizer)
        return [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"{doc}\n\nSummarize the document in one line."}]

    overhead = len(tokenizer.encode_chat(messages(1))) - 1
    doc_tokens = tokens - overhead
    for _ in range(8):  # BPE merges at the seams move the count by a token or two
        n = len(tokenizer.encode_chat(messages(doc_tokens)))
        if n == tokens:
            break
        doc_tokens += tokens - n
    return messages(doc_tokens)


@dataclass(slots=True)
class StreamResult:
    """One streamed reply, timed from just before the request was sent."""

    ttft_s: float | None  # first chunk that carries content
    first_chunk_s: float | None  # first chunk of any kind (often role-only): not a TTFT
    end_s: float
    output_tokens: int  # usage.completion_tokens where the server sent it, else content chunks
    prompt_tokens: int | None
    content_chunks: int
    text: str


def summarize_stream(t0: float, events: Sequence[tuple[float, ChatCompletionChunk]]) -> StreamResult:
    """``events`` are (arrival time, chunk) in order."""
    ttft = first = None
    chunks = 0
    text: list[str] = []
    usage = None
    for t, chunk in events:
        if first is None:
            first = t - t0
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                if ttft is None:
                    ttft = t - t0
                chunks += 1
                text.append(choice.delta.content)
    return StreamResult(
        ttft_s=ttft, first_chunk_s=first, end_s=(events[-1][0] - t0) if events else 0.0,
        output_tokens=usage.completion_tokens if usage is not None else chunks,
        prompt_tokens=usage.prompt_tokens if usage is not None else None,
        content_chunks=chunks, text="".join(text),
    )


async def stream_chat(client: AsyncOpenAI, model: str, messages: list[dict[str, str]], max_tokens: int,
                      clock: Callable[[], float] = time.monotonic,
                      sampling: dict[str, float] | None = None) -> StreamResult:
    """``sampling``: temperature, top_p, top_k, min_p; default greedy."""
    t0 = clock()
    sampling = sampling or {"temperature": 0.0}
    extra = {k: v for k, v in sampling.items() if k in ("top_k", "min_p")}
    stream = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=sampling["temperature"],  # type: ignore[arg-type]
        top_p=sampling.get("top_p", 1.0), stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True, **extra},
    )
    events = []
    async for chunk in stream:
        events.append((clock(), chunk))
    return summarize_stream(t0, events)


def aggregate(results: Sequence[StreamResult], wall_s: float, asked: int) -> dict[str, Any]:
    """Output tok/s over the wall time of the whole set, plus what tells a fair run: the TTFT
    median, the prompt lengths, and streams that wrote other than ``asked`` tokens."""
    tokens = sum(r.output_tokens for r in results)
    ttfts = [r.ttft_s for r in results if r.ttft_s is not None]
    return {
        "tok_s": tokens / wall_s if wall_s > 0 else 0.0,
        "tokens": tokens, "wall_s": round(wall_s, 3),
        "ttft_p50_s": percentile(ttfts, 50),
        "prompt_tokens": sorted({r.prompt_tokens for r in results if r.prompt_tokens is not None}),
        "short_streams": sum(r.output_tokens != asked for r in results),
    }


def story(nonce: str, i: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"[{nonce}-{i}] Write a long story about {TOPICS[i % len(TOPICS)]}."}]


async def server_sequential(client: AsyncOpenAI, model: str, n: int, tokens: int, nonce: str,
                            sampling: dict[str, float] | None = None) -> dict[str, Any]:
    t0 = time.monotonic()
    results = [await stream_chat(client, model, story(nonce, i), tokens, sampling=sampling) for i in range(n)]
    return aggregate(results, time.monotonic() - t0, tokens)


async def server_concurrent(client: AsyncOpenAI, model: str, n: int, tokens: int, nonce: str) -> dict[str, Any]:
    t0 = time.monotonic()
    results = await asyncio.gather(*(stream_chat(client, model, story(nonce, i), tokens) for i in range(n)))
    return aggregate(results, time.monotonic() - t0, tokens)


async def server_prefix(client: AsyncOpenAI, model: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    cold = await stream_chat(client, model, messages, 4)
    hit = await stream_chat(client, model, messages, 4)
    return {"cold_ttft_s": cold.ttft_s, "hit_ttft_s": hit.ttft_s, "prompt_tokens": cold.prompt_tokens}


def decode_rate(r: StreamResult) -> float | None:
    """Tokens after the first over the time after it: the decode speed, the prompt's prefill
    left out (what speculation changes)."""
    if r.ttft_s is None or r.end_s <= r.ttft_s or r.output_tokens < 2:
        return None
    return (r.output_tokens - 1) / (r.end_s - r.ttft_s)


async def server_spec(client: AsyncOpenAI, model: str, tokens: int, nonce: str) -> dict[str, Any]:
    """One stream, greedy, of a reply that copies its prompt (a code file to repeat: what
    n-gram speculation is for), then one of prose (where it should step aside); each one's
    decode speed."""
    code = code_file(8, nonce)
    copy = [{"role": "user", "content": f"Repeat this file exactly.\n\n```python\n{code}```"}]
    a = await stream_chat(client, model, copy, tokens)
    b = await stream_chat(client, model, story(nonce, 0), tokens)
    return {"code_tok_s": decode_rate(a), "prose_tok_s": decode_rate(b),
            "prompt_tokens": sorted({r.prompt_tokens for r in (a, b) if r.prompt_tokens is not None}),
            "short_streams": sum(r.output_tokens != tokens for r in (a, b)), "tokens": a.output_tokens + b.output_tokens,
            "code_ttft_s": a.ttft_s, "code_text_head": a.text[:80]}
