"""The bench/ scripts as modules, loaded by path: bench/ is not a package and is not put on the
test process's sys.path (the scripts put it on theirs when they run)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"


def load_bench(name: str) -> ModuleType:
    """bench/<name>.py, executed afresh at each call and not put in ``sys.modules``; or, where
    bench/<name> is a folder (the package bench/peers), that package as ``name``, which the
    scripts import as a top-level package: loaded once and kept in ``sys.modules`` (its
    dataclasses and relative imports resolve their module there)."""
    package = BENCH / name
    is_package = package.is_dir()
    if is_package:
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, package / "__init__.py",
                                                      submodule_search_locations=[str(package)])
    else:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    if is_package:
        sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
