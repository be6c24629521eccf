"""The HTTP plumbing under the routes, in plain ASGI: a size-limited JSON body, a client's
hang-up noticed while work runs, the SSE response, the API-key check and the 500 answer in the
API's shape.

Nothing here knows the engine: a hang-up cancels the caller's work, and cancelling is what
aborts the engine requests behind it.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from localllm.server.protocol import APIError

MAX_BODY_BYTES = 4 * 2**20
# A client whose body is over the limit is still read up to this much, so that it gets the
# 413 answer instead of a reset connection while it is still uploading.
DRAIN_BYTES = 64 * 2**20
OPEN_PATHS = frozenset({"/health"})


class ClientGone(Exception):
    pass


async def read_json(request: Request, limit: int) -> Any:
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


async def wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(receive: Receive, work: Awaitable[Any], timeout: float | None = None) -> Any:
    """Runs ``work`` and returns its result; cancels it (aborting its requests) and raises
    ``ClientGone`` if the client hangs up first, ``asyncio.TimeoutError`` after ``timeout`` s."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_disconnect(receive))
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
        raise ClientGone()
    raise asyncio.TimeoutError()


def sse(data: Any) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


class EventStream:
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
        watcher = asyncio.ensure_future(wait_disconnect(receive))
        try:
            await asyncio.wait({streamer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (streamer, watcher):
                if not t.done():
                    t.cancel()
            await asyncio.gather(streamer, watcher, return_exceptions=True)
            await self.events.aclose()  # type: ignore[attr-defined]
            self.on_close()


class InternalErrors:
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


class BearerAuth:
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
