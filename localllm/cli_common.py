"""What the subcommands share, importable without torch: the model, sampling and engine
argument groups, their conversion to ``EngineConfig`` and ``SamplingParams``, and the
loading progress bar. The engine types are imported only when a conversion runs."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from localllm.engine.engine import EngineConfig
    from localllm.engine.sequence import SamplingParams

# (stage, done, total) from a loading thread; total == 0 means "size unknown"
Progress = Callable[[str, int, int], None]

MODEL_HELP = "catalog name, HF repo id, local HF folder or .gguf file (default: the embedded default)"


def add_model_arg(p: argparse.ArgumentParser, help: str = MODEL_HELP) -> None:  # noqa: A002 - argparse's name
    p.add_argument("--model", "-m", default=None, help=help)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (default 0.7 for chat, 0 for --raw)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--seed", type=int, default=None)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    p.add_argument("--quant", default=None, help="online weight quantization: int8, fp8, awq, rtn4 (default: the plan's)")
    p.add_argument("--max-model-len", type=int, default=None, help="context limit per sequence")
    p.add_argument("--device", default=None, help="cpu or cuda (default: the best available)")


def engine_config_from_args(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """The ``add_model_arg`` and ``add_engine_args`` values; ``overrides`` are further
    ``EngineConfig`` fields (and may replace those)."""
    from localllm.engine.engine import EngineConfig

    fields: dict[str, Any] = dict(model=args.model, dtype=args.dtype, device=args.device, quant=args.quant,
                                  max_model_len=args.max_model_len)
    return EngineConfig(**{**fields, **overrides})


def sampling_from_args(args: argparse.Namespace, default_temperature: float) -> SamplingParams:
    from localllm.engine.sequence import SamplingParams

    return SamplingParams(
        temperature=default_temperature if args.temperature is None else args.temperature,
        top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, max_tokens=args.max_tokens, seed=args.seed,
    )


def progress_printer() -> Progress:
    """A loading/quantizing progress bar on stderr (only when stderr is a terminal)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TaskID, TextColumn

    bar = Bar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
              transient=True, disable=not sys.stderr.isatty())
    tasks: dict[str, TaskID] = {}

    def report(stage: str, done: int, total: int) -> None:
        if not bar.live.is_started and not bar.disable:
            bar.start()
        if stage not in tasks:
            tasks[stage] = bar.add_task(stage, total=total)
        bar.update(tasks[stage], completed=done, total=total)
        if done >= total and all(t.finished for t in bar.tasks):
            bar.stop()

    return report
