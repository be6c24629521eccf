"""``localllm serve``'s routes: an OpenAI-compatible HTTP API on one ``AsyncEngine``.

Every client's request goes into the same engine, so concurrent clients are continuously
batched together. Requests are validated in full before anything is generated (``protocol``,
``jobs``); once a stream has started, an engine error arrives as an SSE ``error`` event, as
vLLM sends it. A client that disconnects aborts its requests, which frees their KV blocks.

Where the rest lives: admission and fan-in in ``admission``, response bodies in
``openai_shapes``, SSE and final outputs in ``streams``, body/auth/SSE plumbing in ``asgi``,
running the app in ``serving``.
"""

from __future__ import annotations

import uuid

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from localllm.engine.async_engine import AsyncEngine
from localllm.errors import LocalLLMError
from localllm.server.admission import Admission, Limits, make_state
from localllm.server.allow_lists import AllowLists
from localllm.server.asgi import MAX_BODY_BYTES, BearerAuth, EventStream, InternalErrors, read_json
from localllm.server.browser_guard import BrowserGuard
from localllm.server.jobs import chat_inputs, compile_grammar, completion_inputs, make_jobs
from localllm.server.openai_shapes import chat_completion, text_completion
from localllm.server.protocol import APIError
from localllm.server.streams import chat_stream, completion_stream, finals


def _limit(value: float | None) -> float | str:
    return "+Inf" if value is None else value


def create_app(
    engine: AsyncEngine, *, model_name: str | None = None, api_key: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES, max_waiting: int | None = None, request_timeout: float | None = None,
    allow: AllowLists | None = None, reasoning_parser: str | None = None,
) -> Starlette:
    """The ASGI app. ``engine`` must be running (its thread started); the app never stops it.
    ``max_waiting`` and ``request_timeout`` (seconds) are off when None. ``allow`` names the
    hosts and web origins answered besides loopback ones (default: none, see ``BrowserGuard``).
    ``reasoning_parser`` (vLLM's names, or ``none``) overrides the reasoning format the model's
    chat template implies (see ``localllm.reasoning``)."""
    if api_key is not None and not api_key:
        raise LocalLLMError("the API key is empty; pass a key, or None to serve without one")
    state = make_state(engine, model_name, reasoning_parser)
    state.limits = Limits(max_waiting, request_timeout)
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
            # 1 while the compiled decode step is loaded or built (eager meanwhile): benchmarks of
            # the steady state wait for 0 (/health's "optimizing" covers the build only)
            ("decode_graphs_pending", "gauge", int(s.preparing)),
            # speculative decoding (vLLM's spec_decode counters; 0 when off)
            ("spec_decode_num_drafts_total", "counter", s.spec_num_drafts),
            ("spec_decode_num_draft_tokens_total", "counter", s.spec_num_draft_tokens),
            ("spec_decode_num_accepted_tokens_total", "counter", s.spec_num_accepted_tokens),
            ("spec_decode_acceptance_rate", "gauge", round(s.spec_acceptance_rate, 6)),
            ("spec_decode_mean_acceptance_length", "gauge", round(s.spec_mean_acceptance_length, 6)),
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
        req, ids, calling, grammar_param = await chat_inputs(state, await read_json(request, max_body_bytes))
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        jobs = make_jobs(state, req, [ids], "messages", rid)
        await compile_grammar(state, jobs, grammar_param)
        admission = Admission(state, len(jobs))
        if req.stream:
            return EventStream(chat_stream(state, req, [ids], jobs, rid, admission, calling),  # type: ignore[return-value]
                               admission.release)
        outs = await finals(request, state, jobs, admission)
        return JSONResponse(chat_completion(state, req, rid, [ids], outs, calling))

    async def completions(request: Request) -> Response:
        req, prompts, grammar_param = await completion_inputs(state, await read_json(request, max_body_bytes))
        rid = f"cmpl-{uuid.uuid4().hex}"
        jobs = make_jobs(state, req, prompts, "prompt", rid)
        await compile_grammar(state, jobs, grammar_param)
        admission = Admission(state, len(jobs))
        if req.stream:
            return EventStream(completion_stream(state, req, prompts, jobs, rid, admission),  # type: ignore[return-value]
                               admission.release)
        outs = await finals(request, state, jobs, admission)
        return JSONResponse(text_completion(state, req, rid, prompts, outs))

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return JSONResponse(APIError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code)

    # the guard before the key check: a preflight carries no key, and a refused page learns nothing
    middleware = [Middleware(InternalErrors), Middleware(BrowserGuard, lists=allow or AllowLists())]
    if api_key:
        middleware.append(Middleware(BearerAuth, api_key=api_key))
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
