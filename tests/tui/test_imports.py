"""The TUI's modules import one way: app on top, then the palette and the panes, then screens
and widgets, then the Textual-free backend. Imports under TYPE_CHECKING count too: a
circle there is still two modules that each need the other to be understood."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import localllm.tui

TUI = Path(localllm.tui.__file__).parent


def _imports(path: Path) -> set[str]:
    """Every localllm.tui module ``path`` imports, at any level of the file."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("localllm.tui"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("localllm.tui")}
    return found


def _graph() -> dict[str, set[str]]:
    return {f"localllm.tui.{p.stem}": _imports(p) - {f"localllm.tui.{p.stem}"}
            for p in TUI.glob("*.py") if p.stem != "__init__"}


def test_no_import_circles_in_the_tui() -> None:
    graph = _graph()
    visiting: list[str] = []
    done: set[str] = set()

    def visit(module: str) -> None:
        if module in done:
            return
        assert module not in visiting, "import circle: " + " -> ".join([*visiting[visiting.index(module):], module])
        visiting.append(module)
        for dep in graph.get(module, ()):
            visit(dep)
        visiting.pop()
        done.add(module)

    for module in graph:
        visit(module)


def test_only_the_launcher_imports_the_app() -> None:
    importers = sorted(m for m, deps in _graph().items() if "localllm.tui.app" in deps)
    assert importers == ["localllm.tui.cli"]


def test_the_backend_needs_no_textual_and_no_torch() -> None:
    code = ("import sys, localllm.tui.backend, localllm.history; "
            "print(sorted(m for m in ('textual', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
