#!/usr/bin/env python
"""One GPU check for localllm's kernels and engine, sized for one device call (10 minutes).

The single call, on the lent H200 (the device tool's ``run``; the image lacks platformdirs,
so its wheel travels in ``.whl``, see docs/kernels.md, "GPU check"):

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
      && export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 \
      && python3 bench/gpu_check.py --only env,bandwidth,kernels,tests,e2e --budget 500

It ends inside 9 minutes: sections stop starting work when their share of ``--budget`` is
spent, and a watchdog ends the run 30 s past the budget with the JSON saved. The JSON
(``$OUT/gpu_check.json``) is rewritten after every case and section, so a run cut short still
returns every figure it measured.

    python bench/gpu_check.py --dry-run     # imports all a run needs, prints and saves the
                                            # plan; exit 1 names what would not import
    python bench/gpu_check.py --only kernels,e2e --e2e-quants rtn4 --budget 200
    python bench/gpu_check.py --smoke       # CPU: tiny shapes under TRITON_INTERPRET=1, to
                                            # exercise this script's own code paths
    # one area only: the GGUF kernel cases, its tests first, its end-to-end run
    python bench/gpu_check.py --only env,bandwidth,kernels,tests,e2e --match gguf \
      --tests "tests/kernels/test_gguf_linear.py tests/kernels -x" --tests-timeout 75 \
      --e2e-quants gguf --budget 255

Cold, the kernels section spends most of its time compiling and autotuning (autotune picks
are saved in localllm's compiled cache per GPU, torch, triton and kernel source, so a second
run on the same machine is faster). To go further than one call allows, split it:
``--only env,bandwidth,kernels``, then ``--only tests``, then ``--only e2e``.

Sections (each guarded: a failure is recorded in the JSON and the next section still runs;
the JSON is rewritten after every case, so a killed run keeps what it measured):
- env: versions, device, compute capability, SM count.
- bandwidth: peak HBM bandwidth from a large device-to-device copy (read + write bytes).
- kernels: every Triton kernel against torch eager / SDPA / cuBLAS and against the roofline
  (bytes moved / measured bandwidth). Timings replay a CUDA graph (no launch overhead) over
  enough distinct weight or KV copies that nothing is served from L2, which is what a decode
  step sees. GGUF blocks as stored (a Q4_K_M file's Q4_K and Q6_K) at M = 1 and 4 (decode
  GEMV), 16 and 64 (a batch of decodes) and 2048 (prefill: also dequantize-then-cuBLAS and
  the dispatcher's choice). ``--match`` runs only the cases whose name contains one of its
  words.
- tests: ``pytest tests/kernels`` for real on CUDA (TRITON_INTERPRET unset); ``--tests`` sets
  the pytest targets and options, ``--tests-timeout`` its most seconds.
- e2e: a random-weight Llama-3.1-8B-shaped HF folder (bf16, in /tmp), run through
  ``localllm.LLM`` at batch 1 and 64 for each quantization, then bf16 with an FP8 KV cache
  (``kv-fp8``) and bf16 without CUDA graphs (``no-graphs``), plus HF transformers when
  importable. ``gguf``: the same shapes written as a Q4_K_M GGUF file (random blocks, the
  gguf package's writer: carried as a wheel), loaded with the precision left to the planner;
  it reports the plan, the weights held against the file's tensor bytes, VRAM, and decode
  speed. Batch-1 decode speed is the difference of two runs (16 and 144 new tokens), so
  prefill and warm-up cancel; it is compared with the weight-bytes-per-token roofline.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SECTIONS = ("env", "bandwidth", "kernels", "tests", "e2e")


# --- bookkeeping -----------------------------------------------------------------------------------


class Report:
    """The JSON document, rewritten (atomically) after every case and section, so a run cut
    short keeps what it measured. One lock: the watchdog thread saves it too."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "sections": {}}
        self.lock = threading.RLock()

    def section(self, name: str) -> dict[str, Any]:
        return self.data["sections"].setdefault(name, {})

    def save(self) -> None:
        with self.lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.data, indent=2, default=str))
            tmp.replace(self.path)


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


# Set by main: the run's report (each case saves it) and when the kernels section stops
# starting cases, so the sections after it keep their share of the budget.
_REPORT: Report | None = None
_CASES_UNTIL: Deadline | None = None
# --match: the kernel cases whose name contains one of these run; the others are left out
# (not recorded). Empty: every case.
_MATCH: list[str] = []


def guarded(report: Report, name: str, fn: Callable[[dict[str, Any]], None]) -> None:
    """Runs one section; records its time, and its error instead of raising."""
    out = report.section(name)
    t0 = time.monotonic()
    print(f"== {name}", flush=True)
    try:
        fn(out)
        out.setdefault("ok", True)
    except Exception as e:  # noqa: BLE001 - every failure is data for the report
        out["ok"] = False
        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc()[-4000:]
        print(f"   {name} failed: {out['error']}", flush=True)
    out["seconds"] = round(time.monotonic() - t0, 2)
    report.save()


def case(results: dict[str, Any], name: str, fn: Callable[[], dict[str, Any]]) -> None:
    """One benchmark case inside a section: its failure is recorded and the section goes on;
    once the section's share of the budget is spent, the case is recorded as skipped. A case
    that ``--match`` leaves out is not run."""
    if _MATCH and not any(m in name for m in _MATCH):
        return
    if _CASES_UNTIL is not None and _CASES_UNTIL.left() <= 0:
        results[name] = {"skipped": "the kernels section's share of --budget is spent"}
        print(f"   {name}: skipped (budget)", flush=True)
        return
    try:
        results[name] = fn()
        summary = {k: v for k, v in results[name].items() if k in ("us", "frac_of_peak_bw", "tflops", "speedup")}
        print(f"   {name}: {summary}", flush=True)
    except Exception as e:  # noqa: BLE001
        results[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
        print(f"   {name} failed: {results[name]['error']}", flush=True)
    if _REPORT is not None:
        _REPORT.save()


def start_watchdog(report: Report, seconds: float) -> threading.Timer:
    """Past ``seconds`` (the budget plus a grace), saves the report with what it has and ends
    the process: one case that hangs (a compile, a capture) must not eat the device call's
    time and with it the figures already measured."""

    def fire() -> None:
        report.data["killed"] = f"the watchdog ended the run {seconds:.0f} s after its start (--budget + grace)"
        print(f"gpu_check: {report.data['killed']}; {report.path} has what was measured", flush=True)
        for _ in range(3):  # the main thread may be mid-update of a dict
            try:
                report.save()
                break
            except RuntimeError:
                time.sleep(0.05)
        os._exit(3)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    return timer


# --- timing ----------------------------------------------------------------------------------------


class Timer:
    """Median microseconds per call. On CUDA the call is captured in a CUDA graph when
    ``graph`` (so CPU launch cost is excluded, as in graph-replayed decode) and timed with
    events; on CPU (--smoke) it is wall time."""

    def __init__(self, torch: Any, device: str, reps: int) -> None:
        self.torch = torch
        self.cuda = device == "cuda"
        self.reps = reps

    def __call__(self, fn: Callable[[], Any], *, graph: bool = True, calls: int = 1) -> tuple[float, str]:
        torch = self.torch
        fn()  # compile, autotune, allocate
        if not self.cuda:
            times = []
            for _ in range(max(1, self.reps // 4)):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
            return statistics.median(times) / calls, "wall"
        torch.cuda.synchronize()
        run, mode = fn, "eager"
        if graph:
            try:
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    fn()
                torch.cuda.current_stream().wait_stream(stream)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    fn()
                run, mode = g.replay, "cuda_graph"
                self._keep = g  # the graph owns memory the replay reads
            except Exception as e:  # noqa: BLE001 - fall back to eager timing
                torch.cuda.synchronize()
                run, mode = fn, f"eager ({type(e).__name__})"
        run()
        torch.cuda.synchronize()
        times = []
        for _ in range(self.reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        return statistics.median(times) / calls, mode


def rotate(calls: list[Callable[[], Any]]) -> Callable[[], None]:
    def run() -> None:
        for c in calls:
            c()

    return run


def copies_for(bytes_per_copy: int, target: int, cap: int = 64) -> int:
    """How many distinct copies make one timed pass larger than L2 (H200: 50 MB)."""
    return max(1, min(cap, math.ceil(target / max(bytes_per_copy, 1))))


def random_gguf_blocks(torch: Any, kind: str, rows: int, cols: int, device: str = "cpu", seed: int = 0) -> Any:
    """uint8 [rows, row bytes] of ``kind`` (a traits-table name): random codes and scale bytes,
    the fp16 fields (d, dmin, m) small and positive, so the weights are finite and about as
    large as a trained model's (|w| < ~0.05 for Q4_K and Q6_K). Random weights, as the e2e HF
    model has: for speed and memory, not for answers."""
    from localllm.quant import gguf_formats as gf

    f = gf.fmt(kind)
    nb = cols // f.block_weights
    gen = torch.Generator(device=device).manual_seed(seed)
    raw = torch.randint(0, 256, (rows, nb, f.block_bytes), dtype=torch.uint8, device=device, generator=gen)
    offset = 0
    for field in f.fields:
        if field.name in ("d", "dmin", "m"):
            d = (torch.rand(rows, nb, 1, device=device, generator=gen) * 4e-5 + 1e-5).half()
            raw[:, :, offset:offset + 2] = d.view(torch.uint8)
        elif field.name == "e":  # MXFP4's E8M0 exponent: 2^-7 .. 2^-5
            raw[:, :, offset] = torch.randint(120, 123, (rows, nb), dtype=torch.uint8, device=device, generator=gen)
        offset += field.nbytes
    return raw.view(rows, nb * f.block_bytes)


# --- sections --------------------------------------------------------------------------------------


def section_env(out: dict[str, Any], torch: Any, device: str) -> None:
    import triton

    out.update(
        python=sys.version.split()[0],
        platform=platform.platform(),
        torch=torch.__version__,
        triton=triton.__version__,
        cuda=torch.version.cuda,
        triton_interpret=os.environ.get("TRITON_INTERPRET"),
    )
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        out.update(
            device=p.name,
            capability=f"{p.major}.{p.minor}",
            sms=p.multi_processor_count,
            memory_gib=round(p.total_memory / 2**30, 1),
            l2_mib=round(getattr(p, "L2_cache_size", 0) / 2**20, 1),
        )
    try:
        out["git_head"] = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except Exception:  # noqa: BLE001
        pass


def section_bandwidth(out: dict[str, Any], torch: Any, device: str, smoke: bool) -> float:
    n = (1 << 20) if smoke else (1 << 30)  # bytes per buffer
    src = torch.empty(n // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(3 if smoke else 15):
        if device == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            dst.copy_(src)
            e.record()
            e.synchronize()
            best = min(best, s.elapsed_time(e) / 1e3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t0)
    bw = 2 * n / best
    out.update(copy_bytes=n, peak_gbps=round(bw / 1e9, 1), method="device copy, read + write bytes, best of runs")
    del src, dst
    return bw


def section_kernels(out: dict[str, Any], torch: Any, device: str, smoke: bool, peak_bw: float, reps: int) -> None:
    import torch.nn.functional as F

    from localllm.kernels import _triton as kt
    from localllm.kernels.activation import silu_and_mul_ref, silu_and_mul_triton
    from localllm.kernels.awq_gemm import awq_gemm, awq_gemm_ref, awq_gemm_triton, awq_pack
    from localllm.kernels.fp8_gemm import _scaled_mm_path, fp8_w8a8_gemm_ref, fp8_w8a8_gemm_triton
    from localllm.kernels.int8_gemm import (
        _int_mm_path,
        int8_w8a8_gemm_ref,
        int8_w8a8_gemm_triton,
        int8_w8a16_gemm_ref,
        int8_w8a16_gemm_triton,
    )
    from localllm.kernels.paged_attention import paged_attention_ref, paged_attention_triton
    from localllm.kernels.rmsnorm import rms_norm_ref, rms_norm_triton
    from localllm.kernels.rotary_kv import rotary_and_store_kv_ref, rotary_and_store_kv_triton

    timer = Timer(torch, device, reps)
    l2_target = (1 << 20) if smoke else (256 << 20)
    act = torch.float32 if smoke else torch.bfloat16
    res = out.setdefault("results", {})
    out["peak_gbps_used"] = round(peak_bw / 1e9, 1)

    def roofline(bytes_moved: float, us: float) -> dict[str, Any]:
        gbps = bytes_moved / (us * 1e-6) / 1e9
        return {"bytes": int(bytes_moved), "achieved_gbps": round(gbps, 1),
                "frac_of_peak_bw": round(gbps * 1e9 / peak_bw, 3),
                "roofline_us": round(bytes_moved / peak_bw * 1e6, 2)}  # fmt: skip

    # -- decode attention over the paged cache (Llama-3.1-8B heads) --
    H, KVH, D, BS = (4, 2, 64, 16) if smoke else (32, 8, 128, 16)

    def decode_attention(batch: int, ctx: int, fp8: bool) -> dict[str, Any]:
        elt = 1 if fp8 else 2
        kv_bytes = batch * ctx * KVH * D * 2 * (elt if not smoke else 4)
        n_copies = copies_for(kv_bytes, l2_target, cap=16)
        blocks_per_seq = -(-ctx // BS)
        num_blocks = n_copies * batch * blocks_per_seq
        cache_dtype = torch.float8_e4m3fn if fp8 else act
        k_cache = torch.randn(num_blocks, BS, KVH, D, device=device, dtype=act).to(cache_dtype)
        v_cache = torch.randn(num_blocks, BS, KVH, D, device=device, dtype=act).to(cache_dtype)
        q = torch.randn(batch, H, D, device=device, dtype=act)
        qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
        seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        perm = torch.randperm(num_blocks, device=device).to(torch.int32).view(n_copies, batch, blocks_per_seq)
        scales = dict(k_scale=torch.tensor([0.05], device=device), v_scale=torch.tensor([0.05], device=device)) if fp8 else {}
        common = (q, k_cache, v_cache, qsl, seq_lens)

        def triton_call(i: int, splits: int | None) -> Callable[[], Any]:
            return lambda: paged_attention_triton(*common, perm[i], D**-0.5, batch, **scales, num_splits=splits)

        r: dict[str, Any] = {"batch": batch, "ctx": ctx, "heads": H, "kv_heads": KVH, "head_dim": D,
                             "kv_dtype": "fp8_e4m3" if fp8 else str(act), "copies": n_copies}  # fmt: skip
        us, mode = timer(rotate([triton_call(i, None) for i in range(n_copies)]), calls=n_copies)
        bytes_moved = kv_bytes + 2 * q.numel() * q.element_size()
        r.update(us=round(us, 2), mode=mode, **roofline(bytes_moved, us))
        us1, _ = timer(rotate([triton_call(i, 1) for i in range(n_copies)]), calls=n_copies)
        r["no_split_us"] = round(us1, 2)
        if not fp8:
            # Eager baselines: SDPA over a dense (unpaged) KV, and the paged reference.
            kd = torch.randn(batch, KVH, ctx, D, device=device, dtype=act)
            vd = torch.randn_like(kd)
            qd = q[:, :, None, :]
            sdpa_us, sdpa_mode = timer(lambda: F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True))
            r.update(sdpa_dense_us=round(sdpa_us, 2), sdpa_mode=sdpa_mode, speedup_vs_sdpa=round(sdpa_us / us, 2))
            ref_us, _ = timer(lambda: paged_attention_ref(*common, perm[0], D**-0.5, batch), graph=False)
            r.update(paged_ref_us=round(ref_us, 2), speedup=round(ref_us / us, 2))
            # Agreement with the reference on one copy.
            a = triton_call(0, None)()
            b = paged_attention_ref(*common, perm[0], D**-0.5, batch)
            r["max_abs_err_vs_ref"] = float((a.float() - b.float()).abs().max())
        return r

    ctx8k = 64 if smoke else 8192
    for batch in (1, 16):
        case(res, f"decode_attention_b{batch}_ctx{ctx8k}", lambda b=batch: decode_attention(b, ctx8k, False))
    case(res, f"decode_attention_fp8kv_b1_ctx{ctx8k}", lambda: decode_attention(1, ctx8k, True))

    def prefill_attention(seq: int) -> dict[str, Any]:
        blocks = -(-seq // BS)
        k_cache = torch.randn(blocks, BS, KVH, D, device=device, dtype=act)
        v_cache = torch.randn_like(k_cache)
        q = torch.randn(seq, H, D, device=device, dtype=act)
        qsl = torch.tensor([0, seq], dtype=torch.int32, device=device)
        seq_lens = torch.tensor([seq], dtype=torch.int32, device=device)
        table = torch.arange(blocks, dtype=torch.int32, device=device)[None]
        us, mode = timer(lambda: paged_attention_triton(q, k_cache, v_cache, qsl, seq_lens, table, D**-0.5, 0))
        flops = 4 * seq * seq * H * D / 2  # causal half of QK^T and PV
        kd = k_cache.flatten(0, 1)[:seq].transpose(0, 1)[None]
        vd = v_cache.flatten(0, 1)[:seq].transpose(0, 1)[None]
        qd = q.transpose(0, 1)[None]
        sdpa_us, _ = timer(lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True))
        return {"seq": seq, "us": round(us, 2), "mode": mode, "tflops": round(flops / us / 1e6, 1),
                "sdpa_us": round(sdpa_us, 2), "sdpa_tflops": round(flops / sdpa_us / 1e6, 1),
                "speedup_vs_sdpa": round(sdpa_us / us, 2)}  # fmt: skip

    case(res, "prefill_attention_4k", lambda: prefill_attention(48 if smoke else 4096))

    # -- AWQ GEMV / GEMM --
    def awq_case(m: int, k: int, n: int, group: int = 128) -> dict[str, Any]:
        group = min(group, k)
        w_bytes = k * n // 2 + (k // group) * n * 2 + (k // group) * (n // 8) * 4
        n_copies = copies_for(w_bytes, l2_target) if m <= 16 else 1
        xdt = torch.float32 if smoke else torch.float16  # AWQ's native activation dtype
        x = torch.randn(m, k, device=device, dtype=xdt)
        ws = []
        for _ in range(n_copies):
            qw = awq_pack(torch.randint(0, 16, (k, n), dtype=torch.int32, device=device))
            qz = awq_pack(torch.randint(0, 16, (k // group, n), dtype=torch.int32, device=device))
            sc = (torch.rand(k // group, n, device=device) * 0.01).half()
            ws.append((qw, qz, sc))
        r: dict[str, Any] = {"m": m, "k": k, "n": n, "group": group, "copies": n_copies}
        us, mode = timer(rotate([lambda w=w: awq_gemm_triton(x, *w, group) for w in ws]), calls=n_copies)
        bytes_moved = w_bytes + x.numel() * x.element_size() + m * n * x.element_size()
        r.update(us=round(us, 2), mode=mode, tflops=round(2 * m * k * n / us / 1e6, 2), **roofline(bytes_moved, us))
        ref_us, _ = timer(rotate([lambda w=w: awq_gemm_ref(x, *w, group) for w in ws]), calls=n_copies)
        dense = [torch.randn(k, n, device=device, dtype=xdt) for _ in range(min(n_copies, 4))]
        dense_us, _ = timer(rotate([lambda d=d: x @ d for d in dense]), calls=len(dense))
        r.update(dequant_matmul_us=round(ref_us, 2), speedup=round(ref_us / us, 2),
                 dense_fp16_us=round(dense_us, 2), speedup_vs_dense=round(dense_us / us, 2))  # fmt: skip
        awq_gemm(x, *ws[0], group)  # the dispatcher's measured choice for this shape
        r["dispatcher_choice"] = {str(key): v for key, v in kt.gemm_choices().items() if key[0] == "awq"}
        r["max_abs_err_vs_ref"] = float((awq_gemm_triton(x, *ws[0], group).float() - awq_gemm_ref(x, *ws[0], group).float()).abs().max())
        return r

    awq_shapes = [(64, 128), (64, 256)] if smoke else [(4096, 4096), (4096, 14336), (14336, 4096)]
    for k, n in awq_shapes:
        case(res, f"awq_gemv_m1_{k}x{n}", lambda k=k, n=n: awq_case(1, k, n))
    case(res, f"awq_gemm_m64_{awq_shapes[1][0]}x{awq_shapes[1][1]}", lambda: awq_case(64, *awq_shapes[1]))
    case(res, f"awq_gemm_m2048_{awq_shapes[1][0]}x{awq_shapes[1][1]}", lambda: awq_case(48 if smoke else 2048, *awq_shapes[1]))

    # -- INT8 and FP8 GEMMs (K=4096, N=14336: Llama-3.1-8B's gate/up) --
    k8, n8 = (64, 96) if smoke else (4096, 14336)
    fp8_ok = device == "cuda" and torch.cuda.get_device_capability() >= (8, 9)

    def w8_case(kind: str, m: int) -> dict[str, Any]:
        w_bytes = k8 * n8
        n_copies = copies_for(w_bytes, l2_target) if m <= 16 else 1
        x = torch.randn(m, k8, device=device, dtype=act)
        if kind == "fp8":
            if not fp8_ok and not smoke:
                return {"skipped": "fp8 needs sm89+"}
            ws = [((torch.randn(n8, k8, device=device) * 50).clamp(-448, 448).to(torch.float8_e4m3fn),
                   torch.rand(n8, device=device) * 0.01) for _ in range(n_copies)]  # fmt: skip
            kernel, ref, alt, alt_name = fp8_w8a8_gemm_triton, fp8_w8a8_gemm_ref, _scaled_mm_path, "scaled_mm"
        else:
            ws = [(torch.randint(-127, 128, (n8, k8), dtype=torch.int8, device=device),
                   torch.rand(n8, device=device) * 0.01) for _ in range(n_copies)]  # fmt: skip
            if kind == "int8_w8a16":
                kernel, ref, alt, alt_name = int8_w8a16_gemm_triton, int8_w8a16_gemm_ref, None, ""
            else:
                kernel, ref, alt, alt_name = int8_w8a8_gemm_triton, int8_w8a8_gemm_ref, _int_mm_path, "int_mm"
        r: dict[str, Any] = {"m": m, "k": k8, "n": n8, "copies": n_copies}
        us, mode = timer(rotate([lambda w=w: kernel(x, *w) for w in ws]), calls=n_copies)
        bytes_moved = w_bytes + m * k8 * x.element_size() + m * n8 * x.element_size()
        r.update(us=round(us, 2), mode=mode, tflops=round(2 * m * k8 * n8 / us / 1e6, 2), **roofline(bytes_moved, us))
        ref_us, _ = timer(rotate([lambda w=w: ref(x, *w) for w in ws]), calls=n_copies)
        r.update(dequant_matmul_us=round(ref_us, 2), speedup=round(ref_us / us, 2))
        if alt is not None and device == "cuda":
            try:
                alt_us, _ = timer(rotate([lambda w=w: alt(x, *w) for w in ws]), calls=n_copies)
                r.update({f"{alt_name}_us": round(alt_us, 2), f"speedup_vs_{alt_name}": round(alt_us / us, 2)})
            except Exception as e:  # noqa: BLE001 - e.g. _int_mm needs M > 16
                r[f"{alt_name}_error"] = f"{type(e).__name__}: {e}"
        dense = [torch.randn(n8, k8, device=device, dtype=act) for _ in range(min(n_copies, 4))]
        dense_us, _ = timer(rotate([lambda d=d: F.linear(x, d) for d in dense]), calls=len(dense))
        r.update(dense_bf16_us=round(dense_us, 2), speedup_vs_dense=round(dense_us / us, 2))
        r["max_abs_err_vs_ref"] = float((kernel(x, *ws[0]).float() - ref(x, *ws[0]).float()).abs().max())
        return r

    for kind in ("int8_w8a16", "int8_w8a8", "fp8"):
        for m in (1, 64, 48 if smoke else 4096):
            case(res, f"{kind}_m{m}_{k8}x{n8}", lambda kind=kind, m=m: w8_case(kind, m))

    # -- GGUF blocks as stored (a Q4_K_M file's two types): decode GEMV and prefill GEMM --
    def gguf_case(kind: str, m: int, k: int, n: int) -> dict[str, Any]:
        import importlib

        gl = importlib.import_module("localllm.kernels.gguf_linear")
        from localllm.quant import gguf_formats as gf

        w_bytes = gf.fmt(kind).nbytes(k * n)
        n_copies = copies_for(w_bytes, l2_target) if m <= 16 else 1
        x = torch.randn(m, k, device=device, dtype=act)
        ws = [gl.pack_gguf_blocks(random_gguf_blocks(torch, kind, n, k, device, seed=i), kind) for i in range(n_copies)]
        r: dict[str, Any] = {"type": kind, "m": m, "k": k, "n": n, "copies": n_copies,
                             "bits_per_weight": gf.fmt(kind).bits_per_weight}
        us, mode = timer(rotate([lambda w=w: gl.gguf_linear_triton(x, w) for w in ws]), calls=n_copies)
        bytes_moved = w_bytes + m * k * x.element_size() + m * n * x.element_size()
        r.update(us=round(us, 2), mode=mode, tflops=round(2 * m * k * n / us / 1e6, 2), **roofline(bytes_moved, us))
        ref_us, _ = timer(rotate([lambda w=w: gl.gguf_linear_reference(x, w) for w in ws]), calls=n_copies)
        dense = [torch.randn(n, k, device=device, dtype=act) for _ in range(min(n_copies, 4))]
        dense_us, _ = timer(rotate([lambda d=d: F.linear(x, d) for d in dense]), calls=len(dense))
        r.update(dequant_matmul_us=round(ref_us, 2), speedup=round(ref_us / us, 2),
                 dense_bf16_us=round(dense_us, 2), speedup_vs_dense=round(dense_us / us, 2))  # fmt: skip
        if m > gl.SMALL_M:  # prefill: the dispatcher times the kernel, dequantize-then-cuBLAS and the reference
            dq_us, _ = timer(rotate([lambda w=w: gl.gguf_linear_dequant_mm(x, w) for w in ws]), calls=n_copies)
            r.update(dequant_cublas_us=round(dq_us, 2), dequant_cublas_speedup_vs_dense=round(dense_us / dq_us, 2))
        gl.gguf_linear(x, ws[0])  # the dispatcher's measured choice for this shape
        r["dispatcher_choice"] = {str(key): v for key, v in kt.gemm_choices().items() if key[0] == "gguf"}
        disp_us, _ = timer(rotate([lambda w=w: gl.gguf_linear(x, w) for w in ws]), calls=n_copies)
        r.update(dispatcher_us=round(disp_us, 2), dispatcher_speedup_vs_dense=round(dense_us / disp_us, 2))
        ref = gl.gguf_linear_reference(x.float(), ws[0])
        r["max_rel_err_vs_fp32_ref"] = float((gl.gguf_linear_triton(x, ws[0]).float() - ref).abs().max()
                                             / ref.abs().max().clamp_min(1e-30))
        return r

    g_shapes = [("Q4_K", 256, 512), ("Q6_K", 512, 256)] if smoke else [("Q4_K", 4096, 14336), ("Q6_K", 14336, 4096)]
    for kind, k, n in g_shapes:
        case(res, f"gguf_{kind.lower()}_gemv_m1_{k}x{n}", lambda kind=kind, k=k, n=n: gguf_case(kind, 1, k, n))
    kind, k, n = g_shapes[0]
    # 4: the GEMV's widest tile; 16 and 64: a batch of decodes (one dot tile, split-K); prefill
    for m in (4, 16, 64, 96 if smoke else 2048):
        path = "gemv" if m <= 4 else "gemm"
        case(res, f"gguf_{kind.lower()}_{path}_m{m}_{k}x{n}", lambda m=m: gguf_case(kind, m, k, n))

    # -- a mixture of experts' layer, experts as stored (quant/gguf_experts_cuda.py) --
    def moe_case(shape: str, tokens: int) -> dict[str, Any]:
        from localllm.quant import gguf_formats as gf
        from localllm.quant.gguf import GGUFBlocks
        from localllm.quant.gguf_experts_cuda import GGUFExpertsCUDA

        E, top, H, inter, gate_kind, down_kind, limit, alpha = MOE_SHAPES[shape]
        if smoke:
            E, H, inter = 8, 256, 256
        experts = GGUFExpertsCUDA(E, H, inter, gf.fmt(gate_kind).type_id, gf.fmt(gate_kind).type_id,
                                  gf.fmt(down_kind).type_id).to(device)  # fmt: skip
        for param, shard, kind, rows, cols in (("w13", 0, gate_kind, inter, H), ("w13", 1, gate_kind, inter, H),
                                               ("w2", None, down_kind, H, inter)):  # fmt: skip
            data = random_gguf_blocks(torch, kind, E * rows, cols, device, seed=3 + (shard or 0))
            experts.load_weight(param, GGUFBlocks(gf.fmt(kind).type_id, data), shard)
        gen = torch.Generator(device=device).manual_seed(tokens)
        ids = torch.rand(tokens, E, device=device, generator=gen).topk(top, dim=1).indices
        weights = torch.softmax(torch.randn(tokens, top, device=device, generator=gen), 1)
        x = torch.randn(tokens, H, device=device, dtype=act) * 0.5
        fn = lambda: experts(x, weights, ids, None, None, limit, alpha)  # noqa: E731
        us, mode = timer(fn)
        touched = int(ids.unique().numel())
        per_expert = gf.fmt(gate_kind).nbytes(2 * inter * H) + gf.fmt(down_kind).nbytes(H * inter)
        r: dict[str, Any] = {"experts": E, "top_k": top, "hidden": H, "intermediate": inter, "tokens": tokens,
                             "types": [gate_kind, down_kind], "experts_touched": touched,
                             "us": round(us, 2), "mode": mode,
                             "path": gl_grouped_path(tokens * top, E), **roofline(touched * per_expert, us)}
        # the same layer's experts dequantized to fp32 and multiplied per expert in torch: the
        # kernels' reference (the CPU's composition), and where the GPU's numbers must land
        w13, w2 = experts.dequantize()
        ref = torch.zeros(tokens, H, device=device)
        xf = x.float()
        from localllm.models.moe import activate

        for t in range(tokens):
            for j in range(top):
                e = int(ids[t, j])
                h = activate((xf[t:t + 1] @ w13[e].T), limit, alpha)
                ref[t] += weights[t, j] * (h.to(act).float() @ w2[e].T)[0]
        got = fn().float()
        r["max_rel_err_vs_fp32_ref"] = float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
        return r

    from localllm.kernels.gguf_linear import grouped_path as gl_grouped_path

    for shape in MOE_SHAPES:
        for tokens in ((1, 16) if smoke else (1, 16, 64, 256)):
            case(res, f"moe_{shape}_t{tokens}", lambda shape=shape, tokens=tokens: moe_case(shape, tokens))

    # -- --deterministic's float GEMM: a row's bits the same alone and in any batch --
    def invariant_case(m: int) -> dict[str, Any]:
        from localllm.kernels.invariant_gemm import invariant_gemm_triton

        k, n = (256, 512) if smoke else (4096, 14336)
        w = torch.randn(n, k, device=device, dtype=act) * 0.02
        x = torch.randn(m, k, device=device, dtype=act)
        gemm = lambda a: invariant_gemm_triton(a, w, None, act)  # noqa: E731
        y = gemm(x)
        alone = torch.cat([gemm(x[i:i + 1]) for i in range(0, m, max(1, m // 4))])
        batched_rows = y[0:m:max(1, m // 4)]
        us, mode = timer(lambda: gemm(x))
        cublas_us, _ = timer(lambda: F.linear(x, w))
        cublas = F.linear(x, w)
        # cuBLAS's own rows: are they the same alone and batched here? (what --deterministic avoids)
        cublas_alone = torch.cat([F.linear(x[i:i + 1], w) for i in range(0, m, max(1, m // 4))])
        ref = x.float() @ w.float().T
        return {"m": m, "k": k, "n": n, "us": round(us, 2), "mode": mode, "cublas_us": round(cublas_us, 2),
                "speedup": round(cublas_us / us, 2), "rows_equal_alone_and_batched": bool(torch.equal(alone, batched_rows)),
                "cublas_rows_equal_alone_and_batched": bool(torch.equal(cublas_alone, cublas[0:m:max(1, m // 4)])),
                "max_rel_err_vs_fp32": float((y.float() - ref).abs().max() / ref.abs().max()),
                **roofline(n * k * w.element_size(), us)}  # fmt: skip

    for m in (1, 40, 512):
        case(res, f"invariant_gemm_m{m}", lambda m=m: invariant_case(m))

    # -- fused elementwise kernels at a 4096-token prefill --
    T, HID = (8, 64) if smoke else (4096, 4096)

    def elementwise(name: str) -> dict[str, Any]:
        if name == "rms_norm_residual":
            x = torch.randn(T, HID, device=device, dtype=act)
            r_ = torch.randn_like(x)
            w = torch.randn(HID, device=device, dtype=act)
            fn, ref = (lambda: rms_norm_triton(x, w, 1e-5, r_)), (lambda: rms_norm_ref(x, w, 1e-5, r_))
            bytes_moved = 4 * x.numel() * x.element_size()
        elif name == "silu_and_mul":
            x = torch.randn(T, 2 * 3 * HID, device=device, dtype=act)
            fn, ref = (lambda: silu_and_mul_triton(x)), (lambda: silu_and_mul_ref(x))
            bytes_moved = 1.5 * x.numel() * x.element_size()
        else:
            q = torch.randn(T, H, D, device=device, dtype=act)
            k = torch.randn(T, KVH, D, device=device, dtype=act)
            v = torch.randn_like(k)
            pos = torch.arange(T, device=device)
            half = torch.arange(0, D, 2, device=device).float() / D
            freqs = pos.float()[:, None] / (500000.0 ** half)[None, :]
            cos_sin = torch.cat([freqs.cos(), freqs.sin()], -1)
            kc = torch.zeros(-(-T // BS), BS, KVH, D, device=device, dtype=act)
            vc = torch.zeros_like(kc)
            slots = torch.arange(T, device=device)
            fn = lambda: rotary_and_store_kv_triton(q, k, v, pos, cos_sin, kc, vc, slots)  # noqa: E731
            ref = lambda: rotary_and_store_kv_ref(q, k, v, pos, cos_sin, kc, vc, slots)  # noqa: E731
            bytes_moved = 2 * (q.numel() + 2 * k.numel()) * q.element_size()
        us, mode = timer(fn)
        ref_us, _ = timer(ref, graph=name != "rotary_and_store_kv")  # the ref syncs on padding slots
        return {"tokens": T, "us": round(us, 2), "mode": mode, "torch_us": round(ref_us, 2),
                "speedup": round(ref_us / us, 2), **roofline(bytes_moved, us)}  # fmt: skip

    for name in ("rms_norm_residual", "silu_and_mul", "rotary_and_store_kv"):
        case(res, name, lambda name=name: elementwise(name))
    out["gemm_backend_choices"] = {str(k): v for k, v in kt.gemm_choices().items()}


def section_tests(out: dict[str, Any], timeout: float, pytest_args: str = "tests/kernels") -> None:
    """``pytest`` of ``pytest_args`` (targets and options, split on spaces) on CUDA."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env["TRITON_INTERPRET"] = "0"  # tests/conftest.py only sets it when absent
    cmd = [sys.executable, "-m", "pytest", *pytest_args.split(), "-q", "-rfEs", "-p", "no:cacheprovider"]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        text, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        raw = (e.stdout or b"") + (e.stderr or b"")
        text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
        rc = "timeout"
    out.update(command=" ".join(cmd), returncode=rc, wall_s=round(time.monotonic() - t0, 1), tail=text[-6000:])
    summary = [line for line in text.splitlines() if " passed" in line or " failed" in line or " error" in line]
    out["summary"] = summary[-1] if summary else None
    out["ok"] = rc == 0


# A MoE layer's experts as the GGUF files hold them: (experts, top-k, hidden, expert width,
# gate/up type, down type, SwiGLU clamp limit, alpha): Qwen3-30B-A3B's Q4_K_M (down Q6_K in
# the "more bits" layers) and gpt-oss-20b's MXFP4 with its clamped SwiGLU.
MOE_SHAPES = {
    "qwen3_30b_a3b": (128, 8, 2048, 768, "Q4_K", "Q6_K", 0.0, 1.0),
    "gpt_oss_20b": (32, 4, 2880, 2880, "MXFP4", "MXFP4", 7.0, 1.702),
}

LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "hidden_act": "silu",
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}


def build_random_llama(torch: Any, folder: Path, cfg: dict[str, Any], device: str, dtype: Any) -> dict[str, Any]:
    """Writes config.json, sharded safetensors (random N(0, 0.02) weights, norms at 1) and a
    word-level tokenizer with one token per id, so token-id prompts decode to text."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    vocab = {f"t{i}": i for i in range(cfg["vocab_size"])}
    vocab["<|begin_of_text|>"] = cfg["bos_token_id"]
    vocab["<|end_of_text|>"] = cfg["eos_token_id"]
    del vocab[f"t{cfg['bos_token_id']}"], vocab[f"t{cfg['eos_token_id']}"]
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "add_bos_token": False}))  # fmt: skip
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}))  # fmt: skip

    h, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    qh, kvh, v = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape: int) -> Any:
        return (torch.randn(*shape, device=device, generator=gen, dtype=torch.float32) * 0.02).to(dtype).cpu()

    shards: list[dict[str, Any]] = [{"model.embed_tokens.weight": rand(v, h)}]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shards.append({
            p + "input_layernorm.weight": torch.ones(h, dtype=dtype),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype),
            p + "self_attn.q_proj.weight": rand(qh * hd, h),
            p + "self_attn.k_proj.weight": rand(kvh * hd, h),
            p + "self_attn.v_proj.weight": rand(kvh * hd, h),
            p + "self_attn.o_proj.weight": rand(h, qh * hd),
            p + "mlp.gate_proj.weight": rand(inter, h),
            p + "mlp.up_proj.weight": rand(inter, h),
            p + "mlp.down_proj.weight": rand(h, inter),
        })  # fmt: skip
    shards.append({"model.norm.weight": torch.ones(h, dtype=dtype), "lm_head.weight": rand(v, h)})
    # Pack layers into ~2 GB files, each written as soon as it is full.
    weight_map: dict[str, str] = {}
    files: list[dict[str, Any]] = []
    current: dict[str, Any] = {}
    size = 0
    total = 0

    def flush() -> None:
        nonlocal current, size
        if current:
            name = f"model-{len(files) + 1:05d}.safetensors"
            save_file(current, str(folder / name), metadata={"format": "pt"})
            files.append({"name": name})
            weight_map.update({k: name for k in current})
            current, size = {}, 0

    for shard in shards:
        for name, t in shard.items():
            current[name] = t
            size += t.numel() * t.element_size()
            total += t.numel() * t.element_size()
        if size > (2 << 30):
            flush()
    flush()
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    return {"folder": str(folder), "bytes": total, "files": len(files)}


def build_q4_k_m_gguf(torch: Any, path: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    """Writes ``cfg``'s model as a GGUF laid out like llama.cpp's Q4_K_M (its recipe as
    localllm.hardware.sizing applies it: Q4_K linears, attn_v and ffn_down Q6_K in the layers
    ``_more_bits`` picks, the head Q6_K, token_embd Q4_K, F32 norms) with random blocks
    (``random_gguf_blocks``) and a SentencePiece vocabulary of ``t<i>`` pieces, so token-id
    prompts run. No quantizer is needed: the blocks are written as they would be stored."""
    import gguf
    import numpy as np

    from localllm.hardware.sizing import _more_bits  # the recipe's "more bits" layers (one place knows it)

    h, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    qh, kvh, v = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]
    layers = cfg["num_hidden_layers"]
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("random-llama-q4_k_m")
    w.add_context_length(8192)
    w.add_embedding_length(h)
    w.add_feed_forward_length(inter)
    w.add_block_count(layers)
    w.add_head_count(qh)
    w.add_head_count_kv(kvh)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(["<unk>", "<s>", "</s>"] + [f"\u2581t{i}" for i in range(3, v)])
    w.add_token_scores([0.0, 0.0, 0.0] + [-float(i) for i in range(3, v)])
    w.add_token_types([2, 3, 3] + [1] * (v - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    by_type: dict[str, int] = {}
    seed = 0

    def blocks(name: str, kind: str, rows: int, cols: int) -> None:
        nonlocal seed
        seed += 1
        data = random_gguf_blocks(torch, kind, rows, cols, seed=seed).numpy()
        w.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[kind])
        by_type[kind] = by_type.get(kind, 0) + data.nbytes

    def norm(name: str) -> None:
        w.add_tensor(name, np.ones(h, dtype=np.float32))
        by_type["F32"] = by_type.get("F32", 0) + h * 4

    blocks("token_embd.weight", "Q4_K", v, h)
    norm("output_norm.weight")
    blocks("output.weight", "Q6_K", v, h)
    for i in range(layers):
        more = "Q6_K" if _more_bits(i, layers) else "Q4_K"
        norm(f"blk.{i}.attn_norm.weight")
        norm(f"blk.{i}.ffn_norm.weight")
        blocks(f"blk.{i}.attn_q.weight", "Q4_K", qh * hd, h)
        blocks(f"blk.{i}.attn_k.weight", "Q4_K", kvh * hd, h)
        blocks(f"blk.{i}.attn_v.weight", more, kvh * hd, h)
        blocks(f"blk.{i}.attn_output.weight", "Q4_K", h, qh * hd)
        blocks(f"blk.{i}.ffn_gate.weight", "Q4_K", inter, h)
        blocks(f"blk.{i}.ffn_up.weight", "Q4_K", inter, h)
        blocks(f"blk.{i}.ffn_down.weight", more, h, inter)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {"file": str(path), "file_bytes": path.stat().st_size, "tensor_bytes": sum(by_type.values()),
            "by_type": by_type, "layers": layers}


def decode_weight_bytes(cfg: dict[str, Any], quant: str, group: int = 128) -> float:
    """Bytes one decode step must read: every linear's weights in the quantized format, the
    bf16 lm_head, norms; the embedding costs one row."""
    h, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    qh, kvh, v, layers = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"], cfg["num_hidden_layers"]
    linears = [(h, (qh + 2 * kvh) * hd), (qh * hd, h), (h, 2 * inter), (inter, h)]  # (in, out)
    per_layer = 0.0
    for k, n in linears:
        if quant in ("awq", "rtn4"):
            g = group if k % group == 0 else 64
            per_layer += k * n / 2 + (k // g) * n * 2 + (k // g) * n / 2
        elif quant in ("fp8", "int8", "int8-w8a8"):
            per_layer += k * n + n * 4
        else:
            per_layer += k * n * 2
    per_layer += 2 * h * 2
    return layers * per_layer + v * h * 2 + h * 2 + h * 2


def timed_greedy(torch: Any, llm: Any, prompts: list[list[int]], max_tokens: int) -> tuple[list[Any], float]:
    """``llm.generate`` of greedy replies of exactly ``max_tokens`` (EOS ignored), and its wall
    time with the device's queue drained at both ends."""
    from localllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    cuda = llm.engine.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate(prompts, sp)
    if cuda:
        torch.cuda.synchronize()
    return outs, time.perf_counter() - t


def section_e2e(
    out: dict[str, Any], torch: Any, device: str, smoke: bool, peak_bw: float, quants: list[str],
    layers: int, deadline: Deadline, with_hf: bool, save: Callable[[], None],
) -> None:  # fmt: skip
    from localllm import LLM

    cfg = dict(LLAMA31_8B, num_hidden_layers=layers)
    if smoke:
        cfg.update(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, bos_token_id=1, eos_token_id=2)  # fmt: skip
    dtype_name = "float32" if smoke else "bfloat16"
    dtype = getattr(torch, dtype_name)
    folder = Path(os.environ.get("TMPDIR", "/tmp")) / "localllm_gpu_check" / ("tiny" if smoke else f"llama31_8b_{layers}l")
    if with_hf or any(q != "gguf" and q not in MOE_E2E for q in quants):  # the GGUF runs write their own files
        t0 = time.monotonic()
        out["model"] = build_random_llama(torch, folder, cfg, device, dtype)
        out["model"]["layers"] = cfg["num_hidden_layers"]
        out["model"]["build_s"] = round(time.monotonic() - t0, 1)
    prompt_len = 16 if smoke else 128
    short, long_ = (2, 10) if smoke else (16, 144)
    gen = torch.Generator().manual_seed(1)

    def prompts(n: int, vocab: int = cfg["vocab_size"]) -> list[list[int]]:
        return torch.randint(1000 if not smoke else 10, vocab - 10, (n, prompt_len), generator=gen).tolist()

    def timed(llm: Any, batch: int, max_tokens: int) -> tuple[float, int]:
        outs, seconds = timed_greedy(torch, llm, prompts(batch, llm.engine.tokenizer.vocab_size), max_tokens)
        return seconds, sum(len(o.outputs[0].token_ids) for o in outs)

    results = out.setdefault("runs", {})
    # Runs that are not a weight quantization: bf16 weights with another engine option; "gguf":
    # the same shapes as a Q4_K_M GGUF file, the precision left to the planner (which must keep
    # the file's blocks: its plan, VRAM and decode speed are what the case reports).
    variants: dict[str, dict[str, Any]] = {"kv-fp8": {"quant": "none", "kv_cache_dtype": "fp8"},
                                           "no-graphs": {"quant": "none", "use_cuda_graphs": False}, "gguf": {},
                                           **{q: {} for q in MOE_E2E}}
    gguf_file: dict[str, Any] | None = None
    for quant in quants:
        if deadline.left() < (20 if smoke else 60):
            results[quant] = {"skipped": f"time budget ({deadline.left():.0f} s left)"}
            continue
        r: dict[str, Any] = {}
        results[quant] = r
        try:
            t = time.monotonic()
            options = variants.get(quant, {"quant": quant})
            model_path = folder
            if quant in MOE_E2E:
                gguf_file = build_moe_gguf(folder.parent, quant, smoke)
                r["file"] = dict(gguf_file, build_s=round(time.monotonic() - t, 1))
                model_path = Path(gguf_file["file"])
                if device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                t = time.monotonic()
            elif quant == "gguf":
                # K-quant rows are whole 256-weight super-blocks: the smoke model widens to 256
                gcfg = dict(cfg, hidden_size=256, intermediate_size=512, head_dim=64) if smoke else cfg
                gguf_file = build_q4_k_m_gguf(torch, folder.parent / f"{folder.name}.Q4_K_M.gguf", gcfg)
                r["file"] = dict(gguf_file, build_s=round(time.monotonic() - t, 1))
                model_path = Path(gguf_file["file"])
                if device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                t = time.monotonic()
            # a GGUF file: the plan's own dtype (the file's blocks, activations in the compute dtype)
            gguf_run = quant == "gguf" or quant in MOE_E2E
            llm = LLM(model=str(model_path), device=device, dtype=dtype_name if not gguf_run else "auto",
                      max_model_len=1024 if not smoke else 128, **options)  # fmt: skip
            r["options"] = options
            r["load_s"] = round(time.monotonic() - t, 1)
            if gguf_run:
                r.update(gguf_memory(torch, llm, device, gguf_file))
            timed(llm, 1, short)  # warm-up: compiles, autotunes, captures graphs
            t_short, _ = timed(llm, 1, short)
            t_long, n_long = timed(llm, 1, long_)
            per_tok = (t_long - t_short) / (long_ - short)
            if quant in MOE_E2E:
                assert gguf_file is not None
                read = gguf_file["decode_bytes"]
            else:
                read = decode_weight_bytes(cfg, quant) if quant != "gguf" else gguf_decode_bytes(gguf_file, cfg)
            roof = read / peak_bw
            r["batch1"] = {"decode_tok_s": round(1 / per_tok, 1), "ms_per_token": round(per_tok * 1e3, 3),
                           "e2e_tok_s": round(n_long / t_long, 1), "roofline_ms_per_token": round(roof * 1e3, 3),
                           "frac_of_roofline": round(roof / per_tok, 3),
                           "weight_bytes_per_token": int(read)}  # fmt: skip
            if deadline.left() > (5 if smoke else 20):
                b = 8 if smoke else 64
                timed(llm, b, short)
                t_b, n_b = timed(llm, b, long_)
                r[f"batch{b}"] = {"tok_s": round(n_b / t_b, 1), "wall_s": round(t_b, 2), "tokens": n_b}
            if gguf_run and device == "cuda":
                r["vram"]["max_allocated_bytes"] = torch.cuda.max_memory_allocated()
            print(f"   e2e {quant}: {r}", flush=True)
        except Exception as e:  # noqa: BLE001
            r["error"] = f"{type(e).__name__}: {e}"
            r["traceback"] = traceback.format_exc()[-3000:]
            print(f"   e2e {quant} failed: {r['error']}", flush=True)
        finally:
            llm = None
            gc.collect()  # the engine holds CUDA graphs and the KV pool
            if device == "cuda":
                torch.cuda.empty_cache()
            save()

    if with_hf and deadline.left() > (10 if smoke else 60):
        try:
            results["hf_transformers"] = hf_compare(torch, folder, device, dtype, prompts, short, long_, smoke)
        except Exception as e:  # noqa: BLE001
            results["hf_transformers"] = {"error": f"{type(e).__name__}: {e}"}


# MoE-shaped GGUF files for the e2e section (bench/moe_shaped.py's layouts at the real models'
# widths, fewer layers, a 32k byte-level vocabulary): Qwen3-30B-A3B's Q4_K_M and gpt-oss-20b's MXFP4.
MOE_E2E = {
    "gguf-moe": ("qwen3moe", 2048, 32, 4, 128, 6, 128, 8, 768),
    "gguf-oss": ("gpt-oss", 2880, 64, 8, 64, 4, 32, 4, 2880),
}


def build_moe_gguf(folder: Path, quant: str, smoke: bool) -> dict[str, Any]:
    """Writes (once) the ``MOE_E2E[quant]`` file and returns its bytes: all tensors, and what a
    one-token decode reads (every tensor but the embedding, each layer's experts at top-k of E)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import moe_shaped
    from localllm.quant import gguf_formats as gf

    arch, hidden, heads, kv_heads, head_dim, layers, experts, used, width = MOE_E2E[quant]
    vocab = 32000
    if smoke:
        hidden, heads, kv_heads, head_dim, layers, experts, used, width, vocab = 256, 4, 2, 64, 2, 8, 2, 256, 1024
    shape = moe_shaped.Shape(arch, hidden, heads, kv_heads, head_dim, layers, experts, used, width)
    path = folder / f"{quant}-{layers}l.gguf"
    if not path.is_file():
        moe_shaped.write_file(path, shape, moe_shaped.synthetic_vocab(vocab))
    total = read = 0.0
    for name, kind, dims in moe_shaped._tensors(shape, vocab):
        n = math.prod(dims)
        nbytes = n * 4 if kind == "F32" else gf.fmt(kind).nbytes(n)
        total += nbytes
        if name != "token_embd.weight":
            read += nbytes * (used / experts if "_exps." in name else 1)
    return {"file": str(path), "file_bytes": path.stat().st_size, "tensor_bytes": int(total),
            "decode_bytes": int(read), "layers": layers, "experts": experts, "top_k": used, "vocab": vocab}


def gguf_memory(torch: Any, llm: Any, device: str, file: dict[str, Any] | None) -> dict[str, Any]:
    """What a GGUF run holds against its file: the plan's precision and weight bytes, the
    weights the model holds on the device, and (CUDA) what torch's allocator holds."""
    from localllm.quant.methods import weight_bytes

    assert file is not None
    engine = llm.engine
    held = weight_bytes(engine.runner.model)
    kinds = sorted({type(m).__name__ for m in engine.runner.model.modules()
                    if getattr(m, "method", "") == "gguf" or type(m).__name__.startswith("GGUFExperts")})
    r: dict[str, Any] = {
        "precision": engine.precision, "plan_quant": engine.plan.quant, "plan_reason": engine.plan.precision_reason,
        "modules": kinds,
        "vram": {"file_tensor_bytes": file["tensor_bytes"], "plan_weight_bytes": engine.plan.weight_bytes,
                 "held_weight_bytes": held, "held_over_file": round(held / file["tensor_bytes"], 4),
                 "kv_pool_bytes": engine.runner.kv_bytes},
    }
    if device == "cuda":
        r["vram"].update(allocated_after_load_bytes=torch.cuda.memory_allocated(),
                         max_allocated_during_load_bytes=torch.cuda.max_memory_allocated())
    return r


def gguf_decode_bytes(file: dict[str, Any] | None, cfg: dict[str, Any]) -> float:
    """Bytes one decode step reads from a GGUF run's weights: every tensor's blocks but the
    untied embedding's (one row of it is looked up)."""
    assert file is not None
    return file["tensor_bytes"] - cfg["vocab_size"] * cfg["hidden_size"] * 144 / 256  # token_embd is Q4_K


def hf_compare(
    torch: Any, folder: Path, device: str, dtype: Any, prompts: Callable[[int], list[list[int]]],
    short: int, long_: int, smoke: bool,
) -> dict[str, Any]:  # fmt: skip
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        return {"skipped": "transformers not installed"}
    import transformers

    try:
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
    except TypeError:  # transformers < 4.56 names it torch_dtype
        model = AutoModelForCausalLM.from_pretrained(str(folder), torch_dtype=dtype)
    model = model.to(device).eval()
    r: dict[str, Any] = {"version": transformers.__version__}

    def run(batch: int, new: int) -> float:
        ids = torch.tensor(prompts(batch), device=device)
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=0)  # fmt: skip
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    run(1, short)
    t_s, t_l = run(1, short), run(1, long_)
    r["batch1_decode_tok_s"] = round((long_ - short) / (t_l - t_s), 1)
    b = 8 if smoke else 64
    t_b = run(b, long_)
    r[f"batch{b}_tok_s"] = round(b * long_ / t_b, 1)
    return r


# --- main ------------------------------------------------------------------------------------------


_ALIAS = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location(
    "localllm.kernels", {init!r}, submodule_search_locations=[{pkg!r}])
mod = importlib.util.module_from_spec(spec)
sys.modules["localllm.kernels"] = mod
spec.loader.exec_module(mod)
"""


def ensure_package() -> str:
    """``localllm.kernels`` maps to kernels/ only through the package install; install the
    checkout in editable mode when the machine has not, and as a last resort alias the
    module (in this process, and through a sitecustomize for the pytest subprocess)."""
    import importlib.util

    sys.path.insert(0, str(REPO))

    def found() -> bool:
        # whether the package maps, not whether its dependencies import (check_imports says that)
        try:
            return importlib.util.find_spec("localllm.kernels") is not None
        except ImportError:
            return False

    if found():
        return "importable"
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--no-build-isolation", "-e", str(REPO)],
            capture_output=True, text=True, timeout=90,
        )  # fmt: skip
        pip_error = proc.stderr[-300:]
    except (OSError, subprocess.TimeoutExpired) as e:
        pip_error = f"{type(e).__name__}: {e}"
    import importlib

    importlib.invalidate_caches()
    for name in [m for m in sys.modules if m == "localllm" or m.startswith("localllm.")]:
        del sys.modules[name]
    import site

    for d in site.getsitepackages():  # pick up the editable finder's .pth without a restart
        site.addsitedir(d)
    if found():
        return "installed (pip -e)"
    code = _ALIAS.format(init=str(REPO / "kernels" / "__init__.py"), pkg=str(REPO / "kernels"))
    alias_dir = Path(os.environ.get("TMPDIR", "/tmp")) / "localllm_gpu_check" / "alias"
    alias_dir.mkdir(parents=True, exist_ok=True)
    (alias_dir / "sitecustomize.py").write_text("import sys\nsys.path.insert(0, %r)\n" % str(REPO) + code)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(alias_dir), os.environ.get("PYTHONPATH")]))
    exec(compile(code, "localllm_alias", "exec"), {})
    import localllm.kernels  # noqa: F401, F811

    return f"aliased (pip -e failed: {pip_error})"


# What the image of the lent H200 lacks that a run imports (the device tool's KINDS.md lists
# what it has): carry these as wheels (docs/kernels.md, "GPU check", says how).
CARRY = ("platformdirs", "gguf")
# Every module a full run imports; --dry-run imports them all, so a missing one shows up here
# rather than after minutes on the GPU. transformers is optional (the HF comparison).
RUN_IMPORTS = (
    "torch", "triton", "numpy", "safetensors.torch", "tokenizers", "jinja2", "psutil", "pytest",
    "localllm.kernels", "localllm.kernels._triton", "localllm.kernels.activation", "localllm.kernels.awq_gemm",
    "localllm.kernels.fp8_gemm", "localllm.kernels.int8_gemm", "localllm.kernels.paged_attention",
    "localllm.kernels.rmsnorm", "localllm.kernels.rotary_kv", "localllm.kernels.tuning", "localllm",
    "localllm.api", "localllm.engine.engine", "gguf", "localllm.kernels.gguf_linear", "localllm.quant.gguf_cuda",
)  # fmt: skip
OPTIONAL_IMPORTS = ("transformers",)


def package_or_error() -> str:
    """``ensure_package()``, or why it failed: the sections that need no localllm still run."""
    try:
        return ensure_package()
    except Exception as e:  # noqa: BLE001 - recorded; the sections report their own failures
        return f"failed: {type(e).__name__}: {e}"


def check_imports() -> dict[str, str]:
    """"ok" or the error, for every module a run imports."""
    import importlib

    found: dict[str, str] = {}
    for name in RUN_IMPORTS + OPTIONAL_IMPORTS:
        try:
            importlib.import_module(name)
            found[name] = "ok"
        except Exception as e:  # noqa: BLE001 - a broken install is as fatal as a missing one
            found[name] = f"{type(e).__name__}: {e}"
    return found


def budget_plan(sections: list[str], budget: float, e2e_quants: int = 7, tests_s: float = 120.0) -> dict[str, float]:
    """Seconds each section may start work in, in order; a section gets what the earlier ones
    left, less what the later ones are promised. e2e needs ~40 s per quantization of the
    8-layer model (load, tune, capture, time) and the model's build first (up to 200 s for
    all seven); the kernel tests ``tests_s`` (``--tests-timeout``; ~2 minutes on a warm cache)."""
    promised = {"env": 5.0, "bandwidth": 10.0, "kernels": 0.0, "tests": tests_s,
                "e2e": min(200.0, 30.0 + 60.0 * e2e_quants)}
    plan = {s: promised[s] for s in sections}
    # a small --budget shrinks every promise alike, so the kernels keep at least 30% of it
    scale = min(1.0, 0.7 * budget / max(sum(plan.values()), 1.0))
    return {s: round(v * scale, 1) for s, v in plan.items()}


def main() -> int:
    global _REPORT, _CASES_UNTIL, _MATCH
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true",
                    help="import everything a run needs, print the plan, write it to the JSON, measure nothing")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, Triton interpreter")
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma list of {SECTIONS}")
    ap.add_argument("--budget", type=float, default=500.0,
                    help="seconds for the whole run (a watchdog ends it 30 s past this, JSON saved)")
    ap.add_argument("--reps", type=int, default=30, help="timed repetitions per case")
    ap.add_argument("--e2e-quants", default="rtn4,gguf,none,fp8,int8,kv-fp8,no-graphs",
                    help="quant methods for the e2e runs, most wanted first (rtn4 = AWQ format, no calibration),"
                         " gguf (the same shapes as a Q4_K_M GGUF file, planned by the engine), and the bf16"
                         " variants kv-fp8 (FP8 KV cache) and no-graphs (CUDA graphs off)")
    ap.add_argument("--e2e-layers", type=int, default=8,
                    help="decoder layers of the 8B-shaped model (8: fits the budget; the roofline counts them)")
    ap.add_argument("--no-hf", action="store_true", help="skip the HF transformers comparison")
    ap.add_argument("--match", default="",
                    help="kernels section: only the cases whose name contains one of these (comma list), e.g. gguf")
    ap.add_argument("--tests", default="tests/kernels",
                    help="the tests section's pytest targets and options (space separated), e.g."
                         " 'tests/kernels/test_gguf_linear.py tests/kernels -x' (a file named before its folder runs first)")
    ap.add_argument("--tests-timeout", type=float, default=150.0, help="the tests section's most seconds")
    ap.add_argument("--out", default=None, help="JSON path (default $OUT/gpu_check.json or ./gpu_check.json)")
    args = ap.parse_args()
    _MATCH = [m for m in args.match.split(",") if m]

    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    import torch

    out_path = Path(args.out) if args.out else Path(os.environ.get("OUT", ".")) / "gpu_check.json"
    sections = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        print(f"gpu_check: unknown section(s) {unknown} in --only; choose from {list(SECTIONS)}", file=sys.stderr)
        return 2
    has_gpu = torch.cuda.is_available()
    # The plan is what a run would do; on a machine without a GPU, what it would do on one.
    device = "cpu" if args.smoke else "cuda"
    plan = {"device": device, "sections": sections, "budget_s": args.budget, "out": str(out_path),
            "e2e_quants": args.e2e_quants, "e2e_layers": args.e2e_layers,
            "match": args.match, "tests": args.tests,
            "reserved_s": budget_plan(sections, args.budget, len([q for q in args.e2e_quants.split(",") if q.strip()]),
                                      min(120.0, args.tests_timeout))}  # fmt: skip
    no_gpu = not has_gpu and not args.smoke
    report = Report(out_path)
    report.data["plan"] = plan
    if args.dry_run:
        report.data["package"] = package_or_error()
        imports = check_imports()
        missing = [m for m in RUN_IMPORTS if imports[m] != "ok"]
        report.data["dry_run"] = {"imports": imports, "missing": missing, "gpu": has_gpu}
        report.save()
        print("gpu_check plan:", json.dumps(plan, indent=2))
        for m in missing:
            print(f"gpu_check: cannot import {m}: {imports[m]}")
        if missing:
            print(f"gpu_check: a run would fail; carry the missing packages as wheels ({', '.join(CARRY)} at least:"
                  " docs/kernels.md, 'GPU check')")  # fmt: skip
            return 1
        if no_gpu:
            print("gpu_check: no GPU here (torch.cuda.is_available() is False): a real run would measure "
                  "nothing; run it on a GPU machine, or use --smoke to exercise the script on CPU.")
        print(f"gpu_check: dry run ok ({len(RUN_IMPORTS)} modules import); wrote {out_path}")
        return 0
    if no_gpu:
        print("gpu_check: no GPU present (torch.cuda.is_available() is False); nothing to measure. "
              "Use --smoke to exercise the script on CPU.")  # fmt: skip
        return 0

    deadline = Deadline(args.budget)
    start_watchdog(report, args.budget + 30)
    _REPORT = report
    reserved = plan["reserved_s"]
    report.data["package"] = package_or_error()
    report.save()
    peak_bw = 4.8e12  # replaced by the measurement when the bandwidth section runs

    def later(after: str) -> float:
        """Seconds promised to the sections after ``after``."""
        return sum(v for s, v in reserved.items() if sections.index(s) > sections.index(after))

    if "env" in sections:
        guarded(report, "env", lambda o: section_env(o, torch, device))
    if "bandwidth" in sections:

        def bw(o: dict[str, Any]) -> None:
            nonlocal peak_bw
            peak_bw = section_bandwidth(o, torch, device, args.smoke)

        guarded(report, "bandwidth", bw)
    if "kernels" in sections:
        _CASES_UNTIL = Deadline(deadline.left() - later("kernels"))
        guarded(report, "kernels", lambda o: section_kernels(o, torch, device, args.smoke, peak_bw, args.reps))
        _CASES_UNTIL = None
    if "tests" in sections:
        if args.smoke:
            report.section("tests")["skipped"] = "smoke mode: run `pytest tests/kernels` directly"
        else:
            timeout = max(30.0, min(args.tests_timeout, deadline.left() - later("tests")))
            guarded(report, "tests", lambda o: section_tests(o, timeout, args.tests))
    if "e2e" in sections:

        def e2e(o: dict[str, Any]) -> None:
            quants = [q.strip() for q in args.e2e_quants.split(",") if q.strip()]
            section_e2e(o, torch, device, args.smoke, peak_bw, quants, args.e2e_layers, deadline,
                        not args.no_hf, report.save)  # fmt: skip

        guarded(report, "e2e", e2e)
    report.data["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    report.data["total_s"] = round(args.budget - deadline.left(), 1)
    report.save()
    print(f"gpu_check: wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
