"""Handlers of the core subcommands (run, pull, models). Kept out of cli.py so that parsing
arguments never imports torch."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping
from typing import Any


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _progress_printer() -> Any:
    """A loading/quantizing progress bar on stderr (only when stderr is a terminal)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   transient=True, disable=not sys.stderr.isatty())
    tasks: dict[str, Any] = {}

    def report(stage: str, done: int, total: int) -> None:
        if not bar.live.is_started and not bar.disable:
            bar.start()
        if stage not in tasks:
            tasks[stage] = bar.add_task(stage, total=total)
        bar.update(tasks[stage], completed=done, total=total)
        if done >= total and all(t.finished for t in bar.tasks):
            bar.stop()

    return report


def engine_config_from_args(args: argparse.Namespace, **overrides: Any) -> Any:
    from localllm.engine.engine import EngineConfig

    return EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, quant=args.quant,
        max_model_len=args.max_model_len, compile=not args.no_compile, kv_cache_dtype=args.kv_cache_dtype,
        calculate_kv_scales=args.calculate_kv_scales, **overrides,
    )


def _given_sampling(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling flags the user gave (SAMPLING_KEYS; a flag left out is None)."""
    from localllm.catalog import SAMPLING_KEYS

    return {k: v for k in SAMPLING_KEYS if (v := getattr(args, k)) is not None}


def sampling_from_args(args: argparse.Namespace, model_defaults: Mapping[str, float | int]) -> Any:
    """The flags the user gave, over the model's defaults, over run's own: temperature 0.7 for
    a chat reply, 0 (greedy) for a --raw completion."""
    from localllm.engine.sequence import SamplingParams

    values = {"temperature": 0.0 if args.raw else 0.7, **model_defaults, **_given_sampling(args)}
    schema_file = getattr(args, "json_schema", None)
    return SamplingParams(**values, max_tokens=args.max_tokens, seed=args.seed,
                          guided_json=read_json_schema(schema_file) if schema_file else None)


def read_json_schema(path: str) -> dict[str, Any]:
    """A JSON schema file for ``--json-schema``; whether it compiles is the grammar engine's
    to say, when the request is added."""
    from pathlib import Path

    from localllm.errors import LocalLLMError

    try:
        schema = json.loads(Path(path).read_text())
    except OSError as e:
        raise LocalLLMError(f"--json-schema {path}: cannot be read ({e.strerror or e})") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise LocalLLMError(f"--json-schema {path}: not valid JSON ({e})") from None
    if not isinstance(schema, dict):
        raise LocalLLMError(f"--json-schema {path}: a JSON schema is an object, this file holds something else")
    return schema


def run(args: argparse.Namespace) -> int:
    from localllm.engine.sequence import SamplingParams

    # Bad flags (and a bad --json-schema file) fail now, not after the model has loaded.
    SamplingParams(**_given_sampling(args), max_tokens=args.max_tokens, seed=args.seed)
    if getattr(args, "json_schema", None):
        read_json_schema(args.json_schema)
    if args.endpoint:
        from localllm.server.remote import run_remote

        return run_remote(args)
    from localllm.engine.engine import LLMEngine
    from localllm.hardware.probe import MemoryMeter

    # Library code is the process's baseline, not the model's: import it before measuring.
    import gguf, jinja2, safetensors, tokenizers  # noqa: E401, F401

    meter = MemoryMeter("cuda" if args.device != "cpu" and _cuda() else "cpu").start()

    t_load = time.monotonic()
    engine = LLMEngine(engine_config_from_args(args, chats=1), progress=_progress_printer())
    load_s = time.monotonic() - t_load
    params = sampling_from_args(args, engine.sampling_defaults)
    if args.raw:
        prompt: Any = args.prompt
    else:
        if engine.tokenizer.template_note:
            print(f"localllm: note: {engine.tokenizer.template_note}", file=sys.stderr)
        messages = [{"role": "system", "content": args.system}] if args.system else []
        prompt = [*messages, {"role": "user", "content": args.prompt}]
    stream = not args.json

    def on_output(out: Any) -> None:
        if stream and out.outputs[0].delta_text:
            sys.stdout.write(out.outputs[0].delta_text)
            sys.stdout.flush()

    result = engine.generate([prompt], params, on_output=on_output)[0]
    if stream:
        sys.stdout.write("\n")
        return 0
    m = result.metrics
    n_out = len(result.outputs[0].token_ids)
    prefill_s = (m.first_token_time or 0) - (m.first_scheduled_time or 0)
    decode_s = (m.last_token_time or 0) - (m.first_token_time or 0)
    plan = engine.plan
    report = {
        "model": engine.model_name,
        "precision": engine.precision,
        "device": str(engine.device),
        "kv_cache": {"dtype": str(engine.kv_cache_dtype).removeprefix("torch."), "scales": engine.kv_scales},
        "prompt_token_ids": result.prompt_token_ids,
        "output_token_ids": result.outputs[0].token_ids,
        "text": result.outputs[0].text,
        "finish_reason": result.outputs[0].finish_reason,
        "num_cached_tokens": result.num_cached_tokens,
        "sampling": {k: getattr(params, k) for k in ("temperature", "top_p", "top_k", "min_p",
                                                      "repetition_penalty", "max_tokens", "seed")},
        "sampling_defaults": engine.sampling_defaults,
        "timings": {
            "load_s": round(load_s, 3),
            "ttft_s": round(m.ttft or 0.0, 4),
            "prefill_tokens_per_s": round(len(result.prompt_token_ids) / prefill_s, 1) if prefill_s > 0 else None,
            "decode_tokens_per_s": round((n_out - 1) / decode_s, 1) if n_out > 1 and decode_s > 0 else None,
            "itl_mean_s": round(sum(m.inter_token_latencies) / len(m.inter_token_latencies), 5)
            if m.inter_token_latencies else None,
        },
        "memory": _memory_report(engine, meter),
        "plan": plan.to_dict() if hasattr(plan, "to_dict") else None,
        "engine": _stats_dict(engine.stats()),
    }
    print(json.dumps(report, indent=2))
    return 0


def _memory_report(engine: Any, meter: Any) -> dict[str, Any]:
    """Predicted (the plan) against actual: CUDA's allocator peak on GPU, RSS growth on CPU."""
    from localllm.hardware.planner import compare_memory

    check = compare_memory(engine.plan, meter.stop())
    return {**check.to_dict(), "measured_by": "torch.cuda.max_memory_allocated"
            if engine.device.type == "cuda" else "RSS growth"}


def _stats_dict(stats: Any) -> dict[str, Any]:
    from dataclasses import asdict

    d = asdict(stats)
    d["kv_usage"] = round(stats.kv_usage, 4)
    return d


def pull(args: argparse.Namespace) -> int:
    from localllm import store

    store.pull(args.model)
    return 0


def models(args: argparse.Namespace) -> int:
    from localllm import store
    from localllm.catalog import DEFAULT_MODEL, load_catalog

    catalog = load_catalog()
    local = {m.id: m for m in store.local_models()}
    rows = []
    for entry in catalog.values():
        pulled = local.pop(entry.id, None)
        rows.append({
            "id": entry.id, "hf_repo": entry.hf_repo, "architecture": entry.architecture,
            "params": entry.params, "supported": entry.supported, "default": entry.id == DEFAULT_MODEL,
            "local_path": str(pulled.path) if pulled else None,
            "size_bytes": pulled.size_bytes if pulled else None,
        })
    for m in local.values():
        rows.append({"id": m.id, "hf_repo": None, "architecture": None, "params": None, "supported": True,
                     "default": False, "local_path": str(m.path), "size_bytes": m.size_bytes})
    if args.json:
        print(json.dumps({"models": rows, "models_dir": str(store.models_dir())}, indent=2))
        return 0
    from rich.table import Table

    from localllm.console import stdout_console

    table = Table(title=f"models (store: {store.models_dir()})")
    for col in ("id", "params", "status", "path"):
        table.add_column(col)
    for r in rows:
        status = "local" if r["local_path"] else ("catalog" if r["supported"] else "catalog (unsupported)")
        params = f"{r['params'] / 1e9:.2f}B" if r["params"] else "?"
        table.add_row(r["id"] + (" (default)" if r["default"] else ""), params, status, r["local_path"] or "")
    stdout_console().print(table)
    return 0


