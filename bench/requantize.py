#!/usr/bin/env python
"""The default model (or any GGUF) requantized by llama.cpp's ``llama-quantize``: the K-quant
files issue 28's targets are measured on, made the way a user's downloads are made.

    python bench/peers.py --build                  # builds llama-quantize beside llama-server
    python bench/requantize.py                     # Q4_K_M Q5_K_M Q6_K Q8_0 IQ4_XS of the default model
    python bench/requantize.py --types Q4_K_M --model FILE.gguf --out DIR
    python bench/peers.py --model "$(python bench/requantize.py --types Q4_K_M --print-paths)"

``llama-quantize --allow-requantize SRC OUT TYPE`` without an imatrix; the files are second
roundings of the Q4_1 weights, so engines are compared on the same file, never against the
original. A file that exists and is newer than its source is kept (``--force`` makes it again).
Each file's tensor types are listed with what localllm's CPU kernels do with them (the traits
table, ``localllm.quant.gguf_formats``). Output goes to ``~/.cache/localllm-fixtures`` (or
``$LOCALLLM_HOME/fixtures``), outside the repository. A bench helper, never a test.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/peers.py: finding and building llama.cpp

from peers import PeerError, build_llama_cpp, find_llama_cpp, machine, peers_cache, resolve_gguf  # noqa: E402

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from pathlib import Path  # noqa: E402

# What users download (Ollama's default first), in the order.
TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "IQ4_XS")
# A source's own quantization tag, dropped from the name of the files made from it.
_QUANT_TAG = re.compile(r"[.-](I?Q\d[0-9A-Z_]*|F16|BF16|F32)$", re.IGNORECASE)


def fixtures_cache() -> Path:
    from localllm.paths import home_dir

    home = home_dir()
    if home:
        return home / "fixtures"
    import platformdirs

    return Path(platformdirs.user_cache_dir("localllm-fixtures"))


def find_quantize(explicit: Path | None) -> Path | None:
    """llama-quantize in the folders bench/peers.py looks in for llama-server."""
    for d in find_llama_cpp(explicit).searched:
        p = d / "llama-quantize"
        if p.is_file() and os.access(p, os.X_OK):
            return p
    return None


def out_name(source: Path, type_: str) -> str:
    """``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``smollm2-135m-instruct.Q4_K_M.gguf``."""
    return f"{_QUANT_TAG.sub('', source.stem).lower()}.{type_}.gguf"


def type_counts(path: Path) -> dict[str, int]:
    """Tensors per ggml type, most first, from the file's header."""
    from localllm.models.gguf_file import read_gguf_model
    from localllm.quant.gguf_formats import type_name

    _, tensors = read_gguf_model(path)
    return dict(Counter(type_name(int(t.tensor_type)) for t in tensors.values()).most_common())


def requantize(quantize: Path, source: Path, out: Path, type_: str, force: bool) -> tuple[Path, bool]:
    """Makes ``out`` unless it is already newer than ``source``; returns it and whether it was made."""
    if out.is_file() and out.stat().st_mtime >= source.stat().st_mtime and not force:
        return out, False
    tmp = out.with_name(out.name + ".part")
    cmd = [str(quantize), "--allow-requantize", str(source), str(tmp), type_]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        tmp.unlink(missing_ok=True)
        last = (r.stderr.strip().splitlines() or r.stdout.strip().splitlines() or ["no output"])[-1]
        raise PeerError(f"llama-quantize {type_} failed (exit {r.returncode}): {last[:200]}")
    os.replace(tmp, out)  # a killed run leaves no half file under the final name
    return out, True


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", "-m", default=None, help="the source GGUF (default: the default model's Q4_1 file)")
    p.add_argument("--types", default=",".join(TYPES), help=f"llama-quantize types (default {','.join(TYPES)})")
    p.add_argument("--out", type=Path, default=None, help="folder for the files (default: the fixtures cache)")
    p.add_argument("--llama-cpp-dir", type=Path, default=None, help="a llama.cpp build holding llama-quantize")
    p.add_argument("--build", action="store_true", help="build llama.cpp (bench/peers.py --build) when it is missing")
    p.add_argument("--force", action="store_true", help="make the files again even when they are up to date")
    p.add_argument("--print-paths", action="store_true", help="print only the files' paths, one a line")
    p.add_argument("--json", action="store_true", help="print paths, sizes and tensor types as JSON")
    args = p.parse_args(argv)

    def say(msg: str) -> None:
        if not (args.print_paths or args.json):
            print(msg, flush=True)

    from localllm.errors import LocalLLMError

    try:
        types = [t.strip().upper() for t in args.types.split(",") if t.strip()]
        if not types:
            raise PeerError("--types names no type")
        source = resolve_gguf(args.model)
        quantize = find_quantize(args.llama_cpp_dir)
        if quantize is None:
            if not args.build:
                raise PeerError("no llama-quantize found: run bench/peers.py --build (it builds llama-quantize "
                                "too), pass --build here, or point --llama-cpp-dir at a llama.cpp build")
            quantize = build_llama_cpp(peers_cache(), machine()["isa"], say) / "llama-quantize"
        out_dir = (args.out or fixtures_cache()).expanduser()
        out_dir.mkdir(parents=True, exist_ok=True)
        report = []
        for type_ in types:
            t0 = time.monotonic()
            path, made = requantize(quantize, source, out_dir / out_name(source, type_), type_, args.force)
            counts = type_counts(path)
            report.append({"type": type_, "path": str(path), "bytes": path.stat().st_size, "tensors": counts,
                           "made_s": round(time.monotonic() - t0, 1) if made else None})
            say(f"{type_:7} {path} ({path.stat().st_size / 2**20:.1f} MiB, "
                f"{'made in %.0f s' % (time.monotonic() - t0) if made else 'up to date'}): "
                + ", ".join(f"{k} x{v}" for k, v in counts.items()))
    except (PeerError, LocalLLMError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.print_paths:
        print("\n".join(r["path"] for r in report))
    elif args.json:
        print(json.dumps({"source": str(source), "llama_quantize": str(quantize), "files": report}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
