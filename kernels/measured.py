"""Choices this machine's timings make between kernels, measured once per machine and kept
on disk.

A timing taken at every start lets the load of that moment pick: a start next to a busy
program once chose bf16 over the GGUF kernel and gave another greedy text and a 200-second
compile. What a plan holds is therefore never timed: a GGUF file whose types the CPU kernels
take always keeps its blocks (localllm/quant/gguf_modules.py decides by type, from the traits
table). A choice that only a timing can make is measured the first time a machine needs it and stored in
``compiled_cache_dir()/measured.json`` with what it depends on (the CPU's signature, the torch
version, the C++ kernels' source, and the caller's own inputs); later starts read it and
measure nothing. It is measured again only when one of those changes, or on request
(``LOCALLLM_REMEASURE=1``), and a re-measure keeps the stored winner unless another option is
faster by more than ``MARGIN``, so a close call does not flip.

Invariants: this module is the file's one writer; a write replaces the file atomically
(temp file + ``os.replace``) under an flock, so concurrent starts read a whole file and
neither loses the other's entries. A file that does not parse counts as empty.
"""

from __future__ import annotations

import datetime
import hashlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from localllm.kernels import cpu_ops

# A challenger replaces the incumbent only when faster by more than this fraction: timings on
# a shared machine vary by +-30% from run to run, a real difference between kernels is larger.
MARGIN = 0.2
FILE = "measured.json"


@dataclass(frozen=True, slots=True)
class Measured:
    """One choice: ``winner`` among ``times`` (seconds per call, per option), the date it was
    measured (ISO), and whether this process measured it (False: read from the cache)."""

    winner: str
    times: dict[str, float]
    measured_on: str
    fresh: bool

    def provenance(self) -> str:
        """Where the figures come from, for a plan's reason line: the same words on the start
        that measured and on those that read it back, so every start prints one plan."""
        return f"measured on this machine on {self.measured_on} and kept; LOCALLLM_REMEASURE=1 times it again"


def remeasure_requested() -> bool:
    return os.environ.get("LOCALLLM_REMEASURE", "0") not in ("", "0")


def machine_key(depends_on: Sequence[str]) -> str:
    """What a stored choice is valid for: this CPU, this torch, these kernels and the caller's
    inputs (shapes, types, settings that change what is timed)."""
    parts = (cpu_ops.cpu_signature(), torch.__version__, cpu_ops.source_text(), *depends_on)
    return hashlib.sha256(b"\0".join(p.encode() for p in parts)).hexdigest()[:24]


def pick(times: dict[str, float], incumbent: str | None) -> str:
    """The fastest option, unless ``incumbent`` (an option of ``times``) is within ``MARGIN``
    of it: then the incumbent stays."""
    fastest = min(times, key=times.__getitem__)
    if incumbent in times and times[fastest] * (1 + MARGIN) >= times[incumbent]:
        return incumbent
    return fastest


def choose(
    name: str,
    depends_on: Sequence[str],
    measure: Callable[[], dict[str, float]],
    prefer: str | None = None,
) -> Measured:
    """The stored choice ``name`` if its key (``machine_key(depends_on)``) still holds and no
    re-measure was requested; else ``measure()`` (seconds per option) decides, and the result
    is stored. On a first measure ``prefer`` is the incumbent (the option the caller would
    take on a tie); on a requested re-measure with the same key the stored winner is."""
    key = machine_key(depends_on)
    path = cpu_ops.compiled_cache_dir() / FILE
    stored = cpu_ops.read_cache_json(path).get(name)
    same_key = isinstance(stored, dict) and stored.get("key") == key
    if same_key and not remeasure_requested():
        assert isinstance(stored, dict)
        return Measured(str(stored["winner"]), dict(stored["times"]), str(stored["measured_on"]), fresh=False)
    times = measure()
    incumbent = str(stored["winner"]) if same_key and isinstance(stored, dict) else prefer
    result = Measured(pick(times, incumbent), times, datetime.date.today().isoformat(), fresh=True)
    _store(path, name, {"key": key, "winner": result.winner, "times": times, "measured_on": result.measured_on})
    return result


def _store(path: Path, name: str, entry: dict[str, object]) -> None:
    """Adds ``entry`` under ``name``: read, update and replace under the cache's flock, so two
    starts that measure different choices at once both keep theirs."""
    try:
        with cpu_ops.cache_lock(path.parent / ".measured.lock"):
            data = cpu_ops.read_cache_json(path)
            data[name] = entry
            cpu_ops.write_cache_json(path, data)
    except OSError:  # a read-only cache: this start's choice stands, the next measures again
        pass
