"""What a peers run starts from: the machine it measures on, the OpenMP settings each side
runs with, and the one-line error a user can act on.

Importing this module sets our CLI's OpenMP defaults in ``os.environ`` (before anything imports
torch), after keeping what the user's shell had: llama.cpp runs with the user's environment,
not with our tuning.
"""

from __future__ import annotations

import os
import re
import signal
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from localllm.cli import set_openmp_defaults  # torch-free

OPENMP_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
USER_OPENMP = {k: os.environ[k] for k in OPENMP_VARS if k in os.environ}
set_openmp_defaults(os.environ)  # must precede the torch import


class PeerError(Exception):
    """A problem a user can act on, said in one line."""


def machine(cpuinfo: str | None = None) -> dict[str, Any]:
    """CPU model, its vector ISA flags (avx2, avx512*, amx*), threads, load average, date."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
    flags_line = re.search(r"^flags\s*:\s*(.+)$", cpuinfo, re.M)
    flags = flags_line.group(1).split() if flags_line else []
    isa = sorted({f for f in flags if f == "avx2" or f.startswith(("avx512", "amx"))})
    return {
        "cpu": model.group(1).strip() if model else "unknown",
        "isa": isa,
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def llama_cpp_env() -> dict[str, str]:
    """The user's environment, without the OpenMP tuning this script set for ours."""
    env = {k: v for k, v in os.environ.items() if k not in OPENMP_VARS}
    return env | USER_OPENMP


def died(what: str, rc: int, tail: str) -> PeerError:
    if rc == -signal.SIGILL or rc == 128 + signal.SIGILL:
        return PeerError(f"{what} died of an illegal instruction (SIGILL): the build uses an instruction this "
                         "CPU refuses; rebuild with bench/peers.py --build (it turns AMX off)")
    return PeerError(f"{what} exited with {rc}: {tail[:300]}")
