"""No import circles among localllm's modules, and no import that points up the layers of
docs/architecture.md ("Layering"), read from the source with ``ast``.

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
ARCHITECTURE = ROOT / "docs" / "architecture.md"
# package name -> source folder (pyproject installs kernels/ as localllm.kernels)
PACKAGES = {"localllm": ROOT / "localllm", "localllm.kernels": ROOT / "kernels"}
LAZY_TARGET = re.compile(r"^(localllm(?:\.\w+)+):\w+$")

# docs/architecture.md's layers, bottom first. A module may import its own layer and the ones
# below, never one above. "pkg.*" places a package and everything under it that is not placed
# more precisely (an exact name, or a longer "pkg.*"); a module placed nowhere fails the test,
# so a new top-level module gets a layer on purpose. New files under a placed package land in
# its layer: quant's default is its linears (low), so a new quant module may be imported from
# the model and the format readers, and one that needs the pipeline side says so here.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("foundation", ("localllm.errors", "localllm.paths", "localllm.console", "localllm.catalog",
                    "localllm.models.config", "localllm.models.kv_spec",  # torch-free: the catalog reads them
                    "localllm.history", "localllm.tokenizer", "localllm.harmony", "localllm.reasoning",
                    "localllm.quant.gguf_formats")),  # the GGUF traits table: no imports; the GPU kernels read it
    ("kernels", ("localllm.kernels.*",)),
    ("the model", ("localllm.models.*", "localllm.quant.*")),
    ("the KV cache", ("localllm.engine.kv_cache",)),
    ("planning", ("localllm.hardware.*",)),
    ("formats", ("localllm.models.checkpoint", "localllm.models.hf", "localllm.models.gguf_file",
                 "localllm.models.formats", "localllm.models.export")),
    ("the store", ("localllm.store",)),
    ("quant methods", ("localllm.quant", "localllm.quant.methods", "localllm.quant.checkpoint",
                       "localllm.quant.awq_search", "localllm.quant.forward", "localllm.quant.kv_cache")),
    ("loading", ("localllm.models.loader",)),
    # a sequence holds its per-request speculative state (engine/spec_decode.py)
    ("requests", ("localllm.engine.sequence", "localllm.engine.block_manager", "localllm.engine.spec_decode")),
    ("the step", ("localllm.engine.*",)),
    ("engines", ("localllm", "localllm.api", "localllm.engine.async_engine", "localllm.server.remote")),
    ("front ends", ("localllm.cli", "localllm.cli_common", "localllm.commands", "localllm.bench", "localllm.tui.*",
                    "localllm.server.*", "localllm.quant.cli", "localllm.quant.eval", "localllm.hardware.cli")),
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


def _layer_of(name: str) -> int | None:
    """The index in LAYERS of ``name``: an exact entry first, else its longest "pkg.*" entry."""
    best: tuple[int, int] | None = None  # (prefix length, layer)
    for i, (_, entries) in enumerate(LAYERS):
        for entry in entries:
            if entry == name:
                return i
            pkg = entry.removesuffix(".*")
            if entry.endswith(".*") and (name == pkg or name.startswith(pkg + ".")):
                if best is None or len(pkg) > best[0]:
                    best = (len(pkg), i)
    return None if best is None else best[1]


def _upward(graph: dict[str, set[str]]) -> list[str]:
    """Each import from a module to one in a higher layer, as one readable line."""
    out = []
    for name, targets in sorted(graph.items()):
        here = _layer_of(name)
        for target in sorted(targets):
            there = _layer_of(target)
            if here is not None and there is not None and there > here:
                out.append(f"{name} ({LAYERS[here][0]}) imports {target} ({LAYERS[there][0]})")
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
    assert "localllm.kernels.cpu_ops" in g["localllm.engine.sampler"]  # kernels/ is localllm.kernels
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]


def test_no_import_circles() -> None:
    circles = [sorted(c) for c in _circles(_graph())]
    assert not circles, f"import circles: {circles}"


def test_the_layer_check_sees_an_upward_import() -> None:
    assert _layer_of("localllm.models.llama") < _layer_of("localllm.models.gguf_file") < _layer_of("localllm.store")
    assert _layer_of("localllm.quant.gguf") < _layer_of("localllm.quant.methods") < _layer_of("localllm.models.loader")
    assert _layer_of("localllm.engine.async_engine") > _layer_of("localllm.engine.engine")
    assert _layer_of("localllm.nowhere") is None
    # the loader's old shape: a format reader used by store, and itself using the store
    assert _upward({"localllm.models.gguf_file": {"localllm.store"}, "localllm.store": {"localllm.models.gguf_file"}}) \
        == ["localllm.models.gguf_file (formats) imports localllm.store (the store)"]


def test_every_module_has_a_layer() -> None:
    unplaced = sorted(name for name in _graph() if _layer_of(name) is None)
    assert not unplaced, f"modules in no layer of LAYERS (place them as docs/architecture.md says): {unplaced}"


def test_no_import_points_up_the_layers() -> None:
    upward = _upward(_graph())
    assert not upward, "imports that point up the layers of docs/architecture.md:\n" + "\n".join(upward)


def test_the_architecture_doc_draws_these_layers() -> None:
    """docs/architecture.md's Layering block names LAYERS top first, one label per layer."""
    text = ARCHITECTURE.read_text()
    block = text[text.index("## Layering"):].split("```text\n", 1)[1].split("```", 1)[0]
    drawn = [line[:14].strip() for line in block.splitlines() if line and not line[0].isspace()]
    assert drawn == [name for name, _ in reversed(LAYERS)]
