"""Where the shape-dependent choices a GPU start measures are kept, so only the first start on a
machine pays for them: the autotuner's launch config per kernel and shape key, and the GEMM
backend per shape (``_triton.gemm_backend_choice``).

One JSON file per (GPU name, compute capability, torch, Triton, kernel source) under
``compiled_cache_dir()/tuning``: another GPU, a torch or Triton upgrade, or an edited kernel
file reads another file and measures again. Entries are only added; a damaged file counts as
empty; writes are atomic (temp file, then rename), so two starts at once lose at most each
other's additions, never the file.

While a choice is being measured for the first time, ``note_tuning()`` tells whoever set
``reporting(...)`` (the model runner's warm-up turns it into the "tuning kernels for this GPU
(first run only)" progress line).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from localllm.kernels.cpu_ops import compiled_cache_dir, read_cache_json, write_cache_json

KERNELS_DIR = Path(__file__).parent
# (GPU name, compute capability major, minor): what the measurements were made on
Identity = tuple[str, int, int]
_stores: dict[Path, TuningStore] = {}
_on_tune: Callable[[], None] | None = None


@functools.lru_cache(maxsize=1)
def _source_hash() -> str:
    """Every kernel file's text (configs, tiles and the torch paths they race all live there)."""
    h = hashlib.sha256()
    for path in sorted(KERNELS_DIR.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _triton_version() -> str:
    try:
        import triton

        return str(triton.__version__)
    except ImportError:  # pragma: no cover - the GEMM choices exist without Triton too
        return "none"


def store_path(identity: Identity) -> Path:
    name, major, minor = identity
    parts = (name, f"{major}.{minor}", torch.__version__, _triton_version(), _source_hash())
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]
    return compiled_cache_dir() / "tuning" / f"{key}.json"


def key_text(key: tuple[Any, ...]) -> str:
    """A shape key as stored: its repr, with dtypes as their names (``torch.float16``), so it
    reads back with ``ast.literal_eval``."""
    return repr(tuple(str(p) if isinstance(p, torch.dtype) else p for p in key))


class TuningStore:
    """The choices for one identity: ``autotune[kernel][key] = {"kwargs", "num_warps",
    "num_stages"}`` and ``gemm[key] = backend name``. The one writer of its file."""

    def __init__(self, path: Path, identity: Identity) -> None:
        self.path = path
        self.identity = identity
        self.autotune: dict[str, dict[str, dict[str, Any]]] = {}
        self.gemm: dict[str, str] = {}
        data = read_cache_json(path)
        try:
            self.autotune = {str(k): dict(v) for k, v in data.get("autotune", {}).items()}  # type: ignore[union-attr]
            self.gemm = {str(k): str(v) for k, v in data.get("gemm", {}).items()}  # type: ignore[union-attr]
        except (AttributeError, TypeError, ValueError):  # damaged: measure again
            self.autotune, self.gemm = {}, {}

    def save(self) -> None:
        name, major, minor = self.identity
        write_cache_json(self.path, {"gpu": name, "capability": f"{major}.{minor}", "torch": torch.__version__,
                                     "triton": _triton_version(), "autotune": self.autotune, "gemm": self.gemm})

    def put_autotune(self, kernel: str, key: str, config: dict[str, Any]) -> None:
        self.autotune.setdefault(kernel, {})[key] = config
        self.save()

    def put_gemm(self, key: str, backend: str) -> None:
        self.gemm[key] = backend
        self.save()


def store(identity: Identity) -> TuningStore:
    """The store of this identity, read from disk once per process and cache folder."""
    path = store_path(identity)
    found = _stores.get(path)
    if found is None:
        found = _stores[path] = TuningStore(path, identity)
    return found


@contextlib.contextmanager
def reporting(on_tune: Callable[[], None]) -> Iterator[None]:
    """Calls ``on_tune()`` each time a choice is measured for the first time inside the block."""
    global _on_tune
    previous, _on_tune = _on_tune, on_tune
    try:
        yield
    finally:
        _on_tune = previous


def note_tuning() -> None:
    if _on_tune is not None:
        _on_tune()


def config_record(config: Any) -> dict[str, Any]:
    """A ``triton.Config`` as stored."""
    return {"kwargs": dict(config.kwargs), "num_warps": int(config.num_warps), "num_stages": int(config.num_stages)}


class PersistentConfigs(dict):  # type: ignore[type-arg]
    """Stands in for a ``triton.runtime.Autotuner``'s in-memory ``cache`` (shape key -> the
    chosen ``triton.Config``), which Triton reads with ``key in cache`` and fills with
    ``cache[key] = best``: entries come from the store on first use, a miss means a tuning is
    about to run (``note_tuning``), and each new choice is written through to the store.
    A stored config the autotuner no longer offers is ignored."""

    def __init__(self, kernel: str, configs: list[Any], identity: Callable[[], Identity]) -> None:
        super().__init__()
        self.kernel = kernel
        self.configs = configs
        self.identity = identity
        self._store: TuningStore | None = None

    def _loaded(self) -> TuningStore:
        if self._store is None:
            self._store = store(self.identity())
            offered = {json.dumps(config_record(c), sort_keys=True): c for c in self.configs}
            for text, record in self._store.autotune.get(self.kernel, {}).items():
                config = offered.get(json.dumps(record, sort_keys=True))
                if config is not None:
                    super().__setitem__(ast.literal_eval(text), config)
        return self._store

    def __contains__(self, key: object) -> bool:
        self._loaded()
        if super().__contains__(key):
            return True
        note_tuning()
        return False

    def __setitem__(self, key: Any, config: Any) -> None:
        super().__setitem__(key, config)
        self._loaded().put_autotune(self.kernel, repr(key), config_record(config))
