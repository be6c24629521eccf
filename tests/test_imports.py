"""No import circles among localllm's modules, read from the source with ``ast``.

Every import counts: at module level, inside functions (a lazy import is still a
dependency, only a later one) and under ``TYPE_CHECKING`` (a type-only import still means the
module knows the other's insides). So do the ``"localllm.x:func"`` strings that ``cli.py``
resolves with ``importlib`` to register and run subcommands.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# package name -> source folder (pyproject installs kernels/ as localllm.kernels)
PACKAGES = {"localllm": ROOT / "localllm", "localllm.kernels": ROOT / "kernels"}
LAZY_TARGET = re.compile(r"^(localllm(?:\.\w+)+):\w+$")

# Circles still being untangled elsewhere; each entry goes when its circle is gone:
# - the loader reads checkpoint formats and also runs the whole load pipeline, so store and
#   quant (which need only the format readers) and the loader import each other.
KNOWN_CIRCLES = [
    {"localllm.models.loader", "localllm.quant", "localllm.quant.checkpoint", "localllm.quant.methods",
     "localllm.store"},
]


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts))
            mods[name.removesuffix(".__init__")] = path
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            # "from pkg import mod" imports the module pkg.mod; "from mod import name" imports mod
            targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and (m := LAZY_TARGET.match(node.value)):
            targets.add(m.group(1))
    found = set()
    for target in targets:
        while target and target not in mods:  # "localllm.x.func" -> the module localllm.x
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)
    return found


def _circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components with more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[set[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(comp)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def test_the_graph_sees_every_kind_of_import() -> None:
    g = _graph()
    assert "localllm.engine.model_runner" in g["localllm.engine.engine"]  # module level
    assert "localllm.models.loader" in g["localllm.engine.engine"]  # inside a function
    assert "localllm.hardware.planner" in g["localllm.engine.engine"]  # under TYPE_CHECKING
    assert "localllm.commands" in g["localllm.cli"]  # a "module:function" string
    assert "localllm.kernels" in g["localllm.models.llama"]  # kernels/ is localllm.kernels
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]


def test_no_import_circles() -> None:
    unexpected = [sorted(c) for c in _circles(_graph()) if not any(c <= known for known in KNOWN_CIRCLES)]
    assert not unexpected, f"import circles: {unexpected}"
