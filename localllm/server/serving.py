"""Running the ASGI app: on a background thread (tests, bench self-checks) or as the
``localllm serve`` command, on a socket that ``localllm.server.cli`` has bound already.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import uvicorn
from starlette.types import ASGIApp

from localllm.engine.async_engine import AsyncEngine
from localllm.server.app import create_app
from localllm.server.sockets import bind_socket, socket_url


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
            allow=args.allow_lists, reasoning_parser=args.reasoning_parser,
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
