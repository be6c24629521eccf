"""Finding llama.cpp's binaries, and building them from the sources the llama-cpp-python sdist
vendors, in the user cache (never in the repository).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .environment import PeerError, llama_cpp_env

ENV_DIR = "LOCALLLM_LLAMA_CPP_DIR"
# ggml's AMX kernels die with SIGILL (tilezero) on the AMX Xeons these sessions get: the tile
# config and per-thread XFD permission bug of ggml-org/llama.cpp PR 26954. Built without them,
# llama.cpp keeps its AVX-512 VNNI kernels.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def peers_cache() -> Path:
    """Where the llama.cpp sdist and build live: outside the repository, beside our model cache."""
    from localllm.paths import home_dir

    home = home_dir()
    if home:
        return home / "peers"
    import platformdirs

    return Path(platformdirs.user_cache_dir("localllm-peers"))


@dataclass(frozen=True, slots=True)
class LlamaCpp:
    """The llama.cpp binaries found; either may be missing."""

    bin_dir: Path | None
    bench: Path | None
    server: Path | None
    searched: tuple[Path, ...]

    def missing(self, tool: str) -> str:
        where = ", ".join(str(p) for p in self.searched)
        return (f"llama.cpp skipped: no {tool} in {where} (run bench/peers.py --build to build it there, "
                f"or point --llama-cpp-dir or ${ENV_DIR} at a llama.cpp build)")


def find_llama_cpp(explicit: Path | None = None, env: dict[str, str] | None = None) -> LlamaCpp:
    """Looks in ``explicit``, else ``$LOCALLLM_LLAMA_CPP_DIR``, else the cache's build; each root
    may hold the binaries itself, in ``bin/`` or in ``build/bin/``. The first folder that has
    either binary wins."""
    env = os.environ if env is None else env
    if explicit is not None:
        roots = [explicit]
    elif env.get(ENV_DIR):
        roots = [Path(env[ENV_DIR]).expanduser()]
    else:
        roots = [peers_cache() / "build" / "bin"]
    searched = tuple(d for r in roots for d in (r, r / "bin", r / "build" / "bin"))

    def tool(d: Path, name: str) -> Path | None:
        p = d / name
        return p if p.is_file() and os.access(p, os.X_OK) else None

    for d in searched:
        bench, server = tool(d, "llama-bench"), tool(d, "llama-server")
        if bench or server:
            return LlamaCpp(d, bench, server, searched)
    return LlamaCpp(None, None, None, searched)


def _sdist_source(cache: Path, say: Callable[[str], None]) -> Path:
    """The llama.cpp tree vendored by the llama-cpp-python sdist, downloaded and unpacked once."""
    def found() -> Path | None:
        trees = sorted(cache.glob("llama_cpp_python-*/vendor/llama.cpp/CMakeLists.txt"))
        return trees[-1].parent if trees else None

    tree = found()
    if tree is not None:
        return tree
    tarballs = sorted(cache.glob("llama_cpp_python-*.tar.gz"))
    if not tarballs:
        say("downloading the llama-cpp-python sdist (about 77 MB) with pip")
        cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
               "llama-cpp-python", "-d", str(cache)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        tarballs = sorted(cache.glob("llama_cpp_python-*.tar.gz"))
        if r.returncode != 0 or not tarballs:
            last = (r.stderr.strip().splitlines() or ["no output"])[-1]
            raise PeerError(f"could not download the llama-cpp-python sdist: {last}")
    say(f"unpacking {tarballs[-1].name}")
    with tarfile.open(tarballs[-1]) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(cache, filter="data")
        else:  # Python < 3.11.4: no extraction filters; the sdist comes from PyPI
            tar.extractall(cache)  # noqa: S202
    tree = found()
    if tree is None:
        raise PeerError(f"{tarballs[-1]} holds no vendor/llama.cpp tree")
    return tree


def build_flags(isa: Sequence[str]) -> list[str]:
    flags = ["-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DCMAKE_BUILD_TYPE=Release"]
    if any(f.startswith("amx") for f in isa):
        flags += [f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]
    return flags


def build_llama_cpp(cache: Path, isa: Sequence[str], say: Callable[[str], None]) -> Path:
    """Builds llama-server, llama-bench and llama-quantize under ``cache`` with cmake; returns the
    bin folder. Progress goes through ``say``; the full output goes to ``cache/build.log``."""
    if not shutil.which("cmake"):
        raise PeerError("cannot build llama.cpp: cmake is not installed (apt-get install cmake g++, "
                        "or pip install cmake)")
    if not (shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")):
        raise PeerError("cannot build llama.cpp: no C++ compiler (apt-get install g++)")
    cache.mkdir(parents=True, exist_ok=True)
    src = _sdist_source(cache, say)
    build = cache / "build"
    log_path = cache / "build.log"
    flags = build_flags(isa)
    if any("amx" in f for f in flags):
        say("AMX off in this build: ggml's AMX kernels die with an illegal instruction on these CPUs "
            "(ggml-org/llama.cpp PR 26954); the AVX-512 kernels stay")
    jobs = str(os.cpu_count() or 2)
    steps = [
        ("configuring", ["cmake", "-S", str(src), "-B", str(build), *flags]),
        ("building", ["cmake", "--build", str(build), "-j", jobs, "--target", "llama-server", "llama-bench",
                      "llama-quantize"]),  # bench/requantize.py makes the K-quant files with it
    ]
    t0 = time.monotonic()
    with log_path.open("w") as log:
        for stage, cmd in steps:
            say(f"{stage} llama.cpp: {shlex.join(cmd)} (log: {log_path})")
            log.write(f"$ {shlex.join(cmd)}\n")
            log.flush()
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            assert proc.stdout is not None
            shown, shown_at = -10, 0.0
            last = ""
            for line in proc.stdout:
                log.write(line)
                log.flush()  # for whoever tails it
                last = line.strip() or last
                m = re.match(r"\[\s*(\d+)%\]", line)
                # cmake's percentage counts finished targets: it can sit still for minutes
                if m and (int(m.group(1)) >= shown + 10 or time.monotonic() - shown_at > 30):
                    shown, shown_at = int(m.group(1)), time.monotonic()
                    say(f"building llama.cpp: {shown}% ({shown_at - t0:.0f} s)")
            if proc.wait() != 0:
                raise PeerError(f"the llama.cpp build failed while {stage} (exit {proc.returncode}): "
                                f"{last[:200]}; full log: {log_path}")
    say(f"built llama.cpp in {time.monotonic() - t0:.0f} s: {build / 'bin'}")
    return build / "bin"


def llama_cpp_version(llama: LlamaCpp) -> str | None:
    tool = llama.server or llama.bench
    if tool is None:
        return None
    r = subprocess.run([str(tool), "--version"], capture_output=True, text=True, env=llama_cpp_env())
    line = next((ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith("version")), None)
    return line.removeprefix("version:").strip() if line else None
