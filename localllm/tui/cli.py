"""``localllm chat``: parser registration (cheap) and the launcher (imports Textual, then the engine
in a thread once the UI is up, so the window appears at once)."""

from __future__ import annotations

import argparse
from typing import Any

from localllm.errors import LocalLLMError


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from localllm.cli import _add_kv_cache_args

    p = sub.add_parser(
        "chat",
        help="chat in a terminal UI: tabs that generate at the same time",
        description="A Textual chat UI. Tabs stream together through one continuously batched engine.",
    )
    p.add_argument("--model", "-m", default=None,
                   help="catalog name, HF repo id, local HF folder or .gguf file (default: config, then the default)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    p.add_argument("--quant", default=None, help="online weight quantization: int8, fp8, awq, rtn4 (default: the plan's)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: the best available)")
    p.add_argument("--max-model-len", type=int, default=None, help="context limit per sequence")
    _add_kv_cache_args(p)
    p.add_argument("--chats", type=int, default=4, help="chats to plan the KV cache for (default 4)")
    p.add_argument("--endpoint", default=None, help="an OpenAI-compatible server URL instead of the local engine")
    p.add_argument("--api-key", default=None, help="bearer token for --endpoint")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from localllm.tui.app import ChatApp
    from localllm.tui.backend import load_config

    config = load_config()
    model = args.model or config.model
    factory = _remote_factory(args) if args.endpoint else _local_factory(args)
    app = ChatApp(engine_factory=factory, model=model, config=config,
                  offer_pull=not args.endpoint and model is None, probe=not args.endpoint)
    app.run()
    return 0


def _local_factory(args: argparse.Namespace) -> Any:
    def build(model: str | None, progress: Any) -> Any:
        from localllm.engine.async_engine import AsyncEngine
        from localllm.engine.engine import EngineConfig, LLMEngine

        config = EngineConfig(model=model, dtype=args.dtype, quant=args.quant, device=args.device,
                              max_model_len=args.max_model_len, chats=max(1, args.chats),
                              kv_cache_dtype=args.kv_cache_dtype, calculate_kv_scales=args.calculate_kv_scales)
        return AsyncEngine(LLMEngine(config, progress=progress))

    return build


def _remote_factory(args: argparse.Namespace) -> Any:
    try:
        from localllm.server.remote import RemoteEngine
    except ImportError as e:
        raise LocalLLMError(f"--endpoint needs localllm.server.remote, which this install lacks ({e})") from None

    def build(model: str | None, progress: Any) -> Any:
        if progress is not None:
            progress(f"connecting to {args.endpoint}", 0, 0)
        return RemoteEngine(args.endpoint, api_key=args.api_key, model=model)

    return build
