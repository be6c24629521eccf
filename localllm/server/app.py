"""``localllm serve``: an OpenAI-compatible HTTP API on one ``AsyncEngine``.

Every client's request goes into the same engine, so concurrent clients are continuously
batched together. Requests are validated in full before anything is generated (see
``protocol``); once a stream has started, an engine error arrives as an SSE ``error`` event,
as vLLM sends it. A client that disconnects aborts its requests, which frees their KV blocks.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import socket
import sys
import threading
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from localllm.engine.async_engine import AsyncEngine
from localllm.engine.engine import RequestOutput
from localllm.engine.guided import GrammarError
from localllm.engine.sequence import SamplingParams, choice_seed
from localllm.errors import InvalidParameterError, LocalLLMError
from localllm.server.allow_lists import AllowLists
from localllm.server.browser_guard import BrowserGuard
from localllm.server.protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    GenerationRequest,
    context_length_error,
    parse_chat,
    parse_completion,
)
from localllm.server.sockets import bind_socket, socket_url
from localllm.server.structured import parse_guided
from localllm.server.tools import ToolCalling, ToolCallParser, assistant_message, parse_tools, tool_messages

MAX_BODY_BYTES = 4 * 2**20
# A client whose body is over the limit is still read up to this much, so that it gets the
# 413 answer instead of a reset connection while it is still uploading.
DRAIN_BYTES = 64 * 2**20
OPEN_PATHS = frozenset({"/health"})
RETRY_AFTER_S = 1  # a 503's Retry-After: the waiting queue moves every engine step

Job = tuple[list[int], SamplingParams, str]  # prompt ids, params, request id


class _ClientGone(Exception):
    pass


# ---- the engine side ----

@dataclass(slots=True)
class _Limits:
    """Load limits, as vLLM's and llama-server's. None is off."""

    max_waiting: int | None = None  # engine requests admitted that have no first token yet
    request_timeout: float | None = None  # seconds from admission to the last token


@dataclass(slots=True)
class _State:
    """Per app. The counters are written only on the app's event loop."""

    engine: AsyncEngine
    model: str
    context_limit: int
    vocab_size: int  # the model's: the bound of top_k, stop_token_ids and prompt ids
    created: int
    token_text: Callable[[int], str]
    sampling_defaults: dict[str, float | int]  # for the fields a request omits
    limits: _Limits = field(default_factory=_Limits)
    num_waiting: int = 0  # held by _Admission objects
    num_rejected: int = 0  # 503s for --max-waiting
    num_timed_out: int = 0


class _Admission:
    """The waiting slots one HTTP request holds: one per job, from admission until that job's
    first output. ``release`` gives back whatever is left; the response calls it when it ends,
    however it ends, so no slot outlives its request."""

    def __init__(self, state: _State, num_jobs: int) -> None:
        limit = state.limits.max_waiting
        if limit is not None and num_jobs > limit:  # no wait would help: not a 503
            raise APIError(400, f"this request makes {num_jobs} sequences (n x prompts), more than the server's "
                                f"--max-waiting {limit}", param="n", code="invalid_value")
        if limit is not None and state.num_waiting + num_jobs > limit:
            state.num_rejected += 1
            raise APIError(503, f"the server is busy: {state.num_waiting} requests are waiting for their first "
                                f"token (limit {limit}, --max-waiting); retry shortly",
                           type_="server_error", code="server_busy", headers={"Retry-After": str(RETRY_AFTER_S)})
        self.state = state
        self.pending = set(range(num_jobs))
        self.deadline = None if state.limits.request_timeout is None else (
            time.monotonic() + state.limits.request_timeout)
        state.num_waiting += num_jobs

    def started(self, k: int) -> None:
        if k in self.pending:
            self.pending.discard(k)
            self.state.num_waiting -= 1

    def release(self) -> None:
        self.state.num_waiting -= len(self.pending)
        self.pending.clear()

    def remaining(self) -> float | None:
        return None if self.deadline is None else max(self.deadline - time.monotonic(), 0.0)

    def timed_out(self) -> APIError:
        self.state.num_timed_out += 1
        return APIError(504, f"the request ran past the server's limit of {self.state.limits.request_timeout:g} s "
                             "(--request-timeout) and was stopped", type_="server_error", code="timeout")


def public_model_name(name: str) -> str:
    """The model's name as the routes show it: a catalog or hub id as it is, a local file or
    folder by its last component. The path itself would tell anyone who can reach /health the
    user's name and folder layout."""
    path = Path(name).expanduser()
    if path.is_absolute() or name.startswith((".", "~")) or path.exists():
        return path.resolve().name or name
    return name


def _make_state(engine: AsyncEngine, model_name: str | None) -> _State:
    llm = engine.engine
    tokenizer = engine.tokenizer

    @lru_cache(maxsize=65536)
    def token_text(token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False)

    return _State(engine, model_name or public_model_name(llm.model_name), llm.context_limit,
                  llm.runner.model.config.vocab_size, int(time.time()), token_text, dict(llm.sampling_defaults))


def _fan_in(engine: AsyncEngine, jobs: list[Job]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs of several requests as one stream of (job index, output). Closing or
    cancelling the stream aborts every request still running."""
    if len(jobs) == 1:
        return _single(engine, jobs[0])
    return _many(engine, jobs)


async def _single(engine: AsyncEngine, job: Job) -> AsyncIterator[tuple[int, RequestOutput]]:
    async for out in engine.generate(*job):
        yield 0, out


async def _many(engine: AsyncEngine, jobs: list[Job]) -> AsyncIterator[tuple[int, RequestOutput]]:
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(k: int, job: Job) -> None:
        try:
            async for out in engine.generate(*job):
                queue.put_nowait((k, out))
            queue.put_nowait((k, None))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which picks the status
            queue.put_nowait((k, e))

    tasks = [asyncio.create_task(pump(k, job)) for k, job in enumerate(jobs)]
    try:
        remaining = len(jobs)
        while remaining:
            k, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield k, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _prompt_ids(
    state: _State, prompt: str | list[int] | list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    tokenizer = state.engine.tokenizer
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        vocab = tokenizer.vocab_size
        bad = next((t for t in prompt if t >= vocab), None)  # type: ignore[operator]
        if bad is not None:
            raise APIError(400, f"'prompt': token id {bad} is outside the vocabulary (size {vocab})",
                           param="prompt", code="invalid_value")
        return list(prompt)  # type: ignore[arg-type]
    try:
        # a long prompt takes milliseconds to tokenize: keep it off the event loop that streams
        if isinstance(prompt, str):
            return await asyncio.to_thread(tokenizer.encode, prompt)
        return await asyncio.to_thread(tokenizer.encode_chat, prompt, True, tools)  # type: ignore[arg-type]
    except LocalLLMError as e:
        raise APIError(400, str(e), param="messages" if isinstance(prompt, list) else "prompt") from None


def _jobs(state: _State, req: GenerationRequest, prompts: list[list[int]], param: str, base_id: str) -> list[Job]:
    jobs: list[Job] = []
    for p, ids in enumerate(prompts):
        if not ids:
            raise APIError(400, f"'{param}': the prompt is empty", param=param, code="invalid_value")
        if len(ids) >= state.context_limit or (
            req.max_tokens is not None and len(ids) + req.max_tokens > state.context_limit
        ):
            raise context_length_error(state.context_limit, len(ids), req.max_tokens, param)
        for i in range(req.n):
            # choice i gets seed + i, so choices differ reproducibly
            kw = {**req.sampling, "seed": choice_seed(req.sampling["seed"], i)}
            try:
                params = SamplingParams(**kw)
                # against the model here, before a stream starts: the engine checks it again
                params.validate(state.vocab_size)
            except InvalidParameterError as e:
                raise APIError(422, f"'{e.param}': {e.problem}", param=e.param, code="invalid_value") from None
            jobs.append((ids, params, f"{base_id}-{p * req.n + i}"))
    return jobs


async def _chat_inputs(state: _State, body: Any) -> tuple[ChatRequest, list[int], ToolCalling | None, str | None]:
    """The chat request with its structured-output and tool fields read, and its prompt
    rendered with the tools; the last item names the field that asked for a grammar."""
    req = parse_chat(body, state.sampling_defaults)
    guided = parse_guided(body)
    calling = parse_tools(body, state.engine.tokenizer)
    tool_messages(body["messages"], req.messages)
    if calling is not None and calling.grammar is not None:
        if guided.param is not None:
            raise APIError(400, f"'{guided.param}' and a forced 'tool_choice' both constrain the output; send one",
                           param=guided.param, code="invalid_value")
        guided.sampling, guided.param = {"guided_grammar": calling.grammar}, "tools"
    req.sampling.update(guided.sampling)
    ids = await _prompt_ids(state, req.messages, calling.tools if calling is not None else None)
    return req, ids, calling, guided.param


async def _compile_grammar(state: _State, jobs: list[Job], param: str | None) -> None:
    """Compiles the request's grammar on a worker thread before anything is generated, so
    that a bad schema is a 400 (the engine thread then finds it cached)."""
    if param is None:
        return
    try:
        await asyncio.to_thread(state.engine.engine.guided.compile, jobs[0][1])
    except GrammarError as e:
        raise APIError(400, f"'{param}': {e}", param=param, code="invalid_value") from None


def _usage(prompts: list[list[int]], n: int, finals: list[RequestOutput | None]) -> dict[str, Any]:
    completion = sum(len(o.outputs[0].token_ids) for o in finals if o is not None)
    # a prompt counts once however many choices it has, as OpenAI bills it
    prompt = sum(len(ids) for ids in prompts)
    cached = sum((finals[p * n].num_cached_tokens if finals[p * n] is not None else 0)  # type: ignore[union-attr]
                 for p in range(len(prompts)))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _limit(value: float | None) -> float | str:
    return "+Inf" if value is None else value


def _engine_error(e: BaseException) -> APIError:
    if isinstance(e, LocalLLMError):
        return APIError(400, str(e))
    return APIError(500, f"engine error: {type(e).__name__}: {e}", type_="server_error", code="engine_error")


# ---- logprobs in OpenAI's two shapes ----

def _chat_logprobs(state: _State, out: RequestOutput, start: int, end: int, top: int) -> dict[str, Any] | None:
    c = out.outputs[0]
    if c.logprobs is None:
        return None
    content = []
    for token_id, lps in zip(c.token_ids[start:end], c.logprobs[start:end]):
        text = state.token_text(token_id)
        ranked = sorted(lps.items(), key=lambda kv: -kv[1])[:top]
        content.append({
            "token": text, "logprob": lps[token_id], "bytes": list(text.encode()),
            "top_logprobs": [{"token": state.token_text(t), "logprob": lp,
                              "bytes": list(state.token_text(t).encode())} for t, lp in ranked],
        })
    return {"content": content}


def _completion_logprobs(
    state: _State, out: RequestOutput, start: int, end: int, top: int, offset: int,
) -> dict[str, Any] | None:
    c = out.outputs[0]
    if c.logprobs is None:
        return None
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for token_id, lps in zip(c.token_ids[start:end], c.logprobs[start:end]):
        text = state.token_text(token_id)
        tokens.append(text)
        token_logprobs.append(lps[token_id])
        tops.append({state.token_text(t): lp for t, lp in sorted(lps.items(), key=lambda kv: -kv[1])[:top]})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


# ---- HTTP plumbing ----

async def _read_json(request: Request, limit: int) -> Any:
    """The body as JSON, refusing bodies over ``limit`` bytes before parsing anything."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise APIError(400, "the Content-Length header is not a number") from None
        if size > limit:
            if size <= DRAIN_BYTES:
                async for _ in request.stream():
                    pass
            raise APIError(413, f"the request body is {size} bytes; the limit is {limit}", code="request_too_large")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            if size <= DRAIN_BYTES:
                async for more in request.stream():
                    size += len(more)
                    if size > DRAIN_BYTES:
                        break
            raise APIError(413, f"the request body is over the limit of {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise APIError(400, "the request body is empty; send a JSON object")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:  # ValueError covers bad JSON and bad UTF-8
        raise APIError(400, f"the request body is not valid JSON: {e}") from None


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(receive: Receive, work: Awaitable[Any], timeout: float | None = None) -> Any:
    """Runs ``work`` and returns its result; cancels it (aborting its requests) and raises
    ``_ClientGone`` if the client hangs up first, ``asyncio.TimeoutError`` after ``timeout`` s."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task in done:
        return task.result()
    if watcher in done:
        raise _ClientGone()
    raise asyncio.TimeoutError()


def _sse(data: Any) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


class _EventStream:
    """A text/event-stream response that notices a client going away.

    The ASGI server reports a hang-up as ``http.disconnect`` on ``receive``; one task watches
    for it while another streams, and the watcher cancels the streamer, which closes the event
    generator and so aborts the engine requests behind it. This does not depend on the server
    raising on ``send`` to a closed socket, which uvicorn does not do."""

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        self.events = events
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def stream() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no"),
            ]})
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        streamer = asyncio.ensure_future(stream())
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({streamer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (streamer, watcher):
                if not t.done():
                    t.cancel()
            await asyncio.gather(streamer, watcher, return_exceptions=True)
            await self.events.aclose()  # type: ignore[attr-defined]
            self.on_close()


class _InternalErrors:
    """A bug of ours answers 500 in the API's shape, its traceback on the server's stderr, and
    keeps the connection. (Starlette's handler for Exception re-raises after answering, and
    uvicorn then closes the socket: the client's next request on it would fail too.)"""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched_send)
        except Exception as e:
            if started:  # mid-body nothing valid can follow: let the server close the connection
                raise
            traceback.print_exc()
            error = APIError(500, f"internal error: {type(e).__name__}", type_="server_error")
            await JSONResponse(error.body(), status_code=500)(scope, receive, send)


class _BearerAuth:
    """Requires ``Authorization: Bearer <key>`` on every route but the open ones."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            header = b""
            for name, value in scope["headers"]:
                if name == b"authorization":
                    header = value
            scheme, _, token = header.partition(b" ")
            # compare_digest: the time taken must not reveal how much of a guess was right
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                error = APIError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                                 code="invalid_api_key")
                response = JSONResponse(error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


# ---- routes ----

def create_app(
    engine: AsyncEngine, *, model_name: str | None = None, api_key: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES, max_waiting: int | None = None, request_timeout: float | None = None,
    allow: AllowLists | None = None,
) -> Starlette:
    """The ASGI app. ``engine`` must be running (its thread started); the app never stops it.
    ``max_waiting`` and ``request_timeout`` (seconds) are off when None. ``allow`` names the
    hosts and web origins answered besides loopback ones (default: none, see ``BrowserGuard``)."""
    if api_key is not None and not api_key:
        raise LocalLLMError("the API key is empty; pass a key, or None to serve without one")
    state = _make_state(engine, model_name)
    state.limits = _Limits(max_waiting, request_timeout)
    engine.engine.guided.warm()  # now, while no stream runs: it holds the GIL for about a second

    async def health(request: Request) -> Response:
        # optimizing: the decode step is still being compiled in the background (the eager path
        # serves meanwhile); benchmarks wait for false
        return JSONResponse({"status": "ok", "model": state.model, "optimizing": engine.stats().compiling})

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": state.model, "object": "model", "created": state.created, "owned_by": "localllm",
            "max_model_len": state.context_limit, "sampling_defaults": state.sampling_defaults,
        }]})

    async def metrics(request: Request) -> Response:
        # Prometheus text, so that bench and scrapers read KV use the way they read vLLM's
        s = engine.stats()
        rows = [
            ("num_requests_running", "gauge", s.num_running), ("num_requests_waiting", "gauge", s.num_waiting),
            ("batch_size", "gauge", s.batch_size), ("max_batch_size_seen", "gauge", s.max_batch_size_seen),
            ("kv_cache_usage_perc", "gauge", round(s.kv_usage, 6)), ("kv_blocks_total", "gauge", s.kv_blocks_total),
            ("kv_blocks_used", "gauge", s.kv_blocks_used), ("kv_blocks_cached", "gauge", s.kv_blocks_cached),
            ("generation_tokens_per_s", "gauge", round(s.generation_tokens_per_s, 3)),
            ("num_preemptions_total", "counter", s.num_preemptions),
            ("prefix_cache_hit_tokens_total", "counter", s.prefix_cache_hit_tokens),
            ("prompt_tokens_total", "counter", s.prompt_tokens),
            # the load limits (+Inf: off) and what they did
            ("server_requests_waiting", "gauge", state.num_waiting),
            ("max_waiting", "gauge", _limit(state.limits.max_waiting)),
            ("request_timeout_seconds", "gauge", _limit(state.limits.request_timeout)),
            ("requests_rejected_total", "counter", state.num_rejected),
            ("requests_timed_out_total", "counter", state.num_timed_out),
        ]
        text = "".join(f"# TYPE localllm:{n} {t}\nlocalllm:{n}{{model_name=\"{state.model}\"}} {v}\n"
                       for n, t, v in rows)
        return Response(text, media_type="text/plain; version=0.0.4")

    async def chat_completions(request: Request) -> Response:
        req, ids, calling, grammar_param = await _chat_inputs(state, await _read_json(request, max_body_bytes))
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        jobs = _jobs(state, req, [ids], "messages", rid)
        await _compile_grammar(state, jobs, grammar_param)
        admission = _Admission(state, len(jobs))
        if req.stream:
            return _EventStream(_chat_stream(state, req, [ids], jobs, rid, admission, calling),  # type: ignore[return-value]
                                admission.release)
        finals = await _finals(request, state, jobs, admission)
        choices = []
        for k, out in enumerate(finals):
            assert out is not None
            c = out.outputs[0]
            message, finish_reason = assistant_message(calling, c.text, c.finish_reason)
            choices.append({
                "index": k, "message": message,
                "logprobs": _chat_logprobs(state, out, 0, len(c.token_ids), req.top_logprobs) if req.logprobs else None,
                "finish_reason": finish_reason, "stop_reason": c.stop_reason,
            })
        return JSONResponse({"id": rid, "object": "chat.completion", "created": int(time.time()),
                             "model": state.model, "choices": choices, "usage": _usage([ids], req.n, finals)})

    async def completions(request: Request) -> Response:
        body = await _read_json(request, max_body_bytes)
        req = parse_completion(body, state.sampling_defaults)
        guided = parse_guided(body)
        req.sampling.update(guided.sampling)
        prompts = [await _prompt_ids(state, p) for p in req.prompts]
        rid = f"cmpl-{uuid.uuid4().hex}"
        jobs = _jobs(state, req, prompts, "prompt", rid)
        await _compile_grammar(state, jobs, guided.param)
        admission = _Admission(state, len(jobs))
        if req.stream:
            return _EventStream(_completion_stream(state, req, prompts, jobs, rid, admission),  # type: ignore[return-value]
                                admission.release)
        finals = await _finals(request, state, jobs, admission)
        choices = []
        for k, out in enumerate(finals):
            assert out is not None
            c = out.outputs[0]
            lp = None if req.logprobs is None else _completion_logprobs(state, out, 0, len(c.token_ids),
                                                                          req.logprobs, 0)
            choices.append({"index": k, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason,
                            "stop_reason": c.stop_reason})
        return JSONResponse({"id": rid, "object": "text_completion", "created": int(time.time()),
                             "model": state.model, "choices": choices, "usage": _usage(prompts, req.n, finals)})

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return JSONResponse(APIError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code)

    # the guard before the key check: a preflight carries no key, and a refused page learns nothing
    middleware = [Middleware(_InternalErrors), Middleware(BrowserGuard, lists=allow or AllowLists())]
    if api_key:
        middleware.append(Middleware(_BearerAuth, api_key=api_key))
    return Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
        ],
        middleware=middleware,
        exception_handlers={APIError: api_error, HTTPException: http_error},
    )


async def _finals(
    request: Request, state: _State, jobs: list[Job], admission: _Admission,
) -> list[RequestOutput | None]:
    finals: list[RequestOutput | None] = [None] * len(jobs)

    async def run() -> None:
        stream = _fan_in(state.engine, jobs)
        try:
            async for k, out in stream:
                admission.started(k)
                if out.finished:
                    finals[k] = out
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    try:
        await _unless_disconnected(request.receive, run(), admission.remaining())
    except _ClientGone:
        raise APIError(499, "client closed the request") from None
    except asyncio.TimeoutError:
        raise admission.timed_out() from None
    except APIError:
        raise
    except Exception as e:  # noqa: BLE001 - an engine failure becomes an HTTP error, not a 500 page
        raise _engine_error(e) from None
    finally:
        admission.release()
    return finals


async def _sse_stream(
    state: _State, include_usage: bool, n: int, prompts: list[list[int]], jobs: list[Job], base: dict[str, Any],
    choice_fields: Callable[[int, RequestOutput, int, int], dict[str, Any] | None], admission: _Admission,
    first: Iterable[dict[str, Any]] = (),
) -> AsyncIterator[bytes]:
    """The SSE body of both endpoints: the ``first`` choices, then one chunk per text delta of
    job k with ``choice_fields(k, out, first_token, end_token)`` (the tokens it covers; None
    holds the delta back, a "finish_reason" there overrides the engine's) and one when a job
    finishes, then usage when asked, then [DONE]. An engine error or the request timeout
    after the headers are out is reported in-band, as vLLM does."""
    extra = {"usage": None} if include_usage else {}
    for choice in first:
        yield _sse({**base, "choices": [choice], **extra})
    sent_tokens = [0] * len(jobs)
    finals: list[RequestOutput | None] = [None] * len(jobs)
    stream = _fan_in(state.engine, jobs)
    try:
        while True:
            try:
                k, out = await asyncio.wait_for(stream.__anext__(), admission.remaining())
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:  # wait_for cancelled the stream, which aborted its requests
                yield _sse(admission.timed_out().body())
                break
            admission.started(k)
            c = out.outputs[0]
            if out.finished:
                finals[k] = out
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
            yield _sse({**base, "choices": [choice], **extra})
        if include_usage:
            yield _sse({**base, "choices": [], "usage": _usage(prompts, n, finals)})
    except Exception as e:  # noqa: BLE001 - headers are sent: report it in-band
        yield _sse(_engine_error(e).body())
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
        admission.release()
    yield b"data: [DONE]\n\n"


def _chat_stream(
    state: _State, req: ChatRequest, prompts: list[list[int]], jobs: list[Job], rid: str, admission: _Admission,
    calling: ToolCalling | None = None,
) -> AsyncIterator[bytes]:
    base = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": state.model}
    parsers = [calling.parser() for _ in jobs] if calling is not None else None

    def fields(k: int, out: RequestOutput, start: int, end: int) -> dict[str, Any] | None:
        text = out.outputs[0].delta_text
        if parsers is not None:
            return _tool_fields(parsers[k], out, text)
        return {"delta": {"content": text} if text else {},
                "logprobs": _chat_logprobs(state, out, start, end, req.top_logprobs) if req.logprobs else None}

    roles = [{"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
             for k in range(len(jobs))]
    return _sse_stream(state, req.include_usage, req.n, prompts, jobs, base, fields, admission, roles)


def _tool_fields(parser: ToolCallParser, out: RequestOutput, text: str) -> dict[str, Any] | None:
    """A chat chunk's fields with the reply read for tool calls; None while text is held."""
    delta = parser.read(text, out.finished)
    if not out.finished and not delta.content and not delta.calls:
        return None
    fields: dict[str, Any] = {"delta": delta.to_openai(), "logprobs": None}
    if out.finished and parser.calls and out.outputs[0].finish_reason == "stop":
        fields["finish_reason"] = "tool_calls"
    return fields


def _completion_stream(
    state: _State, req: CompletionRequest, prompts: list[list[int]], jobs: list[Job], rid: str, admission: _Admission,
) -> AsyncIterator[bytes]:
    base = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": state.model}
    sent_chars = [0] * len(jobs)  # text offsets of the logprobs, per job

    def fields(k: int, out: RequestOutput, start: int, end: int) -> dict[str, Any]:
        text = out.outputs[0].delta_text
        lp = None if req.logprobs is None else _completion_logprobs(
            state, out, start, end, req.logprobs, sent_chars[k])
        sent_chars[k] += len(text)
        return {"text": text, "logprobs": lp}

    return _sse_stream(state, req.include_usage, req.n, prompts, jobs, base, fields, admission)


# ---- running it ----

def _uvicorn(app: ASGIApp) -> uvicorn.Server:
    config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=5)
    return uvicorn.Server(config)


@dataclass(slots=True)
class RunningServer:
    """A server on a background thread (tests, bench self-checks). ``url`` has no /v1."""

    url: str
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


def start_server_thread(app: ASGIApp, host: str = "127.0.0.1", port: int = 0) -> RunningServer:
    sock = bind_socket(host, port)
    server = _uvicorn(app)
    # uvicorn installs signal handlers only on the main thread, so this one leaves them alone
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), name="localllm-http",
                              daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the HTTP server did not start")
        time.sleep(0.01)
    return RunningServer(socket_url(sock), server, thread)


def serve_command(args: argparse.Namespace, sock: socket.socket) -> int:
    """Loads the model and serves on ``sock`` (bound already, see ``localllm.server.cli``)."""
    from localllm.cli_common import engine_config_from_args, progress_printer
    from localllm.engine.engine import LLMEngine

    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(f"localllm: warning: serving on {args.host} without --api-key: anyone who can reach this "
              "port can use the model", file=sys.stderr)
    overrides: dict[str, Any] = {"chats": args.chats}
    if args.max_num_seqs:
        overrides["max_num_seqs"] = args.max_num_seqs
    config = engine_config_from_args(args, **overrides)
    engine = AsyncEngine(lambda: LLMEngine(config, progress=progress_printer()))  # built on its own thread
    if engine.tokenizer.template_note:
        print(f"localllm: note: {engine.tokenizer.template_note}", file=sys.stderr)
    try:
        server = _uvicorn(create_app(
            engine, model_name=args.served_model_name, api_key=args.api_key,
            max_waiting=args.max_waiting or None, request_timeout=args.request_timeout or None,
            allow=args.allow_lists,
        ))

        async def announce() -> None:
            while not server.started:
                if server.should_exit:
                    return
                await asyncio.sleep(0.02)
            auth = ", API key required" if args.api_key else ""
            print(f"localllm: serving {args.served_model_name or engine.engine.model_name} at {socket_url(sock)}/v1 "
                  f"(OpenAI-compatible{auth}; Ctrl+C stops)", flush=True)

        async def main() -> None:
            task = asyncio.create_task(announce())
            await server.serve(sockets=[sock])
            task.cancel()

        asyncio.run(main())
    finally:
        engine.shutdown()
        sock.close()
    return 0
