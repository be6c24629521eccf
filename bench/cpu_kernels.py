"""Times localllm's C++ CPU kernels on the default model's shapes, weights streamed from memory.

    python bench/cpu_kernels.py [--rows 1,4,16] [--levels 2] [--reps 7]

GGUF linear: one "model pass" is every linear of SmolLM2-135M (30 layers of qkv 960x576,
o 576x576, gate_up 3072x576, down 576x1536, all Q4_1, and the 49152x576 Q8_0 head), each a
distinct random tensor, so the 97 MB of blocks stream from memory as in a decode step; the
roofline is that size over the machine's read bandwidth (printed, from a 256 MB sum). Paged
attention: SmolLM2's 9 query heads over 3 KV heads of 64, blocks of 16 scattered over the pool.
Medians over --reps; the CPU and thread count are printed with the figures.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

from localllm.cli import set_openmp_defaults

set_openmp_defaults(os.environ)  # as the CLI runs: before torch is imported

import torch  # noqa: E402

from localllm.kernels import cpu_ops  # noqa: E402

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


def timed(fn, reps: int) -> float:  # type: ignore[no-untyped-def]
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def read_bandwidth() -> float:
    x = torch.ones(64 * 2**20)
    return x.numel() * 4 / timed(x.sum, 5) / 1e9


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
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    if not cpu_ops.has_gguf_kernels():
        raise SystemExit("localllm's GGUF CPU kernels are not available here (x86-64-v3 and a C++ compiler)")
    ops = torch.ops.localllm_cpu
    print(f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    weights = [(k, ops.gguf_repack(random_blocks(n, k, Q4_1), Q4_1, k), Q4_1) for _ in range(LAYERS) for n, k in SHAPES]
    weights.append((HEAD[1], ops.gguf_repack(random_blocks(*HEAD, Q8_0), Q8_0, HEAD[1]), Q8_0))
    total = sum(p[0].numel() + 4 * p[1].numel() for _, p, _ in weights)  # codes + fp16 d and c
    bw = read_bandwidth()
    print(f"GGUF linear model pass: {total / 1e6:.0f} MB of blocks; read bandwidth {bw:.1f} GB/s, "
          f"roofline {total / bw / 1e6:.2f} ms")
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k) for k in (576, 1536)}

        def model_pass() -> None:
            for k, (codes, d, c), t in weights:
                ops.gguf_linear(xs[k], codes, d, c, t, args.levels)

        print(f"  M={m:3d} levels={args.levels}: {timed(model_pass, args.reps) * 1e3:8.2f} ms")
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


if __name__ == "__main__":
    main()
