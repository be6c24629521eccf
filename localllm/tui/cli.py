"""``localllm chat``: parser registration (cheap) and the launcher (imports Textual, then the engine
in a thread once the UI is up, so the window appears at once)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from localllm.cli_common import add_engine_args, add_model_arg, engine_config_from_args
from localllm.reasoning import AUTO, NONE, PARSER_NAMES

if TYPE_CHECKING:
    from localllm.tui.backend import ChatEngine, EngineFactory, Progress


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "chat",
        help="chat in a terminal UI: tabs that generate at the same time",
        description="A Textual chat UI. Tabs stream together through one continuously batched engine.",
    )
    add_model_arg(p, help="catalog name, HF repo id, local HF folder or .gguf file (default: config, then the default)")
    p.add_argument("--chats", type=int, default=4, help="chats to plan the KV cache for (default 4)")
    p.add_argument("--endpoint", default=None, help="an OpenAI-compatible server URL instead of the local engine")
    p.add_argument("--api-key", default=None, help="bearer token for --endpoint")
    p.add_argument("--reasoning-parser", default=None, choices=(AUTO, *PARSER_NAMES, NONE),
                   help="how replies mark their reasoning, shown folded apart from the answer (vLLM's names; "
                        "default: from the model's chat template)")
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Exit code 2 when the model (or the server) never came up and the user quit: bad input,
    as everywhere else in the CLI; the reason is printed once the screen is restored."""
    from localllm.tui.app import ChatApp
    from localllm.tui.backend import load_config

    config = load_config()
    model = args.model or config.model
    factory = _remote_factory(args) if args.endpoint else _local_factory(args)
    app = ChatApp(engine_factory=factory, model=model, config=config, endpoint=args.endpoint,
                  offer_pull=not args.endpoint and model is None)
    app.run()
    if app.return_code == 2 and app.load_failure:
        print(f"localllm: error: {app.load_failure}", file=sys.stderr)
    return app.return_code or 0


def _local_factory(args: argparse.Namespace) -> EngineFactory:
    def build(model: str | None, progress: Progress | None) -> ChatEngine:
        from localllm.engine.async_engine import AsyncEngine
        from localllm.engine.engine import LLMEngine
        from localllm.tui.backend import LocalChatEngine

        config = engine_config_from_args(args, model=model, chats=max(1, args.chats))
        return LocalChatEngine(AsyncEngine(lambda: LLMEngine(config, progress=progress)),  # built on its thread
                               reasoning_parser=args.reasoning_parser)

    return build


def _remote_factory(args: argparse.Namespace) -> EngineFactory:
    def build(model: str | None, progress: Progress | None) -> ChatEngine:
        from localllm.server.remote import RemoteEngine

        if progress is not None:
            progress(f"connecting to {args.endpoint}", 0, 0)
        return RemoteEngine(args.endpoint, api_key=args.api_key, model=model)

    return build
