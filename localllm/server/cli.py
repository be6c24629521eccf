"""``localllm serve``: its arguments, and the bind that must happen before torch loads."""

from __future__ import annotations

import argparse
import os
import sys

from localllm.cli_common import add_engine_args, add_model_arg
from localllm.errors import LocalLLMError
from localllm.reasoning import AUTO, NONE, PARSER_NAMES
from localllm.server.allow_lists import HOSTS_ENV, ORIGINS_ENV, allow_lists
from localllm.server.sockets import bind_socket

DEFAULT_MAX_WAITING = 256
DEFAULT_REQUEST_TIMEOUT_S = 600.0
MIN_API_KEY_LENGTH = 8


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions) on the local engine",
        description="Serve the OpenAI API on the local engine: every client is batched into the same engine. "
                    "Sampling fields a request leaves out come from the model's defaults (GET /v1/models lists "
                    "them), then OpenAI's.",
    )
    add_model_arg(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 exposes it)")
    p.add_argument("--port", type=int, default=8000, help="default 8000; 0 picks a free port")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health "
                        "(default: $LOCALLLM_API_KEY)")
    p.add_argument("--allowed-hosts", default=None, metavar="HOSTS",
                   help="comma-separated host names the server answers to besides loopback ones and the --host "
                        "address (requests naming another host get 403, against DNS rebinding), e.g. myhost.lan; "
                        f"'*' for any (default: ${HOSTS_ENV})")
    p.add_argument("--allowed-origins", default=None, metavar="ORIGINS",
                   help="comma-separated origins (scheme://host[:port]) of web UIs allowed to call the API from a "
                        "browser, e.g. http://localhost:3000; they get CORS headers, any other page gets 403; "
                        f"'*' for any (default: ${ORIGINS_ENV}, else none)")
    p.add_argument("--served-model-name", default=None, help="the model id clients see (default: the model's name)")
    p.add_argument("--chats", type=int, default=4,
                   help="concurrent long chats to size the KV cache for (default 4; short requests share it)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="most sequences per step (default: the plan's)")
    p.add_argument("--max-waiting", type=int, default=DEFAULT_MAX_WAITING, metavar="N",
                   help="most requests waiting for their first token; beyond it a request gets 503 with "
                        f"Retry-After (default {DEFAULT_MAX_WAITING}; 0: no limit)")
    p.add_argument("--request-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT_S, metavar="S",
                   help="stop a request S seconds after it arrives and answer 504, or an error event when "
                        f"streaming (default {DEFAULT_REQUEST_TIMEOUT_S:g}; 0: no limit)")
    p.add_argument("--reasoning-parser", default=None, choices=(AUTO, *PARSER_NAMES, NONE),
                   help="how replies mark their reasoning, sent as 'reasoning_content' apart from 'content' "
                        "(vLLM's names; default: from the model's chat template: <think> blocks as qwen3, "
                        "harmony channels as openai_gptoss; 'none' leaves replies whole)")
    add_engine_args(p)
    p.set_defaults(func=serve)


def serve(args: argparse.Namespace) -> int:
    args.api_key = api_key_from(args.api_key)
    if args.max_waiting < 0:
        raise LocalLLMError(f"--max-waiting {args.max_waiting}: must be a number of requests, or 0 for no limit")
    if not args.request_timeout >= 0 or args.request_timeout == float("inf"):  # NaN fails the first test
        raise LocalLLMError(f"--request-timeout {args.request_timeout}: must be seconds, or 0 for no limit")
    args.allow_lists = allow_lists(args.host, args.allowed_hosts, args.allowed_origins)
    # Bind before importing torch and loading the model: a busy port fails in a second.
    sock = bind_socket(args.host, args.port)
    from localllm.server.serving import serve_command

    return serve_command(args, sock)


def api_key_from(flag: str | None) -> str | None:
    """The key from --api-key, else $LOCALLLM_API_KEY, else None (no authentication). An empty
    key is an error, not "no key": a misquoted variable must not turn authentication off."""
    source, key = "--api-key", flag
    if key is None and "LOCALLLM_API_KEY" in os.environ:
        source, key = "LOCALLLM_API_KEY", os.environ["LOCALLLM_API_KEY"]
    if key is None:
        return None
    if not key.strip():
        raise LocalLLMError(f"{source} is empty; give a key (e.g. from `openssl rand -hex 16`), or leave it "
                            "out to serve without authentication")
    if not key.isascii() or not key.isprintable() or any(c.isspace() for c in key):
        raise LocalLLMError(f"{source} must be printable ASCII without spaces: it travels in an HTTP header")
    if len(key) < MIN_API_KEY_LENGTH:
        print(f"localllm: warning: {source} is {len(key)} characters long; a key under {MIN_API_KEY_LENGTH} is "
              "easy to guess", file=sys.stderr)
    return key

