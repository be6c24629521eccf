"""The ``quantize`` and ``eval`` subcommands. ``register`` runs when the parser is built, so
it imports nothing heavy; the handlers import torch when they run."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from localllm.cli_common import QUANT_METHODS, positive_int


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "quantize", help="quantize a model and write it as a checkpoint (AWQ, INT8, FP8)",
        description="Quantize a model and write it as an HF checkpoint that localllm, vLLM and AutoAWQ load.",
    )
    p.add_argument("model", nargs="?", default=None,
                   help="catalog name, HF repo id, local HF folder or .gguf file (default: the embedded default)")
    p.add_argument("--method", required=True, help=f"one of {QUANT_METHODS}")
    p.add_argument("-o", "--output", required=True, help="folder to write the HF checkpoint to")
    p.add_argument("--calib", default=None, help="calibration text for awq (default: the Apache-2.0 license text)")
    p.add_argument("--calib-tokens", type=positive_int, default=8192, help="calibration tokens for awq (default 8192)")
    p.add_argument("--group-size", type=positive_int, default=None,
                   help="int4 group size (default: the largest of 128/64/32 dividing every input dim)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.set_defaults(func=run_quantize)

    p = sub.add_parser(
        "eval", help="perplexity, speed and greedy agreement per quantization mode",
        description="Measure perplexity, memory, speed and greedy agreement of a model per quantization mode.",
    )
    p.add_argument("model", nargs="?", default=None,
                   help="catalog name, HF repo id, local HF folder or .gguf file (default: the embedded default)")
    p.add_argument("--text", required=True, help="plain-text file to measure perplexity on")
    p.add_argument("--quant", default="none,fp8,int8,awq,rtn4",
                   help=f"comma-separated modes: none, {QUANT_METHODS} (default: all but int8-w8a8)")
    p.add_argument("--calib", default=None, help="calibration text for awq; must differ from --text")
    p.add_argument("--calib-tokens", type=positive_int, default=8192, help="calibration tokens for awq (default 8192)")
    p.add_argument("--group-size", type=positive_int, default=None, help="int4 group size (awq, rtn4)")
    p.add_argument("--max-tokens", type=positive_int, default=None, help="evaluate at most this many tokens of --text")
    p.add_argument("--window", type=positive_int, default=512, help="perplexity window in tokens (default 512)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="float dtype of the unquantized parts (auto: float32 on cpu, bfloat16 on cuda)")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="comma-separated KV caches to run each mode with: auto (the model dtype), fp8 (e4m3),"
                        " float32, bfloat16, float16; the first is the reference (e.g. bfloat16,fp8)")
    p.add_argument("--calculate-kv-scales", action="store_true",
                   help="fp8 KV: per-layer scales from a calibration prompt instead of 1.0")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run_eval)


def run_quantize(args: argparse.Namespace) -> int:
    import sys
    import time
    from pathlib import Path

    import psutil
    import torch

    from localllm import store
    from localllm.errors import LocalLLMError
    from localllm.hardware.sizing import count_params
    from localllm.models.formats import open_checkpoint
    from localllm.models.loader import build_model
    from localllm.quant.checkpoint import save_quantized
    from localllm.quant.eval import DEFAULT_CALIB, calibration_samples
    from localllm.quant.methods import (
        METHODS, check_method, config_group_size, prepare_online, quantize_model, weight_bytes,
    )

    method = check_method(args.method)
    if method == "none":
        raise LocalLLMError(f"--method: choose one of {', '.join(METHODS)}")
    out = Path(args.output).expanduser()
    path = store.resolve(args.model)
    ckpt = open_checkpoint(path)
    if ckpt.config.quantization:
        raise LocalLLMError(f"{path}: already quantized ({ckpt.config.quantization.get('quant_method')}); "
                            "quantize its float original")
    group = config_group_size(ckpt.config, args.group_size) if method in ("awq", "rtn4") else None
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise LocalLLMError("--device cuda: torch sees no CUDA GPU here; use --device cpu")

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    def progress(stage: str) -> Callable[[int, int], None]:
        def report(done: int, total: int) -> None:
            if sys.stderr.isatty() or done == total:
                print(f"\r{stage} {done}/{total}", end="\n" if done == total else "", file=sys.stderr, flush=True)

        return report

    t0 = time.perf_counter()
    if method == "awq":
        calib_file = Path(args.calib).expanduser() if args.calib else DEFAULT_CALIB
        if args.calib is None and not DEFAULT_CALIB.is_file():
            raise LocalLLMError("awq needs calibration text: pass --calib FILE")
        calib = calibration_samples(ckpt.tokenizer, calib_file, args.calib_tokens)
        say(f"calibrating on {calib_file} ({sum(len(c) for c in calib)} tokens)")
        # AWQ needs the whole float model: float32 where it fits in half the RAM (the searches
        # then see the checkpoint's values unrounded), else bfloat16
        fp32_fits = count_params(ckpt.config) * 4 < psutil.virtual_memory().available // 2
        dtype = torch.float32 if dev.type == "cpu" and fp32_fits else torch.bfloat16
        model = build_model(ckpt, dtype, dev, 2048, progress("loading: tensor"))
        stages = iter(["awq search: layer", "quantizing: linear"])
        current = [progress(next(stages))]

        def staged(done: int, total: int) -> None:
            current[0](done, total)
            if done == total:
                current[0] = progress(next(stages, "quantizing: linear"))

        quantize_model(model, "awq", progress=staged, group_size=group, calib=calib)
    else:
        # Round-to-nearest needs no activations: quantize each linear as it streams in, so the
        # float model never sits in memory whole.
        model = build_model(ckpt, torch.bfloat16 if dev.type == "cuda" else torch.float32, dev, 2048,
                            progress("loading and quantizing: tensor"),
                            quantize=lambda m: prepare_online(m, method, group))
    save_quantized(model, ckpt, out, method, group)
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    say(f"{method}{f' (group {group})' if group else ''}: {count_params(ckpt.config) / 1e6:.0f}M parameters, "
        f"{weight_bytes(model) / 2**20:.1f} MiB of weights in memory, {size / 2**20:.1f} MiB on disk, "
        f"{time.perf_counter() - t0:.0f} s")
    print(out)
    return 0


def run_eval(args: argparse.Namespace) -> int:
    from localllm.quant.eval import run

    return run(args)
