"""``localllm eval``: what each quantization method costs, measured side by side.

Per mode, on one model: perplexity over non-overlapping windows of a text, its change
against the unquantized model, the bytes of the weights, batch-1 decode speed, and the
agreement of greedy tokens with the unquantized model's 128-token continuations of five chat
prompts. Agreement is teacher-forced: the quantized model reads the unquantized continuation
and we count the positions where its argmax is the same token (top-1 agreement); the first
disagreement is exactly where a free-running greedy generation would part ways (prefix).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from localllm.errors import LocalLLMError
from localllm.models.llama import LlamaForCausalLM
from localllm.models.loader import Checkpoint, build_model, open_checkpoint
from localllm.quant.forward import greedy_generate, prefill_logits
from localllm.quant.methods import (
    METHODS,
    check_method,
    config_group_size,
    prepare_online,
    quantize_model,
    weight_bytes,
)
from localllm.tokenizer import Tokenizer

DEFAULT_CALIB = Path("/usr/share/common-licenses/Apache-2.0")
PROMPTS = (
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain what a hash table is in two sentences.",
    "Give me three tips for learning a new language.",
    "What is 17 multiplied by 23? Show your steps.",
)

Log = Callable[[str], None]


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass(slots=True)
class ModeResult:
    mode: str
    perplexity: float
    delta_pct: float  # perplexity change against unquantized, in percent
    weight_bytes: int
    decode_tok_s: float
    agreement: float  # teacher-forced top-1 agreement with unquantized greedy tokens, 0..1
    agree_prefix: float  # mean tokens before the first disagreement, per prompt
    quantize_s: float  # load + quantize wall time


@dataclass(slots=True)
class EvalReport:
    model: str
    text: str
    tokens: int
    windows: int
    window: int
    device: str
    dtype: str
    group_size: int | None
    calib: str | None
    calib_tokens: int
    results: list[ModeResult] = field(default_factory=list)
    gates: dict[str, dict[str, Any]] = field(default_factory=dict)


def read_text(path: Path, what: str) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise LocalLLMError(f"{what} {path}: cannot be read ({e.strerror})") from e
    if not text.strip():
        raise LocalLLMError(f"{what} {path}: the file is empty; give a plain-text file")
    return text


def windows_of(ids: Sequence[int], window: int) -> list[list[int]]:
    """Non-overlapping windows; a short tail is dropped so every window has full context,
    unless the text is shorter than one window."""
    if len(ids) < 2:
        raise LocalLLMError(f"the text has {len(ids)} tokens; perplexity needs at least 2")
    full = [list(ids[i : i + window]) for i in range(0, len(ids) - window + 1, window)]
    return full or [list(ids)]


def calibration_samples(tokenizer: Tokenizer, path: Path, max_tokens: int, length: int = 512) -> list[list[int]]:
    ids = tokenizer.encode(read_text(path, "--calib"), add_special_tokens=False)[:max_tokens]
    if len(ids) < 32:
        raise LocalLLMError(f"--calib {path}: only {len(ids)} tokens; AWQ needs a longer text (a few thousand tokens)")
    return [list(ids[i : i + length]) for i in range(0, len(ids), length) if len(ids[i : i + length]) >= 32]


@torch.inference_mode()
def perplexity(model: LlamaForCausalLM, windows: Sequence[Sequence[int]]) -> float:
    nll, count = 0.0, 0
    for w in windows:
        logits = prefill_logits(model, w)[:-1]
        target = torch.tensor(w[1:], device=logits.device)
        nll += torch.nn.functional.cross_entropy(logits, target, reduction="sum").item()
        count += len(w) - 1
    return math.exp(nll / count)


@torch.inference_mode()
def agreement(model: LlamaForCausalLM, prompts: Sequence[Sequence[int]], refs: Sequence[Sequence[int]]) -> tuple[float, float]:
    """(top-1 agreement, mean matching prefix) of ``model`` reading ``prompt + ref``."""
    same, total, prefixes = 0, 0, []
    for p, ref in zip(prompts, refs):
        logits = prefill_logits(model, [*p, *ref[:-1]])
        pred = logits[len(p) - 1 :].argmax(-1).tolist()
        hits = [a == b for a, b in zip(pred, ref)]
        same += sum(hits)
        total += len(ref)
        prefixes.append(next((i for i, h in enumerate(hits) if not h), len(ref)))
    return same / total, sum(prefixes) / len(prefixes)


def decode_speed(model: LlamaForCausalLM, prompt: Sequence[int], tokens: int) -> float:
    """Batch-1 decode tokens per second, from the median step time."""
    return 1.0 / greedy_generate(model, [prompt], tokens).median_step


def load_mode(
    ckpt: Checkpoint,
    mode: str,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    group_size: int | None,
    calib: list[list[int]] | None,
) -> LlamaForCausalLM:
    """The model in ``mode``: float, quantized while it loads, or (awq) quantized after
    loading, which needs activations through the whole float model."""
    if mode in ("none", "awq"):
        model = build_model(ckpt, dtype, device, max_positions)
        if mode == "awq":
            quantize_model(model, "awq", group_size=group_size, calib=calib)
        return model
    return build_model(ckpt, dtype, device, max_positions, quantize=lambda m: prepare_online(m, mode, group_size))


def evaluate(
    model_name: str | None,
    text_path: Path,
    modes: Sequence[str],
    *,
    calib_path: Path | None = None,
    group_size: int | None = None,
    max_tokens: int | None = None,
    window: int = 512,
    prompts: int = 5,
    gen_tokens: int = 128,
    speed_tokens: int = 64,
    calib_tokens: int = 8192,
    device: str | None = None,
    dtype: str = "auto",
    log: Log = _say,
) -> EvalReport:
    from localllm import store

    modes = [check_method(m) for m in modes]
    if not modes:
        raise LocalLLMError("--quant: name at least one mode, e.g. none,int8,awq")
    path = store.resolve(model_name)
    ckpt = open_checkpoint(path)
    if ckpt.config.quantization:
        raise LocalLLMError(f"{path}: already quantized ({ckpt.config.quantization.get('quant_method')}); "
                            "evaluate its float original")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise LocalLLMError("--device cuda: torch sees no CUDA GPU here; use --device cpu")
    torch_dtype = {"auto": torch.float32 if dev.type == "cpu" else torch.bfloat16, "float32": torch.float32,
                   "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    tok = ckpt.tokenizer
    ids = tok.encode(read_text(text_path, "--text"), add_special_tokens=False)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    wins = windows_of(ids, window)
    chat = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS[:prompts]]
    max_pos = max(window, max(len(c) for c in chat) + gen_tokens) + 1
    group = config_group_size(ckpt.config, group_size) if any(m in ("awq", "rtn4") for m in modes) else None
    calib: list[list[int]] | None = None
    calib_file = None
    if "awq" in modes:
        calib_file = calib_path or DEFAULT_CALIB
        if calib_path is None and not DEFAULT_CALIB.is_file():
            raise LocalLLMError("awq needs calibration text: pass --calib FILE (a text other than --text)")
        if calib_file.resolve() == text_path.resolve():
            raise LocalLLMError("--calib and --text are the same file; calibrate on a different text")
        calib = calibration_samples(tok, calib_file, calib_tokens)
    report = EvalReport(
        model=str(path), text=str(text_path), tokens=sum(len(w) for w in wins), windows=len(wins), window=window,
        device=str(dev), dtype=str(torch_dtype).removeprefix("torch."), group_size=group,
        calib=str(calib_file) if calib_file else None, calib_tokens=sum(len(c) for c in calib or []),
    )

    refs: list[list[int]] = []
    base_ppl = float("nan")
    for mode in ["none", *[m for m in modes if m != "none"]]:
        log(f"[{mode}] loading{' and quantizing' if mode != 'none' else ''} ...")
        t0 = time.perf_counter()
        model = load_mode(ckpt, mode, torch_dtype, dev, max_pos, group, calib)
        load_s = time.perf_counter() - t0
        log(f"[{mode}] perplexity over {len(wins)} windows of {len(wins[0])} tokens ...")
        ppl = perplexity(model, wins)
        if mode == "none":
            base_ppl = ppl
            log(f"[{mode}] greedy reference: {len(chat)} prompts x {gen_tokens} tokens ...")
            refs = greedy_generate(model, chat, gen_tokens).tokens
        agree, prefix = agreement(model, chat, refs)
        log(f"[{mode}] decode speed ...")
        speed = decode_speed(model, chat[0], speed_tokens)
        result = ModeResult(mode, ppl, 100 * (ppl / base_ppl - 1), weight_bytes(model), speed, agree, prefix, load_s)
        log(f"[{mode}] ppl {ppl:.3f} ({result.delta_pct:+.2f}%), agreement {agree:.1%}, {speed:.1f} tok/s")
        report.results.append(result)
        del model
    report.gates = quality_gates(report.results)
    return report


def quality_gates(results: Sequence[ModeResult]) -> dict[str, dict[str, Any]]:
    """The issue's acceptance checks, for the modes that were measured."""
    by = {r.mode: r for r in results}
    gates: dict[str, dict[str, Any]] = {}
    if "awq" in by and "rtn4" in by:
        rtn = by["rtn4"].delta_pct
        ratio = by["awq"].delta_pct / rtn if rtn > 0 else float("nan")
        gates["awq <= 60% of rtn4 increase"] = {"value": ratio, "pass": bool(ratio <= 0.6)}
    if "int8" in by:
        gates["int8 within 1%"] = {"value": by["int8"].delta_pct, "pass": abs(by["int8"].delta_pct) <= 1.0}
    if "fp8" in by:
        gates["fp8 within 2%"] = {"value": by["fp8"].delta_pct, "pass": abs(by["fp8"].delta_pct) <= 2.0}
    return gates


def format_table(report: EvalReport) -> str:
    head = (f"{report.model}\n{report.text}: {report.tokens} tokens in {report.windows} windows of "
            f"{report.window}; {report.device} {report.dtype}"
            + (f"; int4 group {report.group_size}" if report.group_size else "")
            + (f"; calib {report.calib} ({report.calib_tokens} tokens)" if report.calib else ""))
    cols = f"{'mode':<10} {'ppl':>9} {'delta':>8} {'weights':>10} {'decode':>10} {'agree':>7} {'prefix':>7} {'load':>7}"
    lines = [head, cols, "-" * len(cols)]
    for r in report.results:
        lines.append(
            f"{r.mode:<10} {r.perplexity:>9.3f} {r.delta_pct:>+7.2f}% {r.weight_bytes / 2**20:>7.1f}MiB "
            f"{r.decode_tok_s:>6.1f}t/s {r.agreement:>6.1%} {r.agree_prefix:>7.1f} {r.quantize_s:>6.1f}s"
        )
    for name, g in report.gates.items():
        lines.append(f"gate {name}: {g['value']:.3f} {'PASS' if g['pass'] else 'FAIL'}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    modes = [m for m in args.quant.split(",") if m.strip()]
    report = evaluate(
        args.model, Path(args.text), modes, calib_path=Path(args.calib) if args.calib else None,
        group_size=args.group_size, max_tokens=args.max_tokens, window=args.window,
        calib_tokens=args.calib_tokens, device=args.device, dtype=args.dtype,
    )
    print(json.dumps(asdict(report), indent=2) if args.json else format_table(report))
    return 0


__all__ = ["METHODS", "EvalReport", "ModeResult", "evaluate", "format_table", "quality_gates", "run"]
