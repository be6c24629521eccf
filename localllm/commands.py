"""Handlers of the core subcommands (run, pull, models). Kept out of cli.py so that parsing
arguments never imports torch."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from dataclasses import asdict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from localllm.cli_common import check_sampling_args, engine_config_from_args, progress_printer, sampling_from_args

if TYPE_CHECKING:
    from localllm.engine.async_engine import AsyncEngine
    from localllm.engine.engine import EngineStats, LLMEngine, Prompt, RequestOutput
    from localllm.engine.sequence import SamplingParams
    from localllm.hardware.probe import MemoryMeter
    from localllm.reasoning import HarmonyCall, ReasoningFormat, ReasoningParser
    from localllm.server.remote import RemoteEngine
    from localllm.tokenizer import Tokenizer


def run(args: argparse.Namespace) -> int:
    """One reply, streamed to stdout (or a JSON report), from the local engine or an
    ``--endpoint``: the same loop over the same engine interface either way. Sampling flags
    left out come from the engine's ``sampling_defaults`` (the model's, or what the server
    reports)."""
    check_sampling_args(args)  # bad flags fail now, not after the model has loaded
    if args.raw:
        prompt: Prompt = args.prompt
    else:
        system = [{"role": "system", "content": args.system}] if args.system else []
        prompt = [*system, {"role": "user", "content": args.prompt}]
    remote: RemoteEngine | None = None
    llm: LLMEngine | None = None
    started = time.monotonic()
    if args.endpoint:
        from localllm.server.remote import RemoteEngine

        remote = RemoteEngine(args.endpoint, api_key=args.api_key, model=args.model)
        engine: AsyncEngine | RemoteEngine = remote
    else:
        from localllm.engine.async_engine import AsyncEngine

        make, meter = _load(args)
        engine = AsyncEngine(make)  # built on the thread that steps it
        llm = engine.engine
        if not args.raw and llm.tokenizer.template_note:
            print(f"localllm: note: {llm.tokenizer.template_note}", file=sys.stderr)
    load_s = time.monotonic() - started
    split: ReplySplit | None = None
    if llm is not None and not args.raw:
        from localllm.reasoning import format_for

        fmt = format_for(llm.tokenizer, llm.runner.model.config.architecture)
        split = ReplySplit(fmt, llm.tokenizer) if fmt is not None else None
    try:
        params = sampling_from_args(args, engine.sampling_defaults)
        if split is not None:  # harmony's markers are special tokens: kept for the parser
            params.skip_special_tokens = split.format.skip_special_tokens
        result = asyncio.run(_reply(engine, prompt, params, echo=not args.json, split=split))
        if llm is not None:
            if args.json:  # the report holds memory against the plan: the whole KV pool, held by then
                llm.runner.kv_cache.wait_reserved()
                if not llm.runner.compiling:  # and the saved graphs (with Dynamo), loading after the first step
                    llm.runner.wait_compiled()
            meter.stop()
            _finish_optimizing(llm)
    finally:
        engine.shutdown()
    if not args.json:
        sys.stdout.write("\n")
        return 0
    report = _report(result, engine.stats(), params, engine.sampling_defaults, time.monotonic() - started)
    if split is not None:  # the answer as text, the reasoning beside it (the server's reasoning_content)
        report["text"], report["reasoning"] = "".join(split.content), "".join(split.reasoning)
        report["tool_calls"] = [{"recipient": c.recipient, "arguments": c.arguments} for c in split.calls()]
    if remote is not None:
        report["endpoint"] = remote.endpoint
    if llm is not None:
        report["timings"]["load_s"] = round(load_s, 3)
        report.update(_local_report(result, llm, meter))
    print(json.dumps(report, indent=2))
    return 0


def _finish_optimizing(llm: LLMEngine) -> None:
    """A first start optimizes the decode step in the background while it answers. A reply
    shorter than that would end the process first, and every later start would begin it
    again: wait for it, saying so (ctrl+c skips it; shutdown then ends its compilers). Graphs
    still loading from disk are not waited for: this process is done with them, and the next
    start loads them again (waiting was ~3.5 s of every short warm `run`)."""
    runner = llm.runner
    if runner.compiling:  # building the missing graphs, saved for the next start
        print("\nlocalllm: finishing the optimization for this CPU, for the next start (ctrl+c skips it)",
              file=sys.stderr, flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            runner.wait_compiled()


def _load(args: argparse.Namespace) -> tuple[Callable[[], LLMEngine], MemoryMeter]:
    """What builds the local engine, and a running meter of what loading and the reply cost."""
    from localllm.engine.engine import LLMEngine
    from localllm.hardware.probe import MemoryMeter

    # Library code is the process's baseline, not the model's: import it before measuring.
    import gguf, jinja2, safetensors, tokenizers  # noqa: E401, F401
    import torch

    meter = MemoryMeter("cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu").start()
    config = engine_config_from_args(args, chats=1)
    return (lambda: LLMEngine(config, progress=progress_printer())), meter


class ReplySplit:
    """A thinking model's reply as `run` shows it: the answer on stdout, the reasoning on
    stderr (dimmed on a terminal), so a pipe gets the answer alone; localllm.reasoning's
    parser, started where the prompt leaves the reply."""

    def __init__(self, fmt: ReasoningFormat, tokenizer: Tokenizer) -> None:
        self.format, self.tokenizer = fmt, tokenizer
        self.parser: ReasoningParser | None = None
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.answered = False

    def add(self, out: RequestOutput, echo: bool) -> None:
        from localllm.reasoning import prompt_tail

        if self.parser is None:
            self.parser = self.format.parser(prompt_tail(self.tokenizer, out.prompt_token_ids))
        delta = self.parser.read(out.outputs[0].delta_text, finished=out.finished)
        self.reasoning.append(delta.reasoning)
        self.content.append(delta.content)
        if echo and delta.reasoning:
            dim = sys.stderr.isatty()
            sys.stderr.write(f"\x1b[2m{delta.reasoning}\x1b[0m" if dim else delta.reasoning)
            sys.stderr.flush()
        if echo and delta.content:
            if not self.answered and any(self.reasoning):  # the answer starts below the reasoning
                sys.stderr.write("\n")
            self.answered = True
            sys.stdout.write(delta.content)
            sys.stdout.flush()
        if echo and out.finished:  # a call is neither answer nor reasoning: labelled, on stderr
            for call in self.calls():
                sys.stderr.write(f"\n[tool call, not run] {call.recipient} {call.arguments}\n")

    def calls(self) -> list[HarmonyCall]:
        """The tool calls the reply made (gpt-oss's harmony messages to a tool), which `run` does not run."""
        from localllm.reasoning import HarmonyParser

        return self.parser.calls if isinstance(self.parser, HarmonyParser) else []


async def _reply(engine: AsyncEngine | RemoteEngine, prompt: Prompt, params: SamplingParams, echo: bool,
                 split: ReplySplit | None = None) -> RequestOutput:
    final = None
    try:
        async for out in engine.generate(prompt, params):
            if split is not None:
                split.add(out, echo)
            elif echo and out.outputs[0].delta_text:
                sys.stdout.write(out.outputs[0].delta_text)
                sys.stdout.flush()
            final = out
    finally:
        await engine.aclose()
    assert final is not None and final.finished
    return final


def _report(
    result: RequestOutput, stats: EngineStats, params: SamplingParams, defaults: dict[str, float | int], total_s: float,
) -> dict[str, Any]:
    """What any engine can tell: the text, token counts, the sampling used and timings."""
    m = result.metrics
    c = result.outputs[0]
    n_out = len(c.token_ids)
    prefill_s = (m.first_token_time or 0) - (m.first_scheduled_time or 0)
    decode_s = (m.last_token_time or 0) - (m.first_token_time or 0)
    return {
        "model": stats.model,
        "precision": stats.precision,
        "device": stats.device,
        "text": c.text,
        "finish_reason": c.finish_reason,
        "prompt_tokens": len(result.prompt_token_ids),
        "completion_tokens": n_out,
        "num_cached_tokens": result.num_cached_tokens,
        "sampling": {k: getattr(params, k) for k in ("temperature", "top_p", "top_k", "min_p",
                                                      "repetition_penalty", "max_tokens", "seed")},
        "sampling_defaults": defaults,
        "timings": {
            "total_s": round(total_s, 4),
            "ttft_s": round(m.ttft, 4) if m.ttft is not None else None,
            "prefill_tokens_per_s": round(len(result.prompt_token_ids) / prefill_s, 1) if prefill_s > 0 else None,
            "decode_tokens_per_s": round((n_out - 1) / decode_s, 1) if n_out > 1 and decode_s > 0 else None,
            "itl_mean_s": round(sum(m.inter_token_latencies) / len(m.inter_token_latencies), 5)
            if m.inter_token_latencies else None,
        },
    }


def _local_report(result: RequestOutput, llm: LLMEngine, meter: MemoryMeter) -> dict[str, Any]:
    """What only the local engine knows: token ids, the KV cache, the plan, memory against it, its stats."""
    from localllm.hardware.planner import compare_memory

    check = compare_memory(llm.plan, meter.actual_bytes, compiled_graphs=llm.runner.graphs_compiled)
    measured_by = "torch.cuda.max_memory_allocated" if llm.device.type == "cuda" else "RSS growth"
    stats = llm.stats()
    report: dict[str, Any] = {
        "kv_cache": {"dtype": str(llm.kv_cache_dtype).removeprefix("torch."), "scales": llm.kv_scales},
        "prompt_token_ids": list(result.prompt_token_ids),
        "output_token_ids": list(result.outputs[0].token_ids),
        "memory": {**check.to_dict(), "measured_by": measured_by},
        "plan": llm.plan.to_dict(),
        "load_notes": list(llm.load_notes),
        "engine": {**asdict(stats), "kv_usage": round(stats.kv_usage, 4)},
    }
    if stats.spec_method is not None:  # speculative decoding: what it proposed, kept, and yielded a step
        report["speculative"] = {
            "method": stats.spec_method, "num_drafts": stats.spec_num_drafts,
            "num_draft_tokens": stats.spec_num_draft_tokens, "num_accepted_tokens": stats.spec_num_accepted_tokens,
            "acceptance_rate": round(stats.spec_acceptance_rate, 4),
            "mean_acceptance_length": round(stats.spec_mean_acceptance_length, 4),
        }
    return report


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


