"""How a request's engine outputs reach the client: all at once when they finish (``finals``),
or as an SSE body of chunks (``chat_stream``, ``completion_stream``).

Either way the request's ``Admission`` is released when the response ends, however it ends,
and closing the output stream aborts the engine requests still running.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from starlette.requests import Request

from localllm.engine.engine import RequestOutput
from localllm.server.admission import Admission, Job, ServerState, fan_in
from localllm.server.asgi import ClientGone, sse, unless_disconnected
from localllm.server.openai_shapes import chat_logprobs, completion_logprobs, engine_error, tool_fields, usage
from localllm.server.protocol import APIError, ChatRequest, CompletionRequest
from localllm.server.reasoning_fields import reply_parsers
from localllm.server.tools import ToolCalling


async def finals(
    request: Request, state: ServerState, jobs: list[Job], admission: Admission,
) -> list[RequestOutput | None]:
    """Every job's finished output, in job order. A hang-up is a 499, the request timeout a
    504, an engine failure the error ``engine_error`` picks."""
    outs: list[RequestOutput | None] = [None] * len(jobs)

    async def run() -> None:
        stream = fan_in(state.engine, jobs)
        try:
            async for k, out in stream:
                admission.started(k)
                if out.finished:
                    outs[k] = out
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    try:
        await unless_disconnected(request.receive, run(), admission.remaining())
    except ClientGone:
        raise APIError(499, "client closed the request") from None
    except asyncio.TimeoutError:
        raise admission.timed_out() from None
    except APIError:
        raise
    except Exception as e:  # noqa: BLE001 - an engine failure becomes an HTTP error, not a 500 page
        raise engine_error(e) from None
    finally:
        admission.release()
    return outs


async def sse_stream(
    state: ServerState, include_usage: bool, n: int, prompts: list[list[int]], jobs: list[Job],
    base: dict[str, Any], choice_fields: Callable[[int, RequestOutput, int, int], dict[str, Any] | None],
    admission: Admission, first: Iterable[dict[str, Any]] = (),
) -> AsyncIterator[bytes]:
    """The SSE body of both endpoints: the ``first`` choices, then one chunk per text delta of
    job k with ``choice_fields(k, out, first_token, end_token)`` (the tokens it covers; None
    holds the delta back, a "finish_reason" there overrides the engine's) and one when a job
    finishes, then usage when asked, then [DONE]. An engine error or the request timeout
    after the headers are out is reported in-band, as vLLM does."""
    extra = {"usage": None} if include_usage else {}
    for choice in first:
        yield sse({**base, "choices": [choice], **extra})
    sent_tokens = [0] * len(jobs)
    outs: list[RequestOutput | None] = [None] * len(jobs)
    stream = fan_in(state.engine, jobs)
    try:
        while True:
            try:
                k, out = await asyncio.wait_for(stream.__anext__(), admission.remaining())
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:  # wait_for cancelled the stream, which aborted its requests
                yield sse(admission.timed_out().body())
                break
            admission.started(k)
            c = out.outputs[0]
            if out.finished:
                outs[k] = out
            elif not c.delta_text:
                continue  # text held back (a possible stop string): nothing to send yet
            end = len(c.token_ids)
            fields = choice_fields(k, out, sent_tokens[k], end)
            if fields is None:
                continue
            choice = {"index": k, "finish_reason": c.finish_reason if out.finished else None, **fields}
            if out.finished:
                choice["stop_reason"] = c.stop_reason
            sent_tokens[k] = end
            yield sse({**base, "choices": [choice], **extra})
        if include_usage:
            yield sse({**base, "choices": [], "usage": usage(prompts, n, outs)})
    except Exception as e:  # noqa: BLE001 - headers are sent: report it in-band
        yield sse(engine_error(e).body())
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
        admission.release()
    yield b"data: [DONE]\n\n"


def chat_stream(
    state: ServerState, req: ChatRequest, prompts: list[list[int]], jobs: list[Job], rid: str,
    admission: Admission, calling: ToolCalling | None = None,
) -> AsyncIterator[bytes]:
    base = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": state.model}
    parsers = [calling.parser() for _ in jobs] if calling is not None else None
    thinking = reply_parsers(state, prompts[0], len(jobs))

    def fields(k: int, out: RequestOutput, start: int, end: int) -> dict[str, Any] | None:
        text, reasoning = out.outputs[0].delta_text, ""
        if thinking is not None:  # the answer goes on to the tool parser; the reasoning beside it
            split = thinking[k].read(text, out.finished)
            text, reasoning = split.content, split.reasoning
        if parsers is not None:
            f = tool_fields(parsers[k], out, text)
        elif text or reasoning or out.finished:
            f = {"delta": {"content": text} if text else {},
                 "logprobs": chat_logprobs(state, out, start, end, req.top_logprobs) if req.logprobs else None}
        else:
            return None  # held back (a reasoning marker may be starting): its tokens go with the next chunk
        if reasoning:
            f = f or {"delta": {}, "logprobs": None}
            f["delta"]["reasoning_content"] = reasoning
        return f

    roles = [{"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
             for k in range(len(jobs))]
    return sse_stream(state, req.include_usage, req.n, prompts, jobs, base, fields, admission, roles)


def completion_stream(
    state: ServerState, req: CompletionRequest, prompts: list[list[int]], jobs: list[Job], rid: str,
    admission: Admission,
) -> AsyncIterator[bytes]:
    base = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": state.model}
    sent_chars = [0] * len(jobs)  # text offsets of the logprobs, per job

    def fields(k: int, out: RequestOutput, start: int, end: int) -> dict[str, Any]:
        text = out.outputs[0].delta_text
        lp = None if req.logprobs is None else completion_logprobs(
            state, out, start, end, req.logprobs, sent_chars[k])
        sent_chars[k] += len(text)
        return {"text": text, "logprobs": lp}

    return sse_stream(state, req.include_usage, req.n, prompts, jobs, base, fields, admission)
