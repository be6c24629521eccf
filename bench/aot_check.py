#!/usr/bin/env python
"""Compiles every Triton kernel ahead of time for real GPU targets, on a machine without a GPU.

    python bench/aot_check.py                 # sm90 (H100/H200), sm89 (RTX 4090), sm80 (A100)
    python bench/aot_check.py --arch 90 --only attention --json out.json

The interpreter (tests/kernels) checks what the kernels compute; this checks that the real
compiler accepts them with the launch configurations the dispatchers and autotuners use, and
reports the static cost ptxas sees: registers per thread, spilled bytes, and shared memory
against the device limit. It needs Triton's bundled ptxas, not a driver. It cannot time
anything: speed is measured by bench/gpu_check.py on a GPU.

For every split-K case it also reads the PTX for the ordering the "last program reduces"
protocol needs (``splitk_order``: a bar.sync between the partial-tile stores and the arrival
atomic, the atomic a release at GPU scope, a bar.sync before the reduction's loads); the
interpreter runs programs one after another and can never catch a missing barrier.
tests/bench/test_aot_check.py runs that check in CI (no GPU needed).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from importlib import import_module
from pathlib import Path
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

# The kernel modules, imported by load_kernels() (not at import, so a test can import this
# file's PTX checks into a process whose kernels run under the interpreter).
activation: Any = None
awq_gemm: Any = None
gguf_linear: Any = None
int8_gemm: Any = None
paged_attention: Any = None
rmsnorm: Any = None
rotary_kv: Any = None


def load_kernels() -> None:
    """Imports the kernel modules for the real compiler: TRITON_INTERPRET must be unset when
    their ``@triton.jit`` decorators run, so this must be the process's first import of them."""
    global activation, awq_gemm, gguf_linear, int8_gemm, paged_attention, rmsnorm, rotary_kv
    if os.environ.get("TRITON_INTERPRET") == "1" and "localllm.kernels._triton" in sys.modules:
        raise RuntimeError("the kernels were imported under TRITON_INTERPRET=1: run aot_check in its own process")
    os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU, not the interpreter
    # import_module, not `from localllm.kernels import ...`: the package re-exports functions
    # named like their modules.
    activation, awq_gemm, gguf_linear, int8_gemm, paged_attention, rmsnorm, rotary_kv = (
        import_module(f"localllm.kernels.{m}")
        for m in ("activation", "awq_gemm", "gguf_linear", "int8_gemm", "paged_attention", "rmsnorm", "rotary_kv")
    )

# Shared memory per block that a kernel may use (opt-in maximum), by SM version.
SMEM_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"

Case = tuple[str, Any, dict[str, str], dict[str, Any], dict[str, int]]


def signature(fn: Any, types: dict[str, str], constexprs: dict[str, Any]) -> dict[str, str]:
    """Every parameter gets a type: given ones, constexpr, or i32 for the remaining ints."""
    sig = {}
    for p in fn.params:
        name = p.name
        if p.is_constexpr:
            sig[name] = "constexpr"
        else:
            sig[name] = types.get(name, "i32")
    missing = [n for n, t in sig.items() if t == "constexpr" and n not in constexprs]
    assert not missing, f"{fn.__name__}: no value for constexprs {missing}"
    return sig


def divisible(sig: dict[str, str], names: list[str]) -> dict[tuple[int, ...], list[list[Any]]]:
    """The 16-divisibility Triton infers at launch for aligned pointers and strides."""
    idx = {n: i for i, n in enumerate(sig)}
    return {(idx[n],): [["tt.divisibility", 16]] for n in names if n in idx}


def attention_cases(arch: int) -> Iterator[Case]:
    fn = paged_attention._paged_attention_kernel
    ptrs = {"out_ptr": "*bf16", "q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16",
            "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "qsl_ptr": "*i32", "part_out_ptr": "*fp32",
            "part_lse_ptr": "*fp32", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "qk_scale": "fp32"}  # fmt: skip
    # The same tiles paged_attention._tile_config picks for this architecture.
    for head_dim, qpkv in ((128, 4), (128, 8), (80, 3), (64, 1), (96, 4)):
        block_d = triton.next_power_of_2(head_dim)
        rows = max(16, triton.next_power_of_2(qpkv))
        base = dict(QPKV=qpkv, HEAD_D=head_dim, BLOCK_D=block_d, KV_BLOCK_SIZE=16, DOT_FP32=False)
        for splits in (1, 16):
            yield (f"decode D{head_dim} qpkv{qpkv} splits{splits}", fn, ptrs,
                   dict(base, BLOCK_M=rows, BLOCK_Q=1, TILE_N=64, NUM_SPLITS=splits, IS_DECODE=True, FP8_KV=False),
                   {"num_warps": 4, "num_stages": 3})  # fmt: skip
        bm = max(rows, 128)
        yield (f"prefill D{head_dim} qpkv{qpkv} BLOCK_M{bm}", fn, ptrs,
               dict(base, BLOCK_M=bm, BLOCK_Q=bm // qpkv, TILE_N=64, NUM_SPLITS=1, IS_DECODE=False, FP8_KV=False),
               {"num_warps": 8, "num_stages": 2})  # fmt: skip
    if arch >= 89:
        fp8 = dict(ptrs, k_cache_ptr="*fp8e4nv", v_cache_ptr="*fp8e4nv")
        base = dict(QPKV=4, HEAD_D=128, BLOCK_D=128, KV_BLOCK_SIZE=16, DOT_FP32=False, FP8_KV=True)
        yield ("decode fp8 KV splits16", fn, fp8,
               dict(base, BLOCK_M=16, BLOCK_Q=1, TILE_N=64, NUM_SPLITS=16, IS_DECODE=True),
               {"num_warps": 4, "num_stages": 3})  # fmt: skip
        bm = 128 if arch >= 90 else 64
        yield ("prefill fp8 KV", fn, fp8,
               dict(base, BLOCK_M=bm, BLOCK_Q=bm // 4, TILE_N=64, NUM_SPLITS=1, IS_DECODE=False),
               {"num_warps": 8, "num_stages": 2})  # fmt: skip
    yield ("fp32 ieee (tests)", fn, dict(ptrs, out_ptr="*fp32", q_ptr="*fp32", k_cache_ptr="*fp32", v_cache_ptr="*fp32"),
           dict(QPKV=4, HEAD_D=64, BLOCK_D=64, KV_BLOCK_SIZE=16, DOT_FP32=True, BLOCK_M=16, BLOCK_Q=4, TILE_N=16,
                NUM_SPLITS=1, IS_DECODE=False, FP8_KV=False), {"num_warps": 4, "num_stages": 1})  # fmt: skip
    yield ("reduce splits", paged_attention._reduce_splits_kernel,
           {"out_ptr": "*bf16", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32"},
           dict(HEAD_D=128, BLOCK_D=128, NUM_SPLITS=16), {"num_warps": 4})  # fmt: skip


def elementwise_cases(arch: int) -> Iterator[Case]:
    rot = rotary_kv._rotary_and_store_kv_kernel
    ptrs = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "q_out_ptr", "k_cache_ptr", "v_cache_ptr")}
    ptrs.update(positions_ptr="*i64", cos_sin_ptr="*fp32", slot_mapping_ptr="*i64", k_scale_ptr="*fp32",
                v_scale_ptr="*fp32")  # fmt: skip
    cx = dict(KV_BLOCK_SIZE=16, NUM_HEADS=32, NUM_KV_HEADS=8, BLOCK_H=32, BLOCK_KVH=8, HEAD_D=128, HALF=64,
              BLOCK_HALF=64, BLOCK_D=128, FP8_KV=False, EXACT_FP8_ROUND=False)  # fmt: skip
    yield ("rotary+kv bf16", rot, ptrs, cx, {"num_warps": 8})
    if arch >= 89:
        yield ("rotary+kv fp8 cache", rot, dict(ptrs, k_cache_ptr="*fp8e4nv", v_cache_ptr="*fp8e4nv"),
               dict(cx, FP8_KV=True), {"num_warps": 8})  # fmt: skip
    rms = rmsnorm._rms_norm_kernel
    rptrs = {n: "*bf16" for n in ("out_ptr", "res_out_ptr", "x_ptr", "res_ptr", "w_ptr")}
    rptrs["eps"] = "fp32"
    yield ("rms_norm+residual 4096", rms, rptrs, dict(HAS_RESIDUAL=True, BLOCK_N=4096), {"num_warps": 16})
    yield ("rms_norm 8192", rms, rptrs, dict(HAS_RESIDUAL=False, BLOCK_N=8192), {"num_warps": 16})
    yield ("silu_and_mul", activation._silu_and_mul_kernel, {"out_ptr": "*bf16", "x_ptr": "*bf16"},
           dict(BLOCK=1024), {"num_warps": 4})  # fmt: skip


def gemm_cases(arch: int) -> Iterator[Case]:
    awq = awq_gemm._awq_gemm_kernel
    for act in ("fp16", "bf16"):
        ptrs = {"x_ptr": f"*{act}", "qweight_ptr": "*i32", "qzeros_ptr": "*i32", "scales_ptr": "*fp16",
                "out_ptr": f"*{act}", "ws_ptr": "*fp32", "locks_ptr": "*i32"}  # fmt: skip
        for cfgs, label in ((awq_gemm._GEMV_CONFIGS, "gemv"), (awq_gemm._GEMM_CONFIGS, "gemm")):
            for i, c in enumerate(cfgs):
                if arch < 90 and c.hopper_only:
                    continue
                for group in (128, 32) if (act == "fp16" and label == "gemv") else (128,):
                    yield (f"awq {act} {label}[{i}] g{group} {c.kwargs}", awq, ptrs,
                           dict(c.kwargs, GROUP_SIZE=group, FP16_MAGIC=True, USE_ASM=True, DOT_FP32=False, EVEN_K=True),
                           {"num_warps": c.num_warps, "num_stages": c.num_stages})  # fmt: skip
    w8 = int8_gemm._w8_gemm_kernel
    # (label, activation pointer, weight pointer, workspace pointer, out, A8); e4m3 needs sm89
    variants = [("int8 w8a16 fp16", "*fp16", "*i8", "*fp32", "fp16", False),
                ("int8 w8a16 bf16", "*bf16", "*i8", "*fp32", "bf16", False),
                ("int8 w8a8 bf16", "*i8", "*i8", "*i32", "bf16", True)]
    if arch >= 89:
        variants.append(("fp8 w8a8 bf16", "*fp8e4nv", "*fp8e4nv", "*fp32", "bf16", True))
    for label, x_ptr, w_ptr, ws_ptr, out, a8 in variants:
        ptrs = {"x_ptr": x_ptr, "w_ptr": w_ptr, "w_scale_ptr": "*fp32", "x_scale_ptr": "*fp32",
                "out_ptr": f"*{out}", "ws_ptr": ws_ptr, "locks_ptr": "*i32"}  # fmt: skip
        for cfgs, shape in ((int8_gemm._GEMV_CONFIGS, "gemv"), (int8_gemm._GEMM_CONFIGS, "gemm")):
            for i, c in enumerate(cfgs):
                if arch < 90 and c.hopper_only:
                    continue
                consts = dict(c.kwargs, A8=a8, INT8_DOT=x_ptr == "*i8", FP16_MAGIC=x_ptr == "*fp16",
                              USE_ASM=True, DOT_FP32=False, EVEN_K=True)  # fmt: skip
                yield (f"{label} {shape}[{i}] {c.kwargs}", w8, ptrs, consts,
                       {"num_warps": c.num_warps, "num_stages": c.num_stages})  # fmt: skip
    quant_types = [("i8", 127.0)] + ([("fp8e4nv", 448.0)] if arch >= 89 else [])
    for qtype, qmax in quant_types:
        yield (f"quant {qtype} per token", int8_gemm._quant_per_token_kernel,
               {"x_ptr": "*bf16", "xq_ptr": f"*{qtype}", "scale_ptr": "*fp32"},
               dict(BLOCK_K=4096, QMAX=qmax, ROUND_INT=qtype == "i8", EXACT_FP8_ROUND=False),
               {"num_warps": 4})  # fmt: skip


def gguf_cases(arch: int) -> Iterator[Case]:
    """The GGUF block kernels (kernels/gguf_linear.py): every config of each path (decode GEMV at
    1 and 4 rows, batched-decode dot at 16 and 64 rows, prefill dot), the dequantize kernel of
    prefill's dequantize-then-cuBLAS, and the grouped (MoE) launches, on every type in fp16, and
    on Q4_K (the commonest type) in bf16 too: the decode, and so the registers, differ per type."""
    g = gguf_linear
    fn = g._gguf_matmul_kernel
    paths = (("gemv", g._GEMV_CONFIGS), ("small", g._SMALL_CONFIGS), ("gemm", g._GEMM_CONFIGS))
    for name in ("Q4_K",) + tuple(sorted(g.FORMATS - {"Q4_K"})):
        lay = g.gpu_layout(name)
        for act in ("fp16", "bf16") if name == "Q4_K" else ("fp16",):
            # a type without high bits, scale bytes or fp16 fields gets the codes there
            ptrs = {"x_ptr": f"*{act}", "codes_ptr": "*i32", "high_ptr": "*i32",
                    "scales_ptr": "*u8" if lay.nsc else "*i32", "d_ptr": "*fp16" if lay.nd else "*i32",
                    "out_ptr": f"*{act}",
                    "ws_ptr": "*fp32", "locks_ptr": "*i32"}  # fmt: skip
            fmt_cx = dict(FORMAT=lay.type_id, BW=lay.block_weights, SUB=lay.sub_block, LO_BITS=lay.lo_bits,
                          HI_BITS=lay.hi_bits, ND=lay.nd, NSC=lay.nsc, **g.lut_words(name), DOT_FP32=False,
                          EVEN_K=True)  # fmt: skip
            for label, cfgs in paths:
                for i, c in enumerate(cfgs):
                    if arch < 90 and c.hopper_only:
                        continue
                    rows = {"gemv": (1, 4), "small": (16, 64)}.get(label, (c.kwargs.get("BLOCK_M"),))
                    for bm in rows:
                        kw = dict(c.kwargs, BLOCK_M=bm)
                        launch = g.gemv_config(c, bm, lay) if label == "gemv" else c
                        yield (f"gguf {name} {act} {label}[{i}] {kw}", fn, ptrs,
                               dict(fmt_cx, **kw, USE_DOT=label != "gemv"), g.launch_options(launch))  # fmt: skip
            # prefill's dequantize-then-cuBLAS: the weights written in the activation dtype
            dq = {k: v for k, v in ptrs.items() if k not in ("x_ptr", "ws_ptr", "locks_ptr")}
            yield (f"gguf dequant {name} {act} {g._DEQUANT.kwargs}", g._gguf_dequant_kernel, dq,
                   dict({k: v for k, v in fmt_cx.items() if k != "DOT_FP32"}, **g._DEQUANT.kwargs),
                   g.launch_options(g._DEQUANT))  # fmt: skip
            # the grouped entry (a MoE's routed experts, one launch per projection): each path's tiles
            grouped = {**{k: v for k, v in ptrs.items() if k not in ("ws_ptr", "locks_ptr")},
                       "tile_expert_ptr": "*i32", "tile_row_ptr": "*i64", "offsets_ptr": "*i64"}
            for label, c in g.GROUPED_CONFIGS.items():
                yield (f"gguf grouped {name} {act} {label} {c.kwargs}", g._gguf_grouped_kernel, grouped,
                       dict(fmt_cx, **c.kwargs, USE_DOT=c.kwargs["BLOCK_M"] >= 16, PER_ROW=False),
                       g.launch_options(c))  # fmt: skip
            # a decode's unsorted rows, one a tile, each naming its expert (the router's int64 ids)
            one = g.GROUPED_CONFIGS["gemv1"]
            yield (f"gguf grouped per-row {name} {act} {one.kwargs}", g._gguf_grouped_kernel,
                   dict(grouped, tile_expert_ptr="*i64", tile_row_ptr="*i64", offsets_ptr="*i64"),
                   dict(fmt_cx, **one.kwargs, USE_DOT=False, PER_ROW=True), g.launch_options(one))  # fmt: skip


GROUPS = {"attention": attention_cases, "elementwise": elementwise_cases, "gemm": gemm_cases, "gguf": gguf_cases}
ALIGNED = ["stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_kb", "stride_ks", "stride_kh", "stride_vb",
           "stride_vs", "stride_vh", "stride_xm", "stride_om", "stride_wn", "stride_x", "stride_r", "stride_o",
           "stride_ro", "N", "K", "n_cols", "stride_qm"]  # fmt: skip


def ptxas_stats(ptx: str, arch: int) -> dict[str, int]:
    sm = f"sm_{arch}a" if arch == 90 else f"sm_{arch}"
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        proc = subprocess.run([str(PTXAS), f"-arch={sm}", "-v", str(src), "-o", str(Path(d) / "k.cubin")],
                              capture_output=True, text=True, timeout=300)  # fmt: skip
    text = proc.stdout + proc.stderr
    stats: dict[str, int] = {}
    if m := re.search(r"Used (\d+) registers", text):
        stats["registers"] = int(m.group(1))
    if m := re.search(r"(\d+) bytes spill stores", text):
        stats["spill_store_bytes"] = int(m.group(1))
    if m := re.search(r"(\d+) bytes spill loads", text):
        stats["spill_load_bytes"] = int(m.group(1))
    return stats


_BARRIER = re.compile(r"^\s*(?:@!?%p\w+\s+)?(?:bar\.sync|barrier\.sync|barrier\.cta\.sync|bar\.cta\.sync)\b")
_ATOM_ADD = re.compile(r"\batom\.global\.(?P<quals>[\w.]*?)\.?add\.[us]32\b")


def splitk_order(ptx: str) -> str:
    """Checks the ordering the split-K "last program reduces" protocol (``split_k_sum``) needs
    in the compiled PTX; "ok", or what is wrong. Every thread stores a slice of the partial
    tile, one thread counts the arrival (``atom...add``): a CTA barrier must lie between the
    last global store before the atom and the atom, the atom must release at GPU (or system)
    scope, and a barrier must follow it before the reduction's first global load (the other
    threads learn the count through shared memory behind it)."""
    lines = ptx.splitlines()
    atoms = [i for i, ln in enumerate(lines) if _ATOM_ADD.search(ln)]
    if not atoms:
        return "no atom.global...add in the PTX"
    i = atoms[0]
    quals = _ATOM_ADD.search(lines[i]).group("quals").split(".")  # type: ignore[union-attr]
    stores = [j for j in range(i) if "st.global" in lines[j]]
    if not stores:
        return "no st.global before the atom"
    if not any(_BARRIER.match(lines[j]) for j in range(stores[-1] + 1, i)):
        return f"no bar.sync between the last st.global (line {stores[-1] + 1}) and the atom (line {i + 1})"
    if not ({"acq_rel", "release"} & set(quals)) or not ({"gpu", "sys"} & set(quals)):
        return f"the atom is not a release at gpu scope: {lines[i].strip()}"
    loads = [j for j in range(i + 1, len(lines)) if "ld.global" in lines[j]]
    if loads and not any(_BARRIER.match(lines[j]) for j in range(i + 1, loads[0])):
        return f"no bar.sync between the atom (line {i + 1}) and the next ld.global (line {loads[0] + 1})"
    return "ok"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="90,89,80", help="comma list of SM versions")
    ap.add_argument("--only", default=",".join(GROUPS), help=f"comma list of {list(GROUPS)}")
    ap.add_argument("--match", default="", help="only cases whose name contains one of these (comma list)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--ptx-dir", default=None, help="write each case's PTX here")
    args = ap.parse_args()
    load_kernels()
    matches = args.match.split(",")
    results: list[dict[str, Any]] = []
    failures = 0
    for arch in (int(a) for a in args.arch.split(",")):
        for group in args.only.split(","):
            for name, fn, types, cx, opts in GROUPS[group](arch):
                if not any(m in name for m in matches):
                    continue
                t0 = time.monotonic()
                row: dict[str, Any] = {"arch": arch, "kernel": fn.__name__, "case": name}
                try:
                    sig = signature(fn, types, cx)
                    aligned = [n for n, t in sig.items() if t.startswith("*")] + ALIGNED
                    src = ASTSource(fn, sig, constexprs=cx, attrs=divisible(sig, aligned))
                    k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)
                    shared = int(k.metadata.shared)
                    row.update(shared_bytes=shared, smem_ok=shared <= SMEM_LIMIT[arch], **ptxas_stats(k.asm["ptx"], arch))
                    ptx = k.asm["ptx"]
                    row["ptx_cvt_f_from_int"] = len(re.findall(r"cvt\.rn\.f(?:16|32)\.[su](?:8|16|32)", ptx))
                    row["mma"] = "wgmma" if "wgmma" in ptx else ("mma" if "mma.sync" in ptx else "none")
                    ok = row["smem_ok"] and row.get("spill_store_bytes", 0) == 0
                    if cx.get("SPLIT_K", 1) > 1:  # the last-program-reduces protocol is compiled in
                        row["splitk_order"] = splitk_order(ptx)
                        ok = ok and row["splitk_order"] == "ok"
                    if args.ptx_dir:
                        Path(args.ptx_dir).mkdir(parents=True, exist_ok=True)
                        slug = re.sub(r"[^A-Za-z0-9]+", "_", f"sm{arch} {name}").strip("_")
                        (Path(args.ptx_dir) / f"{slug}.ptx").write_text(ptx)
                except Exception as e:  # noqa: BLE001 - report every failing case
                    row["error"] = f"{type(e).__name__}: {str(e)[-1500:]}"
                    ok = False
                row["seconds"] = round(time.monotonic() - t0, 1)
                failures += not ok
                results.append(row)
                flag = "ok " if ok else "BAD"
                detail = row.get("error") or {k: row[k] for k in ("registers", "spill_store_bytes", "shared_bytes", "mma",
                                                                 "splitk_order") if k in row}
                print(f"{flag} sm{arch} {name}: {detail}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    print(f"{len(results) - failures}/{len(results)} compiled cleanly (no error, no spills, shared memory fits, "
          "split-K stores ordered before the arrival atomic)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
