"""What the subcommands share, importable without torch: the model, sampling and engine
argument groups, their conversion to ``EngineConfig`` and ``SamplingParams`` (the model's
sampling defaults under the flags given, a ``--json-schema`` file), and the loading progress
bar. The engine types are imported only when a conversion runs."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from localllm.errors import LocalLLMError

if TYPE_CHECKING:
    from localllm.engine.engine import EngineConfig
    from localllm.engine.spec_decode import SpeculativeConfig
    from localllm.engine.sequence import SamplingParams

# (stage, done, total) from a loading thread; total == 0 means "size unknown"
Progress = Callable[[str, int, int], None]

MODEL_HELP = "catalog name, HF repo id, local HF folder or .gguf file (default: the embedded default)"
# --draft-model's proposals a step when --speculative-config does not say (vLLM's examples use 2-5)
DRAFT_TOKENS = 4
QUANT_METHODS = "{quant methods}"  # filled in from localllm.quant.methods.METHODS when help is shown


def positive_int(text: str) -> int:
    """An argparse ``type``: a whole number of at least 1, else one line naming what was given."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be at least 1")
    return n


def add_model_arg(p: argparse.ArgumentParser, help: str = MODEL_HELP) -> None:  # noqa: A002 - argparse's name
    p.add_argument("--model", "-m", default=None, help=help)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    # None = not given: the model's own default applies (see LLMEngine.sampling_defaults)
    p.add_argument("--temperature", type=float, default=None,
                   help="0 = greedy (default: the model's, else 0.7; 0 with --raw)")
    p.add_argument("--top-p", type=float, default=None,
                   help="sample from the smallest set of tokens whose probability reaches P (default: the model's, "
                        "else 1 = off)")
    p.add_argument("--top-k", type=int, default=None,
                   help="sample from the K most likely tokens (default: the model's, else -1 = off)")
    p.add_argument("--min-p", type=float, default=None,
                   help="drop tokens less likely than P x the top token (default: the model's, else 0 = off)")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help="> 1 discourages repeating earlier tokens (default: the model's, else 1 = off)")
    p.add_argument("--max-tokens", type=int, default=512, help="most tokens to generate (default 512)")
    p.add_argument("--seed", type=int, default=None, help="seed for sampling: the same seed, the same reply")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="float dtype of weights and compute (auto: the plan's, see `localllm probe`)")
    p.add_argument("--quant", default=None,
                   help=f"online weight quantization: none, {QUANT_METHODS} (default: the plan's)")
    p.add_argument("--max-model-len", type=int, default=None, help="context limit per sequence")
    p.add_argument("--device", default=None, help="cpu or cuda (default: the best available)")
    p.add_argument("--no-compile", action="store_true",
                   help="CPU: run the decode step eagerly instead of through torch.compile (also LOCALLLM_NO_COMPILE=1)")
    p.add_argument("--deterministic", action="store_true",
                   help="the same greedy tokens for a prompt alone or in any batch (every CPU plan: GGUF, fp32, bf16):"
                        " fixed-order kernels and an eager decode step, at some speed (docs/serve.md)")
    add_kv_cache_args(p)
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 5,'
                        ' "prompt_lookup_max": 4} (proposals looked up in the prompt and reply; off in batches above'
                        ' disable_by_batch_size, default 4)')
    p.add_argument("--speculative-ngram", type=int, default=None, metavar="K",
                   help="shorthand for --speculative-config with the n-gram method proposing up to K tokens a step")
    p.add_argument("--draft-model", default=None, metavar="PATH|ID",
                   help="speculative decoding with this small model of the same tokenizer proposing tokens"
                        f" (up to {DRAFT_TOKENS} a step; with --speculative-config, its num_speculative_tokens)")


def add_kv_cache_args(p: argparse.ArgumentParser) -> None:
    from localllm.hardware.sizing import KV_CACHE_DTYPES  # no torch

    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="KV cache storage: auto (the plan's: 16-bit, fp8 on sm89+ GPUs only where 16-bit does not"
                        " fit; fp32 on CPU) or fp8 (e4m3, half a 16-bit cache)")
    p.add_argument("--calculate-kv-scales", action="store_true",
                   help="fp8 KV cache: per-layer scales from a calibration prompt at start-up instead of 1.0")


def engine_config_from_args(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """The ``add_model_arg`` and ``add_engine_args`` values; ``overrides`` are further
    ``EngineConfig`` fields (and may replace those)."""
    from localllm.engine.engine import EngineConfig

    fields: dict[str, Any] = dict(
        model=args.model, dtype=args.dtype, device=args.device, quant=args.quant, max_model_len=args.max_model_len,
        compile=not args.no_compile, kv_cache_dtype=args.kv_cache_dtype, calculate_kv_scales=args.calculate_kv_scales,
        deterministic=args.deterministic, speculative_config=speculative_from_args(args),
    )
    return EngineConfig(**{**fields, **overrides})


def speculative_from_args(args: argparse.Namespace) -> SpeculativeConfig | None:
    """``--speculative-config`` or ``--speculative-ngram``; raises ``LocalLLMError`` (exit 2)
    naming what is wrong."""
    from localllm.engine.spec_decode import SpeculativeConfig, speculative_config  # no torch

    given, k = getattr(args, "speculative_config", None), getattr(args, "speculative_ngram", None)
    draft = getattr(args, "draft_model", None)
    if given is not None and k is not None:
        raise LocalLLMError("--speculative-config and --speculative-ngram exclude each other; give one")
    if draft is not None and k is not None:
        raise LocalLLMError("--draft-model and --speculative-ngram exclude each other; give one")
    if k is not None:
        return SpeculativeConfig(num_speculative_tokens=k)
    config = speculative_config(given)
    if draft is None:
        return config
    if config is None:
        return SpeculativeConfig(method="draft_model", model=draft, num_speculative_tokens=DRAFT_TOKENS)
    if config.method != "draft_model" and isinstance(given, str) and "method" in json.loads(given):
        raise LocalLLMError(f"--draft-model and --speculative-config's method {config.method!r} exclude each other")
    fields = {f: getattr(config, f) for f in SpeculativeConfig.__dataclass_fields__}
    return SpeculativeConfig(**{**fields, "method": "draft_model", "model": draft})


def given_sampling(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling flags the user gave (SAMPLING_KEYS; a flag left out is None)."""
    from localllm.catalog import SAMPLING_KEYS

    return {k: v for k in SAMPLING_KEYS if (v := getattr(args, k)) is not None}


def check_sampling_args(args: argparse.Namespace) -> None:
    """Bad sampling flags (and a bad --json-schema file) fail at once, before a model loads."""
    from localllm.engine.sequence import SamplingParams

    SamplingParams(**given_sampling(args), max_tokens=args.max_tokens, seed=args.seed)
    if getattr(args, "json_schema", None):
        read_json_schema(args.json_schema)


def sampling_from_args(args: argparse.Namespace, model_defaults: Mapping[str, float | int]) -> SamplingParams:
    """The flags the user gave, over the model's defaults, over run's own: temperature 0.7 for
    a chat reply, 0 (greedy) for a --raw completion."""
    from localllm.engine.sequence import SamplingParams

    values = {"temperature": 0.0 if args.raw else 0.7, **model_defaults, **given_sampling(args)}
    schema_file = getattr(args, "json_schema", None)
    return SamplingParams(**values, max_tokens=args.max_tokens, seed=args.seed,
                          guided_json=read_json_schema(schema_file) if schema_file else None)


def read_json_schema(path: str) -> dict[str, Any]:
    """A JSON schema file for ``--json-schema``; whether it compiles is the grammar engine's
    to say, when the request is added."""
    try:
        schema = json.loads(Path(path).read_text())
    except OSError as e:
        raise LocalLLMError(f"--json-schema {path}: cannot be read ({e.strerror or e})") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise LocalLLMError(f"--json-schema {path}: not valid JSON ({e})") from None
    if not isinstance(schema, dict):
        raise LocalLLMError(f"--json-schema {path}: a JSON schema is an object, this file holds something else")
    return schema


def progress_printer() -> Progress:
    """Loading/quantizing progress on stderr: a bar on a terminal; elsewhere (a log, a service
    manager) one plain line when a stage starts and one when it ends. Work that goes on after
    the bar has gone (the decode step optimized in the background while the first answer
    streams) is told in plain lines on a terminal too: a bar would redraw over the answer."""
    import time

    from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TaskID, TextColumn

    bar = Bar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
              transient=True, disable=not sys.stderr.isatty())
    tasks: dict[str, TaskID] = {}
    started: dict[str, float] = {}  # plain lines: when each stage began (and that it was told)
    told_done: set[str] = set()

    def plain(stage: str, done: int, total: int) -> None:
        if stage not in started:
            started[stage] = time.monotonic()
            print(f"localllm: {stage}…", file=sys.stderr, flush=True)
        if total and done >= total and stage not in told_done:
            told_done.add(stage)
            print(f"localllm: {stage}: done in {time.monotonic() - started[stage]:.0f} s", file=sys.stderr, flush=True)

    def report(stage: str, done: int, total: int) -> None:
        if bar.disable or (stage not in tasks and bar.finished and tasks and not bar.live.is_started):
            plain(stage, done, total)
            return
        if not bar.live.is_started:
            bar.start()
        if stage not in tasks:
            tasks[stage] = bar.add_task(stage, total=total)
        bar.update(tasks[stage], completed=done, total=total)
        if done >= total and all(t.finished for t in bar.tasks):
            bar.stop()

    return report
