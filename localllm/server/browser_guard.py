"""What a web page in the user's browser may do with the server: nothing, unless the user
allowed its origin. An ASGI layer in front of the routes (and of the API key check, so that a
preflight, which carries no key, is answered).

A page can reach a loopback server two ways, and both are refused here:
- DNS rebinding: the page's own name is made to resolve to 127.0.0.1, so its requests are
  same-origin for the browser, and readable; they carry that name in ``Host``. So ``Host``
  must be a loopback name, or one ``AllowLists`` holds (``--allowed-hosts``).
- Cross-site requests: the browser adds ``Origin``; a "simple" one (a POST with a
  ``text/plain`` body) is sent without a preflight, so it would run even though the page
  cannot read the answer. So an ``Origin`` must be on ``--allowed-origins`` (empty by
  default), a request that fetch metadata marks cross-site must carry an allowed one, and a
  body must be declared ``application/json``, which no simple request can declare.
Programs (the official clients, curl, httpx) send a loopback ``Host`` and no ``Origin``, so
they pass. An allowed origin gets CORS headers on every answer and its preflights answered.
"""

from __future__ import annotations

import re

from starlette.datastructures import Headers
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from localllm.server.allow_lists import HOSTS_ENV, ORIGINS_ENV, AllowLists, split_host
from localllm.server.protocol import APIError

BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
JSON_TYPE = "application/json"
PREFLIGHT_MAX_AGE_S = 600
# a preflight's Access-Control-Request-Headers is echoed back: only a list of header names
_HEADER_LIST = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+(?:\s*,\s*[A-Za-z0-9!#$%&'*+.^_`|~-]+)*")
_SHOWN_CHARS = 80  # of a refused header value, in the error message


def _shown(value: str) -> str:
    return value if len(value) <= _SHOWN_CHARS else value[:_SHOWN_CHARS] + "..."


def _cors(origin: str) -> dict[str, str]:
    """The headers on every answer to an allowed origin (its preflights get more)."""
    return {"Access-Control-Allow-Origin": origin, "Access-Control-Expose-Headers": "Retry-After", "Vary": "Origin"}


def _refuse(status: int, message: str, code: str) -> Response:
    return JSONResponse(APIError(status, message, code=code).body(), status_code=status)


class BrowserGuard:
    """Refuses (403) a foreign ``Host`` or ``Origin`` and a cross-site request without an
    allowed origin, answers an allowed origin's preflight (204), refuses (415) a body that is
    not declared JSON, and adds CORS headers to what the app answers an allowed origin."""

    def __init__(self, app: ASGIApp, lists: AllowLists) -> None:
        self.app = app
        self.lists = lists

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        origin = headers.get("origin")
        refusal = self._refusal(scope["method"], headers)
        if refusal is not None:
            if origin is not None and refusal.status_code == 415:  # past the origin check: let the page read why
                refusal.headers.update(_cors(origin))
            await refusal(scope, receive, send)
            return
        if origin is None:
            await self.app(scope, receive, send)
            return
        if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            await self._preflight(origin, headers)(scope, receive, send)
            return
        cors = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in _cors(origin).items()]

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *cors]}
            await send(message)

        await self.app(scope, receive, send_with_cors)

    def _refusal(self, method: str, headers: Headers) -> Response | None:
        host = headers.get("host")
        if not self.lists.host_allowed(host):
            name = _shown(split_host(host or "")[0])
            return _refuse(403, f"requests for the host '{_shown(host or '')}' are refused (only loopback names are "
                                f"answered, against DNS rebinding); to serve this name, start the server with "
                                f"--allowed-hosts {name} (or {HOSTS_ENV})", "host_not_allowed")
        origin = headers.get("origin")
        if origin is not None and not self.lists.origin_allowed(origin):
            return _refuse(403, f"requests from web pages at '{_shown(origin)}' are refused; to let a web UI there "
                                f"use this server, start it with --allowed-origins {_shown(origin)} "
                                f"(or {ORIGINS_ENV})", "origin_not_allowed")
        if origin is None and headers.get("sec-fetch-site") in ("cross-site", "same-site"):
            # a browser sent this for a page without saying whose (an <img>, a <form>): no one allowed it
            return _refuse(403, "cross-site requests from web pages are refused; a web UI must call the API "
                                "with fetch from an origin given to --allowed-origins", "origin_not_allowed")
        if method in BODY_METHODS:
            declared = headers.get("content-type")
            if declared is None or declared.partition(";")[0].strip().lower() != JSON_TYPE:
                got = "no Content-Type" if declared is None else f"Content-Type '{_shown(declared)}'"
                return _refuse(415, f"the request body must be JSON sent with 'Content-Type: {JSON_TYPE}' (this "
                                    f"request has {got}); with curl, add -H 'Content-Type: {JSON_TYPE}'",
                               "unsupported_media_type")
        return None

    def _preflight(self, origin: str, headers: Headers) -> Response:
        """The answer to an allowed origin's CORS preflight: the routes' methods, and the
        headers it asks for (the official JS client sends several of its own)."""
        allow = {
            **_cors(origin),
            "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
            "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S),
            "Vary": "Origin, Access-Control-Request-Method, Access-Control-Request-Headers",
        }
        requested = headers.get("access-control-request-headers", "").strip()
        allow["Access-Control-Allow-Headers"] = requested if _HEADER_LIST.fullmatch(requested) else \
            "Authorization, Content-Type"
        # Chrome's Private Network Access asks before a public page may call a loopback server
        if headers.get("access-control-request-private-network") == "true":
            allow["Access-Control-Allow-Private-Network"] = "true"
        return Response(status_code=204, headers=allow)
