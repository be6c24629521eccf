"""``localllm eval``: what each quantization method costs, measured side by side.

Per mode, on one model: perplexity over non-overlapping windows of a text, its change
against the unquantized model, the bytes of the weights, batch-1 decode speed, and the
agreement of greedy tokens with the unquantized model's 128-token continuations of five chat
prompts. Each mode runs once per KV cache dtype asked for (``--kv-cache-dtype auto,fp8``);
the first dtype's unquantized row is the reference every change is measured against.
Agreement is teacher-forced: the quantized model reads the unquantized continuation and we
count the positions where its argmax is the same token (top-1 agreement); the first
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
from localllm.models.checkpoint import Checkpoint
from localllm.models.formats import open_checkpoint
from localllm.models.loader import build_model
from localllm.quant.forward import KVSpec, greedy_generate, prefill_logits
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
    kv_cache_dtype: str = "auto"  # "auto" (the model dtype), a float dtype, or "fp8"
    kv_scales: str | None = None  # fp8: "1.0" or "calibrated"


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
    kv_cache_dtypes: list[str] = field(default_factory=lambda: ["auto"])
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


# What eval's --kv-cache-dtype takes: the engine's names, plus float dtypes so a 16-bit cache
# can be measured on a CPU (whose engine keeps an fp32 one).
KV_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
             "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def kv_dtype_names(value: str) -> list[str]:
    """``--kv-cache-dtype auto,fp8`` -> ["auto", "fp8"], checked; fp8_e4m3 is named fp8."""
    names = [v.strip().lower() for v in value.split(",") if v.strip()]
    bad = [n for n in names if n not in KV_DTYPES]
    if bad or not names:
        raise LocalLLMError(f"--kv-cache-dtype {value!r}: use a comma-separated list of {', '.join(KV_DTYPES)}")
    return list(dict.fromkeys("fp8" if n == "fp8_e4m3" else n for n in names))


def kv_spec(model: LlamaForCausalLM, name: str, tokenizer: Tokenizer, calibrate: bool) -> KVSpec:
    if name != "fp8":
        return KVSpec(KV_DTYPES[name])
    if not calibrate:
        return KVSpec(torch.float8_e4m3fn)
    from localllm.quant.kv_cache import calibrate_kv_scales, calibration_prompt

    return KVSpec(torch.float8_e4m3fn, calibrate_kv_scales(model, calibration_prompt(tokenizer)))


@torch.inference_mode()
def perplexity(model: LlamaForCausalLM, windows: Sequence[Sequence[int]], kv: KVSpec = KVSpec()) -> float:
    nll, count = 0.0, 0
    for w in windows:
        logits = prefill_logits(model, w, kv)[:-1]
        target = torch.tensor(w[1:], device=logits.device)
        nll += torch.nn.functional.cross_entropy(logits, target, reduction="sum").item()
        count += len(w) - 1
    return math.exp(nll / count)


@torch.inference_mode()
def agreement(
    model: LlamaForCausalLM, prompts: Sequence[Sequence[int]], refs: Sequence[Sequence[int]], kv: KVSpec = KVSpec()
) -> tuple[float, float]:
    """(top-1 agreement, mean matching prefix) of ``model`` reading ``prompt + ref``."""
    same, total, prefixes = 0, 0, []
    for p, ref in zip(prompts, refs):
        logits = prefill_logits(model, [*p, *ref[:-1]], kv)
        pred = logits[len(p) - 1 :].argmax(-1).tolist()
        hits = [a == b for a, b in zip(pred, ref)]
        same += sum(hits)
        total += len(ref)
        prefixes.append(next((i for i, h in enumerate(hits) if not h), len(ref)))
    return same / total, sum(prefixes) / len(prefixes)


def decode_speed(model: LlamaForCausalLM, prompt: Sequence[int], tokens: int, kv: KVSpec = KVSpec()) -> float:
    """Batch-1 decode tokens per second, from the median step time."""
    return 1.0 / greedy_generate(model, [prompt], tokens, kv).median_step


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
    kv_cache_dtypes: Sequence[str] = ("auto",),
    calculate_kv_scales: bool = False,
    log: Log = _say,
) -> EvalReport:
    from localllm import store

    modes = [check_method(m) for m in modes]
    if not modes:
        raise LocalLLMError("--quant: name at least one mode, e.g. none,int8,awq")
    kvs = kv_dtype_names(",".join(kv_cache_dtypes))
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
        kv_cache_dtypes=kvs,
    )

    refs: list[list[int]] = []
    base_ppl = float("nan")
    for mode in ["none", *[m for m in modes if m != "none"]]:
        log(f"[{mode}] loading{' and quantizing' if mode != 'none' else ''} ...")
        t0 = time.perf_counter()
        model = load_mode(ckpt, mode, torch_dtype, dev, max_pos, group, calib)
        load_s = time.perf_counter() - t0
        for kv_name in kvs:
            tag = mode if kv_name == "auto" else f"{mode}, KV {kv_name}"
            kv = kv_spec(model, kv_name, tok, calculate_kv_scales)
            log(f"[{tag}] perplexity over {len(wins)} windows of {len(wins[0])} tokens ...")
            ppl = perplexity(model, wins, kv)
            if mode == "none" and kv_name == kvs[0]:
                base_ppl = ppl
                log(f"[{tag}] greedy reference: {len(chat)} prompts x {gen_tokens} tokens ...")
                refs = greedy_generate(model, chat, gen_tokens, kv).tokens
            agree, prefix = agreement(model, chat, refs, kv)
            log(f"[{tag}] decode speed ...")
            speed = decode_speed(model, chat[0], speed_tokens, kv)
            scales = None if kv_name != "fp8" else "calibrated" if kv.scales is not None else "1.0"
            result = ModeResult(mode, ppl, 100 * (ppl / base_ppl - 1), weight_bytes(model), speed, agree, prefix,
                                load_s, kv_name, scales)
            log(f"[{tag}] ppl {ppl:.3f} ({result.delta_pct:+.2f}%), agreement {agree:.1%}, {speed:.1f} tok/s")
            report.results.append(result)
        del model
    report.gates = quality_gates(report.results)
    return report


def quality_gates(results: Sequence[ModeResult]) -> dict[str, dict[str, Any]]:
    """The issues' acceptance checks, for the modes that were measured. Weight modes are
    judged with the reference KV dtype (the first one asked for); the FP8 cache against the
    16-bit cache where one was measured, else against the reference."""
    ref_kv = results[0].kv_cache_dtype if results else "auto"
    by = {r.mode: r for r in results if r.kv_cache_dtype == ref_kv}
    gates: dict[str, dict[str, Any]] = {}
    plain = {r.kv_cache_dtype: r for r in results if r.mode == "none"}
    sixteen = next((plain[k] for k in ("bfloat16", "float16") if k in plain), plain.get(ref_kv))
    if "fp8" in plain and sixteen is not None and sixteen.kv_cache_dtype != "fp8":
        delta = 100 * (plain["fp8"].perplexity / sixteen.perplexity - 1)
        gates[f"fp8 KV within 1% of the {sixteen.kv_cache_dtype} cache"] = {"value": delta, "pass": abs(delta) <= 1.0}
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
    cols = (f"{'mode':<10} {'kv cache':<16} {'ppl':>9} {'delta':>8} {'weights':>10} {'decode':>10} {'agree':>7}"
            f" {'prefix':>7} {'load':>7}")
    lines = [head, cols, "-" * len(cols)]
    for r in report.results:
        kv = r.kv_cache_dtype + (f" ({r.kv_scales})" if r.kv_scales else "")
        lines.append(
            f"{r.mode:<10} {kv:<16} {r.perplexity:>9.3f} {r.delta_pct:>+7.2f}% {r.weight_bytes / 2**20:>7.1f}MiB "
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
        kv_cache_dtypes=args.kv_cache_dtype.split(","), calculate_kv_scales=args.calculate_kv_scales,
    )
    print(json.dumps(asdict(report), indent=2) if args.json else format_table(report))
    return 0


__all__ = ["METHODS", "EvalReport", "ModeResult", "evaluate", "format_table", "quality_gates", "run"]
