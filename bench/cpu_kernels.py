"""Times localllm's C++ CPU kernels on model-sized shapes, weights streamed from memory.

    python bench/cpu_kernels.py [--rows 1,4,16] [--levels 2] [--head-levels 1] [--reps 7] [--threads N]
                                [--types Q4_K,Q6_K,...] [--no-attention]
                                [--model FILE.gguf] [--source DIR]

GGUF linear: one "model pass" is every linear of SmolLM2-135M (30 layers of qkv 960x576,
o 576x576, gate_up 3072x576, down 576x1536, all Q4_1, and the 49152x576 Q8_0 head), each a
distinct random tensor, so the 97 MB of blocks stream from memory as in a decode step; the
roofline is that size over the machine's read bandwidth (printed, from a 256 MB sum, on the
same threads). Then, per --types, a pass of 24 layers of 3072x1024 and 1024x3072 in that
type alone (K a multiple of 256, as the K-quants need), its packed size and its M=1 time
against its roofline. Paged attention: SmolLM2's 9 query heads over 3 KV heads of 64, blocks
of 16 scattered over the pool. Median and best over --reps (on a loaded machine the best is
the figure to hold against the roofline); the CPU and thread count are printed with them.

--model FILE: instead, one decode step's linears of that GGUF file (every 2-D tensor in its
own type and shape, random blocks, the tied embedding as the head) at each --rows, with the
time per type and the head apart (its activations at --head-levels, as the engine runs it), each
with its packed GB/s and int8 multiply-adds per second, so a K-quant mix's cost at 16 streams
shows which block type it goes to and whether it is read- or compute-bound.
--source DIR: build and time a copy of kernels/cpu/ (an A/B of a kernel change in another
process, without touching the library every test loads).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

from localllm.cli import set_openmp_defaults

set_openmp_defaults(os.environ)  # as the CLI runs: before torch is imported

import torch  # noqa: E402

from localllm.kernels import cpu_ops  # noqa: E402
from localllm.quant import gguf_formats as gf  # noqa: E402
from localllm.quant.gguf import HEAD_ACT_LEVELS  # noqa: E402

LAYERS = 30
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) per layer
HEAD = (49152, 576)
Q4_1, Q8_0 = 3, 8


def random_blocks(n: int, k: int, type_: int) -> torch.Tensor:
    """Random GGUF blocks with small positive fp16 scales (and minimums for Q4_1)."""
    nb, bpb = k // 32, {Q4_1: 20, Q8_0: 34}[type_]
    raw = torch.randint(0, 256, (n, nb, bpb), dtype=torch.uint8)
    header = 4 if type_ == Q4_1 else 2
    scales = (torch.rand(n, nb, 2) * 0.02 + 0.001).half().view(torch.uint8).view(n, nb, 4)
    raw[:, :, :header] = scales[:, :, :header]
    return raw.view(n, nb * bpb).contiguous()


def type_blocks(name: str, n: int, k: int) -> torch.Tensor:
    """Random blocks of any type: random bytes with the fp16 scale fields (the traits table's
    d, dmin, m) set to small positive values, so no denormal or NaN arithmetic skews times."""
    f = gf.fmt(name)
    nblk = n * k // f.block_weights
    raw = torch.randint(0, 256, (nblk, f.block_bytes), dtype=torch.uint8)
    at = 0
    for field in f.fields:
        if field.name in ("d", "dmin", "m") and field.nbytes == 2:
            raw[:, at : at + 2] = (torch.rand(nblk, 1) * 0.02 + 0.001).half().view(torch.uint8)
        elif field.name == "e":  # MXFP4's E8M0 exponent: around 2^-6
            raw[:, at] = torch.randint(118, 124, (nblk,), dtype=torch.uint8)
        at += field.nbytes
    return raw.view(n, -1).contiguous()


CLOCK = time.perf_counter  # --cpu-time: time.thread_time


def timed(fn, reps: int, best: bool = False) -> float:  # type: ignore[no-untyped-def]
    fn()
    times = []
    for _ in range(reps):
        t0 = CLOCK()
        fn()
        times.append(CLOCK() - t0)
    return min(times) if best else statistics.median(times)


def read_bandwidth() -> float:
    x = torch.ones(64 * 2**20)
    return x.numel() * 4 / timed(x.sum, 9, best=True) / 1e9


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,16", help="activation rows M of the linears")
    ap.add_argument("--levels", type=int, default=2, help="int8 activation levels (1 or 2)")
    ap.add_argument("--head-levels", type=int, default=HEAD_ACT_LEVELS,
                    help="--model: the head's activation levels (default: the engine's, LOCALLLM_GGUF_HEAD_LEVELS)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: as the CLI sets them)")
    ap.add_argument("--types", default="Q4_0,Q4_1,Q5_0,Q8_0,Q4_K,Q5_K,Q6_K,IQ4_XS,MXFP4",
                    help="GGUF types to time alone, comma-separated ('' for none)")
    ap.add_argument("--no-attention", action="store_true")
    ap.add_argument("--model", default="", help="time one decode step's linears of this GGUF file instead")
    ap.add_argument("--source", default="", help="build and time this copy of kernels/cpu/")
    ap.add_argument("--cpu-time", action="store_true",
                    help="count this thread's CPU time, not wall time (with --threads 1: steadier on a busy machine)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.source:  # the build reads cpu_build's SOURCE_DIR; cpu_ops re-exports it
        from localllm.kernels import cpu_build

        cpu_ops.SOURCE_DIR = cpu_build.SOURCE_DIR = Path(args.source).resolve()
    if args.cpu_time:
        global CLOCK
        CLOCK = time.thread_time
    if not cpu_ops.has_gguf_kernels():
        raise SystemExit("localllm's GGUF CPU kernels are not available here (x86-64-v3 and a C++ compiler)")
    ops = torch.ops.localllm_cpu
    print(f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    if args.model:
        model_step(args.model, args)
        return
    weights = [(k, ops.gguf_repack(random_blocks(n, k, Q4_1), Q4_1, k), Q4_1) for _ in range(LAYERS) for n, k in SHAPES]
    weights.append((HEAD[1], ops.gguf_repack(random_blocks(*HEAD, Q8_0), Q8_0, HEAD[1]), Q8_0))
    total = sum(sum(t.numel() * t.element_size() for t in p) for _, p, _ in weights)
    bw = read_bandwidth()
    print(f"GGUF linear model pass: {total / 1e6:.0f} MB of blocks; read bandwidth {bw:.1f} GB/s, "
          f"roofline {total / bw / 1e6:.2f} ms")
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k) for k in (576, 1536)}

        def model_pass() -> None:
            for k, packed, t in weights:
                ops.gguf_linear(xs[k], packed, t, args.levels)

        med, best = timed(model_pass, args.reps), timed(model_pass, args.reps, best=True)
        print(f"  M={m:3d} levels={args.levels}: {med * 1e3:8.2f} ms median, {best * 1e3:8.2f} best "
              f"({best / (total / bw / 1e9):.2f}x roofline)")
    del weights
    for name in filter(None, args.types.split(",")):
        type_pass(name.strip(), bw, args)
    if args.no_attention:
        return
    h, kvh, dim, bs, pool = 9, 3, 64, 16, 2048
    kc, vc = torch.randn(pool, bs, kvh, dim), torch.randn(pool, bs, kvh, dim)
    print("paged attention (9 heads over 3 KV heads of 64, block 16):")
    for label, lens, q_lens in [("decode, 1 x 100 tokens", [100], [1]), ("decode, 1 x 1,516", [1516], [1]),
                                ("decode, 16 x 150", [150] * 16, [1] * 16),
                                ("12-token extend over 1,516", [1516], [12])]:
        width = max(-(-n // bs) for n in lens)
        perm = torch.randperm(pool)
        tables = torch.stack([perm[i * width : (i + 1) * width] for i in range(len(lens))]).int()
        qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        q = torch.randn(int(qsl[-1]), h, dim)
        sl = torch.tensor(lens, dtype=torch.int32)
        t = timed(lambda: ops.paged_attention(q, kc, vc, qsl, sl, tables, 0.125, 16), args.reps * 3)
        print(f"  {label:28s} {t * 1e6:8.1f} us")


def type_pass(name: str, bw: float, args: argparse.Namespace) -> None:
    """24 layers of [3072, 1024] and [1024, 3072] in one type: its packed size against the
    file's, and the linear's time against the roofline at each --rows."""
    ops = torch.ops.localllm_cpu
    t = gf.fmt(name).type_id
    shapes = [(3072, 1024), (1024, 3072)] * 24
    weights = []
    file_bytes = 0
    for n, k in shapes:
        blocks = type_blocks(name, n, k)
        file_bytes += blocks.numel()
        weights.append((k, ops.gguf_repack(blocks, t, k)))
    packed = sum(sum(p.numel() * p.element_size() for p in w) for _, w in weights)
    roof = packed / bw / 1e9
    line = [f"{name:6s} {packed / 1e6:5.0f} MB packed ({packed / file_bytes:.3f}x file, "
            f"{packed * 8 / sum(n * k for n, k in shapes):.3f} bits/weight), roofline {roof * 1e3:6.2f} ms:"]
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k) for k in (1024, 3072)}

        def one_pass() -> None:
            for k, w in weights:
                ops.gguf_linear(xs[k], w, t, args.levels)

        best = timed(one_pass, args.reps, best=True)
        line.append(f"M={m} {best * 1e3:6.2f} ms ({best / roof:.2f}x)")
    print("  ".join(line), flush=True)


def model_step(path: str, args: argparse.Namespace) -> None:
    """Every 2-D tensor of a GGUF file as a linear in its own type (the embedding, when no
    output tensor exists, as the tied head), random blocks: a decode step's linears at each
    --rows, per type and the head apart (ms, the packed bytes read per ms as GB/s, and int8
    multiply-adds per second over all levels), the step repeated --reps times. The head runs
    at --head-levels, the others at --levels, as the engine runs them."""
    from gguf import GGUFReader

    ops = torch.ops.localllm_cpu
    reader = GGUFReader(path)
    names = {t.name for t in reader.tensors}
    head_name = "output.weight" if "output.weight" in names else "token_embd.weight"
    # (label, K, N, packed, type id, levels)
    weights: list[tuple[str, int, int, list[torch.Tensor], int, int]] = []
    for t in reader.tensors:
        if len(t.shape) != 2 or (t.name == "token_embd.weight" and "output.weight" in names):
            continue
        k, n = (int(v) for v in t.shape)
        f = gf.fmt(int(t.tensor_type))
        if not f.cpu_kernel:
            continue
        head = t.name == head_name
        label = f"head {f.name} {n}x{k}" if head else f.name
        packed = ops.gguf_repack(type_blocks(f.name, n, k), f.type_id, k)
        weights.append((label, k, n, packed, f.type_id, args.head_levels if head else args.levels))
    nbytes = {label: 0 for label, *_ in weights}
    macs = {label: 0 for label, *_ in weights}
    for label, k, n, w, _, lv in weights:
        nbytes[label] += sum(p.numel() * p.element_size() for p in w)
        macs[label] += n * k * lv
    size = sum(nbytes.values())
    print(f"{Path(path).name}: {len(weights)} linears, {size / 1e6:.0f} MB packed, levels={args.levels}, "
          f"head levels={args.head_levels}")
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k) for k in {k for _, k, _, _, _, _ in weights}}
        per: dict[str, list[float]] = {}
        for _ in range(args.reps):
            for label, k, _, w, t, lv in weights:
                t0 = CLOCK()
                ops.gguf_linear(xs[k], w, t, lv)
                per.setdefault(label, []).append(CLOCK() - t0)
        by = {label: sum(v) / args.reps for label, v in per.items()}
        step = sum(by.values())
        print(f"  M={m:3d}: step {step * 1e3:7.2f} ms ({step * 1e3 / m:6.3f} ms/row)", flush=True)
        for label, v in sorted(by.items(), key=lambda kv: -kv[1]):
            print(f"         {label:24s} {v * 1e3:7.2f} ms {100 * v / step:4.0f}%  {nbytes[label] / v / 1e9:6.1f} GB/s"
                  f"  {m * macs[label] / v / 1e9:7.1f} G int8 MAC/s", flush=True)


if __name__ == "__main__":
    main()
