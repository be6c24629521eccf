"""``localllm serve``: its arguments, and the bind that must happen before torch loads."""

from __future__ import annotations

import argparse
import os
import socket
from typing import Any

from localllm.errors import LocalLLMError


def register(sub: Any) -> None:
    from localllm.cli import _add_engine_args, _add_model_arg

    p: argparse.ArgumentParser = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions) on the local engine",
        description="Serve the OpenAI API on the local engine: every client is batched into the same engine. "
                    "Sampling fields a request leaves out come from the model's defaults (GET /v1/models lists "
                    "them), then OpenAI's.",
    )
    _add_model_arg(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 exposes it)")
    p.add_argument("--port", type=int, default=8000, help="default 8000; 0 picks a free port")
    p.add_argument("--api-key", default=os.environ.get("LOCALLLM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route but /health "
                        "(default: $LOCALLLM_API_KEY)")
    p.add_argument("--served-model-name", default=None, help="the model id clients see (default: the model's name)")
    p.add_argument("--chats", type=int, default=4,
                   help="concurrent long chats to size the KV cache for (default 4; short requests share it)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="most sequences per step (default: the plan's)")
    _add_engine_args(p)
    p.set_defaults(func=serve)


def serve(args: argparse.Namespace) -> int:
    # Bind before importing torch and loading the model: a busy port fails in a second.
    sock = bind_socket(args.host, args.port)
    from localllm.server.app import serve_command

    return serve_command(args, sock)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready socket; a bad or busy address is a one-line error."""
    if not 0 <= port <= 65535:
        raise LocalLLMError(f"--port {port}: must be in 0..65535")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        raise LocalLLMError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock
