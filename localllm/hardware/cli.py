"""``localllm probe``: the hardware, then what each catalog model would run as on it.

Importing this module is cheap (the parser is built for every ``localllm`` command); the
probe, the planner and torch load only when ``probe`` runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from localllm.errors import LocalLLMError
from localllm.hardware.sizing import KV_CACHE_DTYPES

if TYPE_CHECKING:
    from localllm.catalog import CatalogEntry
    from localllm.hardware.probe import Hardware
    from localllm.hardware.sizing import GGUFWeights, ModelDims

JSON_SCHEMA_VERSION = 1
TABLE_CONTEXT = 8192  # the "chats at 8K" column
PROBE_QUANTS = ("awq", "fp8", "int8", "gguf")
# What the probe says a GGUF plan on the CPU runs on, for a catalog model's Q4_K_M (a file's
# own types are named from its tensors, as the engine names them at load).
CPU_GGUF_WHY = "gguf: the file's blocks as stored, on localllm's CPU kernels"


@dataclass(frozen=True, slots=True)
class _Model:
    """One row's model: a catalog entry, or a GGUF file named with --model."""

    id: str
    hf_repo: str
    architecture: str
    supported: bool
    params: int
    max_context: int
    dims: ModelDims
    gguf: GGUFWeights | None = None  # a file's tensors, or the catalog's Q4_K_M with --quant gguf
    gguf_why: str = CPU_GGUF_WHY  # a file's: each stored type and what runs it on the CPU
    gguf_types: tuple[tuple[str, int], ...] = ()  # a file's tensors' types (HF name, type), for a GPU's line
    tied: bool = False


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "probe",
        help="show the hardware and the precision, context and speed bound of each catalog model",
        description="Probe this machine (or a GPU you name) and plan every catalog model on it.",
    )
    p.add_argument("--model", "-m", default=None,
                   help="one catalog id, or a .gguf file sized from its tensors (default: every catalog model)")
    p.add_argument("--gpu", default=None, help='plan for a GPU you do not have, e.g. "RTX 4090"')
    p.add_argument("--vram", type=float, default=None,
                   help="GiB of VRAM: with --gpu it overrides the card's size, alone it plans for any such card")
    p.add_argument("--vram-used", type=float, default=None, metavar="GIB",
                   help="with --gpu/--vram: GiB of that card held by other processes (the desktop, a browser)")
    p.add_argument("--quant", choices=PROBE_QUANTS, default=None,
                   help="plan at this quantization (gguf: each catalog model's Q4_K_M GGUF) instead of the"
                        " planner's choice")
    p.add_argument("--context", type=int, default=None,
                   help=f"tokens per chat to plan for (default: {TABLE_CONTEXT:,}, or less if the model allows less)")
    p.add_argument("--chats", type=int, default=1, help="chats running at once (default 1)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="KV cache storage to plan for: auto (16-bit; fp8 on sm89+ GPUs only where 16-bit does not"
                        " fit) or fp8 (e4m3)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of VRAM the engine may use (default 0.9)")
    p.add_argument("--measure", action="store_true",
                   help="measure memory bandwidth with a large copy instead of using the GPU table")
    p.add_argument("--json", action="store_true", help="print everything as JSON (keys in docs/probe.md)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from localllm.catalog import load_catalog
    from localllm.hardware.probe import hardware_for_gpu, measure_bandwidth, probe_hardware, with_bandwidth

    if args.context is not None and args.context <= 0:
        raise LocalLLMError(f"--context must be a positive number of tokens, got {args.context}")
    if args.chats < 1:
        raise LocalLLMError(f"--chats must be at least 1, got {args.chats}")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise LocalLLMError(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")
    if args.vram is not None and not args.vram > 0:
        raise LocalLLMError(f"--vram must be a positive number of GiB, got {args.vram}")
    hypothetical = bool(args.gpu) or args.vram is not None
    if args.vram_used is not None and not hypothetical:
        raise LocalLLMError("--vram-used describes a card named with --gpu or --vram; for this machine's GPU"
                            " the probe reads what other processes hold")
    if args.vram_used is not None and not args.vram_used >= 0:
        raise LocalLLMError(f"--vram-used must be 0 or more GiB, got {args.vram_used}")
    if args.measure and hypothetical:
        raise LocalLLMError("--measure measures this machine; it cannot be combined with --gpu or --vram")

    if args.gpu:
        from localllm.hardware.probe import lookup_gpu

        lookup_gpu(args.gpu)  # an unknown name fails now, before the (slow) probe
    catalog = load_catalog()
    if args.model is not None and args.model.lower().endswith(".gguf"):
        models = [_gguf_file_model(Path(args.model).expanduser(), args.quant)]
    elif args.model is not None:
        entry = catalog.get(args.model) or next(
            (e for e in catalog.values() if args.model.lower() in (e.id.lower(), e.hf_repo.lower())), None)
        if entry is None:
            raise LocalLLMError(f"unknown catalog model {args.model!r}; `localllm models` lists the catalog ids,"
                                " or name a .gguf file")
        models = [_catalog_model(entry, args.quant)]
    else:
        models = [_catalog_model(e, args.quant) for e in catalog.values()]

    hw = probe_hardware()
    if hypothetical:
        hw = hardware_for_gpu(args.gpu, args.vram, base=hw)
        if args.vram_used is not None:
            hw = _with_vram_used(hw, args.vram_used)

    bandwidth: float | None = None
    bandwidth_source = "none"
    if args.measure:
        device = "cuda" if hw.gpu is not None else "cpu"
        try:
            bandwidth = measure_bandwidth(device)
        except Exception as e:  # noqa: BLE001 - a failed measurement is a result, not a crash
            raise LocalLLMError(f"bandwidth measurement on {device} failed: {type(e).__name__}: {e}") from None
        bandwidth_source = f"measured ({device} copy)"
        if hw.gpu is not None:
            hw = with_bandwidth(hw, bandwidth)
    elif hw.gpu is not None and hw.gpu.bandwidth_gbs:
        bandwidth = hw.gpu.bandwidth_gbs
        bandwidth_source = {"table": "GPU table", "nvml": "NVML clock x bus width"}.get(hw.gpu.bandwidth_source,
                                                                                         hw.gpu.bandwidth_source)

    rows = [_row(m, hw, args, bandwidth, strict=args.model is not None) for m in models]
    doc = {
        "schema_version": JSON_SCHEMA_VERSION,
        "hardware": hw.to_dict(),
        "bandwidth": {"gbs": bandwidth, "source": bandwidth_source},
        "request": {
            "context": args.context,
            "chats": args.chats,
            "gpu_memory_utilization": args.gpu_memory_utilization,
            "kv_cache_dtype": args.kv_cache_dtype,
            "quant": args.quant,
            "vram_used_gib": args.vram_used,
            "table_context": TABLE_CONTEXT,
        },
        "models": rows,
    }
    # `localllm probe | head` closing the pipe early is handled once, in localllm.cli.main
    if args.json:
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        _render(doc, hw, args)
    return 0


def _catalog_model(entry: CatalogEntry, quant: str | None) -> _Model:
    from localllm.hardware.sizing import gguf_catalog_weights

    return _Model(entry.id, entry.hf_repo, entry.architecture, entry.supported, entry.params, entry.max_context,
                  entry, gguf_catalog_weights(entry) if quant == "gguf" else None)


def _gguf_file_model(path: Path, quant: str | None) -> _Model:
    """A user's GGUF file: its dims from the metadata, its weights from its tensors' real types."""
    from localllm.hardware.sizing import count_params
    from localllm.models.formats import open_checkpoint
    from localllm.models.gguf_file import gguf_weights_from_file
    from localllm.quant.gguf_modules import reason_line

    if quant not in (None, "gguf"):
        raise LocalLLMError(f"--quant {quant} with a .gguf file: the file's blocks are planned as they are;"
                            " leave --quant out")
    if not path.is_file():
        raise LocalLLMError(f"{path}: no such file; --model takes a catalog id or a .gguf file")
    ckpt = open_checkpoint(path)
    cfg = ckpt.config
    return _Model(path.name, str(path), cfg.architecture, True, count_params(cfg), cfg.max_context, cfg,
                  gguf_weights_from_file(path), reason_line(ckpt.block_types, cfg.tie_word_embeddings),
                  tuple(ckpt.block_types.items()), cfg.tie_word_embeddings)


def _with_vram_used(hw: Hardware, used_gib: float) -> Hardware:
    """The planned-for card with ``used_gib`` held by other processes, as NVML would report it."""
    from localllm.hardware.probe import GiB

    gpu = hw.gpus[0]
    used = int(used_gib * GiB)
    if used >= gpu.total_bytes:
        raise LocalLLMError(f"--vram-used {used_gib:g} GiB is not less than the card's"
                            f" {gpu.total_bytes / GiB:g} GiB")
    notes = [n for n in hw.notes if "otherwise idle" not in n]
    notes.insert(0, f"planning for a GPU this machine does not have, with {used_gib:g} GiB of it held by"
                    " other processes")
    return replace(hw, gpus=(replace(gpu, free_bytes=gpu.total_bytes - used, others_bytes=used),), notes=tuple(notes))


def _row(
    model: _Model, hw: Hardware, args: argparse.Namespace, bandwidth: float | None, *, strict: bool
) -> dict[str, Any]:
    from localllm.hardware.planner import DoesNotFit, decode_tokens_per_s, plan
    from localllm.hardware.sizing import kv_bytes_per_token, weight_bytes

    entry = model.dims
    wanted = args.context if args.context is not None else min(model.max_context, TABLE_CONTEXT)
    row: dict[str, Any] = {
        "id": model.id,
        "hf_repo": model.hf_repo,
        "architecture": model.architecture,
        "supported": model.supported,
        "params": model.params,
        "status": "error",  # "fits", "does_not_fit" or "error" (bad request for this model)
        "fits": False,
        "precision": None,
        "kv_dtype": None,
        "reason": "",
        "kv_reason": "",
        "weight_bytes": None,
        "kv_bytes_per_token": None,
        "max_context": 0,
        "max_chats_at_8k": 0,
        "decode_context": wanted,
        "decode_tok_s_bound": None,
        "plan": None,
        "nearest": None,
        "suggestions": [],
    }
    # A GGUF on the CPU plans as the engine loads a file: its blocks first (fp32 beside them),
    # the planner's ladder after them unless --quant gguf pins them.
    gguf_on_cpu = model.gguf is not None and hw.gpu is None
    quant = args.quant or ("gguf" if model.gguf is not None and not gguf_on_cpu else None)
    gpu_gguf = None
    if model.gguf_types and hw.gpu is not None:  # a file on a GPU: its types on the Triton kernels
        from localllm.quant.gguf_cuda import TRITON
        from localllm.quant.gguf_modules import reason_line

        gpu_gguf = reason_line(dict(model.gguf_types), model.tied, TRITON)
    try:
        p = plan(entry, hw, context=args.context, chats=args.chats, quant=quant, name=model.id,
                 gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_dtype=args.kv_cache_dtype,
                 gguf=model.gguf, cpu_gguf=model.gguf_why if gguf_on_cpu else None, gpu_gguf=gpu_gguf)
    except DoesNotFit as e:
        # Report the smallest precision's footprint: that is what did not fit.
        gpu = hw.gpu
        compute = "bfloat16" if gpu is None or gpu.has_bf16 else "float16"
        smallest = ("float32" if gpu is None else compute, "gguf") if model.gguf is not None else (
            compute, quant or "awq")
        row.update(
            status="does_not_fit",
            reason=str(e),
            weight_bytes=weight_bytes(entry, *smallest, model.gguf),
            kv_bytes_per_token=e.kv_bytes_per_token or kv_bytes_per_token(entry, "float32" if gpu is None else compute),
            nearest=e.nearest.to_dict() if e.nearest is not None else None,
            suggestions=list(e.suggestions),
        )
        return row
    except LocalLLMError as e:
        if strict:
            raise
        row["reason"] = str(e)
        return row
    table_ctx = min(model.max_context, TABLE_CONTEXT)
    row.update(
        status="fits",
        fits=True,
        precision=p.precision,
        kv_dtype=p.kv_dtype,
        reason=p.precision_reason,
        kv_reason=p.reasons[3],
        weight_bytes=p.weight_bytes,
        kv_bytes_per_token=p.kv_bytes_per_token,
        max_context=min(model.max_context, p.kv_capacity_tokens),
        max_chats_at_8k=p.kv_capacity_tokens // table_ctx,
        decode_tok_s_bound=decode_tokens_per_s(p, bandwidth, wanted),
        plan=p.to_dict(),
    )
    return row


def _render(doc: dict[str, Any], hw: Hardware, args: argparse.Namespace) -> None:
    from rich.table import Table

    from localllm.console import stdout_console
    from localllm.hardware.planner import CPU_RAM_FRACTION, fmt_bytes

    console = stdout_console(width=None if sys.stdout.isatty() else 200, soft_wrap=False, highlight=False)
    cpu = hw.cpu
    console.print("[bold]Hardware[/bold]" + (" (planned for, not this machine)" if hw.hypothetical else ""))
    console.print(f"  CPU  {cpu.model}, {cpu.physical_cores} physical / {cpu.logical_cores} logical cores,"
                  f" {cpu.arch}; ISA: {cpu.isa_summary()}"
                  f"{'; bf16 matmuls native' if cpu.bf16_fast else ''}")
    console.print(f"  RAM  {fmt_bytes(hw.ram_total_bytes)} total, {fmt_bytes(hw.ram_available_bytes)} available")
    if hw.gpus:
        for g in hw.gpus:
            runs = "" if g.backend == "cuda" else " (not used by the engine yet)"
            console.print(f"  GPU  {g.index}: {g.name}, {fmt_bytes(g.total_bytes)} ({fmt_bytes(g.free_bytes)} free),"
                          f" compute capability {g.cc_str}, {g.backend}{runs}"
                          f"{f', driver {g.driver}' if g.driver else ''}")
    else:
        console.print("  GPU  none")
    for note in hw.notes:
        console.print(f"  note {note}")
    bw = doc["bandwidth"]
    if hw.gpu is not None:
        held = hw.gpu.others_bytes or 0
        target = (f"{hw.gpu.name}, at most {args.gpu_memory_utilization:.0%} of {fmt_bytes(hw.gpu.total_bytes)}"
                  + (f", {fmt_bytes(held)} held by other processes" if held else "")
                  + "; a reserve for the engine's transients stays free (see a plan's reasons)")
    else:
        budget = fmt_bytes(hw.ram_available_bytes * CPU_RAM_FRACTION)
        target = f"CPU, RAM budget {budget} ({CPU_RAM_FRACTION:.0%} of available)"
    bw_text = f"{bw['gbs']:,.0f} GB/s ({bw['source']})" if bw["gbs"] else "unknown (use --measure)"
    console.print(f"  plan for {target}; memory bandwidth {bw_text}")
    console.print()

    ctx = f"{args.context:,} tokens" if args.context is not None else f"up to {TABLE_CONTEXT:,} tokens"
    table = Table(title=f"Models at {ctx} x {args.chats} chat{'s' if args.chats > 1 else ''}",
                  title_justify="left", show_lines=False)
    table.add_column("Model", no_wrap=True)
    table.add_column("Params", justify="right")
    table.add_column("Precision", no_wrap=True)
    table.add_column("Weights", justify="right")
    table.add_column("KV/token", justify="right")
    table.add_column("Max context", justify="right")
    table.add_column("Chats @8K", justify="right")
    table.add_column("Decode ≤ tok/s", justify="right")
    table.add_column("Why", ratio=1)
    unsupported = False
    for r in doc["models"]:
        name = r["id"]
        if not r["supported"]:
            name += " *"
            unsupported = True
        speed = r["decode_tok_s_bound"]
        precision = r["precision"] and (r["precision"] + (" + fp8 KV" if r["kv_dtype"] == "fp8" else ""))
        table.add_row(
            name,
            f"{r['params'] / 1e9:.2f}B",
            precision or ("[red]does not fit[/red]" if r["status"] == "does_not_fit" else "[yellow]n/a[/yellow]"),
            fmt_bytes(r["weight_bytes"]) if r["weight_bytes"] is not None else "-",
            fmt_bytes(r["kv_bytes_per_token"]) if r["kv_bytes_per_token"] is not None else "-",
            f"{r['max_context']:,}" if r["fits"] else "-",
            f"{r['max_chats_at_8k']:,}" if r["fits"] else "-",
            f"{speed:,.0f}" if speed else "-",
            # An FP8 cache is chosen only when nothing fits without it: its line says why.
            r["reason"] + (f"; {r['kv_reason']}" if r["kv_dtype"] == "fp8" else ""),
        )
    console.print(table)
    if unsupported:
        console.print("  * the engine does not run this architecture yet; figures are for reference")
    console.print("  Max context: tokens one chat can hold at that precision. Chats @8K: 8K-token chats at once.")
    console.print("  Decode ≤ tok/s: bandwidth / bytes read per token (all weights once + the KV of the planned"
                  " context), one stream; real speed is lower.")
    if args.model is not None:  # one model: the whole plan, each budget item with its reason
        for r in doc["models"]:
            if r["plan"] is not None:
                console.print()
                console.print(f"[bold]Plan for {r['id']}[/bold]")
                for reason in r["plan"]["reasons"]:
                    console.print(f"  - {reason}")
            elif r["nearest"] is not None:
                console.print()
                console.print(f"[bold]Nearest plan that fits[/bold] ({r['nearest']['model']})")
                for reason in r["nearest"]["reasons"]:
                    console.print(f"  - {reason}")
