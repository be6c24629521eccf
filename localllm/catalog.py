"""The model catalog: ``models.toml`` parsed into frozen entries.

The file ships inside the package (``localllm/models.toml``). ``LOCALLLM_CATALOG`` points
at another file, which is how tests and users try a catalog of their own. A malformed
file is a :class:`LocalLLMError` that names the file, the entry and the field, so a typo
never turns into a traceback or, worse, a silently wrong memory plan.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from localllm.errors import LocalLLMError
from localllm.models.config import architecture_supported

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib

DEFAULT_MODEL = "smollm2-135m-instruct"

QUANT_KINDS = ("awq", "fp8", "gguf")
SOURCE_KINDS = ("hf", "pypi")
# The sampling defaults a model may set (a ``sampling`` table in models.toml, or its
# generation_config.json), by SamplingParams name, with the type each holds.
SAMPLING_KEYS: dict[str, type] = {
    "temperature": float, "top_p": float, "top_k": int, "min_p": float, "repetition_penalty": float,
}

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_GGUF_MIX = re.compile(r"^(F16|BF16|F32|I?Q[1-8]_[0-9A-Z_]+)$")  # llama.cpp's names: Q4_K_M, Q8_0, IQ4_XS


@dataclass(frozen=True, slots=True)
class ModelSource:
    kind: str
    repo: str | None = None
    package: str | None = None
    version: str | None = None
    file: str | None = None
    sha256: str | None = None


@dataclass(frozen=True, slots=True)
class CatalogEntry:
    id: str
    hf_repo: str
    architecture: str
    supported: bool
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_context: int
    tie_word_embeddings: bool
    params: int
    quantized: dict[str, tuple[str, ...]]
    sources: tuple[ModelSource, ...]
    notes: str
    # Where the config.json figures were read; informational, so it may be empty.
    config_source: str = field(default="")
    # Sampling defaults for this model (SAMPLING_KEYS only); the engine validates the ranges.
    sampling: dict[str, float | int] = field(default_factory=dict)
    # Published GGUF file sizes in bytes by llama.cpp quantization name ("Q4_K_M"): what the
    # planner sizes a GGUF plan of this model by (hardware/sizing.py gguf_catalog_weights).
    gguf_sizes: dict[str, int] = field(default_factory=dict)
    # Mixture of experts (Qwen3-MoE, gpt-oss; 0 = a dense model): every layer's MLP is
    # ``num_experts`` experts of width ``moe_intermediate_size``, ``num_experts_per_tok`` of
    # them run per token. The planner sizes memory by all of them and decode by those k
    # (hardware/sizing.py); ``intermediate_size`` stays config.json's value.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0


_cache: dict[Path, dict[str, CatalogEntry]] = {}


def _default_path() -> Path:
    override = os.environ.get("LOCALLLM_CATALOG")
    if override:
        return Path(override).expanduser()
    # Installed wheels are unpacked on disk, so a plain path works for them, editable
    # installs and a source tree alike. importlib.resources refuses namespace packages
    # (a tree without localllm/__init__.py), where this module's own folder is the answer.
    try:
        packaged = Path(str(resources.files("localllm").joinpath("models.toml")))
        if packaged.is_file():
            return packaged
    except (TypeError, ValueError, OSError):
        pass
    return Path(__file__).with_name("models.toml")


def load_catalog(path: Path | None = None) -> dict[str, CatalogEntry]:
    """All entries by id, in file order. Cached per path; raises LocalLLMError when malformed."""
    path = Path(path) if path is not None else _default_path()
    key = path.resolve() if path.exists() else path
    if key in _cache:
        return _cache[key]
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise LocalLLMError(
            f"{path}: cannot read the model catalog ({e.strerror or e}); reinstall localllm or fix LOCALLLM_CATALOG"
        ) from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise LocalLLMError(f"{path}: not valid TOML: {_one_line(str(e))}") from None
    models = data.get("model")
    if not isinstance(models, list) or not models:
        raise LocalLLMError(f"{path}: no [[model]] tables; each catalog entry is a [[model]] table")
    entries: dict[str, CatalogEntry] = {}
    for index, table in enumerate(models):
        entry = _parse_entry(path, index, table)
        if entry.id in entries:
            raise LocalLLMError(f"{path}: model '{entry.id}': field 'id': duplicate id; ids must be unique")
        entries[entry.id] = entry
    _cache[key] = entries
    return entries


def get_entry(name: str) -> CatalogEntry | None:
    """The entry whose id (or HF repo id) is ``name``, ignoring case; None if there is none."""
    wanted = name.strip().lower()
    catalog = load_catalog()
    for entry in catalog.values():
        if entry.id.lower() == wanted or entry.hf_repo.lower() == wanted:
            return entry
    return None


def _one_line(text: str) -> str:
    return " ".join(text.split())


class _Fields:
    """Typed access to one [[model]] table; every failure names file, entry and field."""

    __slots__ = ("path", "label", "table")

    def __init__(self, path: Path, label: str, table: dict[str, Any]) -> None:
        self.path = path
        self.label = label
        self.table = table

    def fail(self, name: str, problem: str) -> LocalLLMError:
        return LocalLLMError(f"{self.path}: model {self.label}: field '{name}': {problem}")

    def get(self, name: str, kind: type, *, default: Any = ...) -> Any:
        if name not in self.table:
            if default is ...:
                raise self.fail(name, "missing")
            return default
        value = self.table[name]
        # bool is an int subclass in Python, and TOML has both, so keep them apart.
        if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise self.fail(name, f"expected an integer, got {value!r}")
        if kind is not int and not isinstance(value, kind):
            raise self.fail(name, f"expected {kind.__name__}, got {value!r}")
        return value

    def positive(self, name: str) -> int:
        value = self.get(name, int)
        if value <= 0:
            raise self.fail(name, f"must be positive, got {value}")
        return value

    def text(self, name: str, *, default: Any = ...) -> str:
        value = self.get(name, str, default=default)
        if default is ... and not value.strip():
            raise self.fail(name, "must not be empty")
        return value


def _parse_entry(path: Path, index: int, table: Any) -> CatalogEntry:
    if not isinstance(table, dict):
        raise LocalLLMError(f"{path}: [[model]] #{index + 1}: expected a table")
    raw_id = table.get("id")
    label = f"'{raw_id}'" if isinstance(raw_id, str) and raw_id else f"#{index + 1}"
    f = _Fields(path, label, table)

    entry_id = f.text("id")
    num_heads = f.positive("num_heads")
    num_kv_heads = f.positive("num_kv_heads")
    if num_heads % num_kv_heads:
        raise f.fail("num_kv_heads", f"{num_kv_heads} does not divide num_heads {num_heads}")

    quantized_raw = f.get("quantized", dict, default={})
    quantized: dict[str, tuple[str, ...]] = {}
    for kind in QUANT_KINDS:
        repos = quantized_raw.get(kind, [])
        if not isinstance(repos, list) or not all(isinstance(r, str) and r for r in repos):
            raise f.fail(f"quantized.{kind}", f"expected a list of repo ids, got {repos!r}")
        quantized[kind] = tuple(repos)
    unknown = sorted(set(quantized_raw) - set(QUANT_KINDS))
    if unknown:
        raise f.fail("quantized", f"unknown kind {unknown[0]!r}; use {', '.join(QUANT_KINDS)}")

    sources_raw = f.get("sources", list)
    if not sources_raw:
        raise f.fail("sources", "at least one [[model.sources]] table is needed")
    sources = tuple(_parse_source(f, i, s) for i, s in enumerate(sources_raw))

    return CatalogEntry(
        id=entry_id,
        hf_repo=f.text("hf_repo"),
        architecture=f.text("architecture"),
        supported=_supported(f),
        num_layers=f.positive("num_layers"),
        hidden_size=f.positive("hidden_size"),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=f.positive("head_dim"),
        intermediate_size=f.positive("intermediate_size"),
        vocab_size=f.positive("vocab_size"),
        max_context=f.positive("max_context"),
        tie_word_embeddings=f.get("tie_word_embeddings", bool),
        params=f.positive("params"),
        quantized=quantized,
        sources=sources,
        notes=f.text("notes", default=""),
        config_source=f.text("config_source", default=""),
        sampling=_parse_sampling(f),
        gguf_sizes=_parse_gguf_sizes(f),
        **_parse_experts(f),
    )


def _parse_experts(f: _Fields) -> dict[str, int]:
    """The three expert fields: all absent (dense) or all positive, k at most the experts."""
    names = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
    given = [n for n in names if n in f.table]
    if not given:
        return {}
    if len(given) != len(names):
        missing = next(n for n in names if n not in given)
        raise f.fail(missing, f"missing; a mixture-of-experts entry sets all of {', '.join(names)}")
    values = {n: f.positive(n) for n in names}
    if values["num_experts_per_tok"] > values["num_experts"]:
        raise f.fail("num_experts_per_tok", f"{values['num_experts_per_tok']} is more than num_experts "
                                            f"{values['num_experts']}")
    return values


def _parse_gguf_sizes(f: _Fields) -> dict[str, int]:
    raw = f.get("gguf_sizes", dict, default={})
    sizes: dict[str, int] = {}
    for key, value in raw.items():
        if not _GGUF_MIX.match(key):
            raise f.fail(f"gguf_sizes.{key}", "expected a llama.cpp quantization name such as Q4_K_M or Q8_0")
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise f.fail(f"gguf_sizes.{key}", f"expected a positive number of bytes, got {value!r}")
        sizes[key] = value
    return sizes


def _supported(f: _Fields) -> bool:
    """Whether the engine runs the entry's architecture: the model registry says (a
    ``supported`` key, where an entry keeps one, must agree)."""
    supported = architecture_supported(f.text("architecture"))
    stated = f.get("supported", bool, default=None)
    if stated is not None and stated != supported:
        raise f.fail("supported", f"{stated} disagrees with the engine's registry ({supported}); drop the key")
    return supported


def _parse_sampling(f: _Fields) -> dict[str, float | int]:
    raw = f.get("sampling", dict, default={})
    values: dict[str, float | int] = {}
    for key, value in raw.items():
        kind = SAMPLING_KEYS.get(key)
        if kind is None:
            raise f.fail(f"sampling.{key}", f"unknown sampling key; use {', '.join(SAMPLING_KEYS)}")
        # TOML writes 1 and 1.0 differently; a float key takes either, an int key only an integer.
        if isinstance(value, bool) or not isinstance(value, int if kind is int else (int, float)):
            raise f.fail(f"sampling.{key}", f"expected {'an integer' if kind is int else 'a number'}, got {value!r}")
        values[key] = kind(value)
    return values


def _parse_source(f: _Fields, index: int, raw: Any) -> ModelSource:
    name = f"sources[{index}]"
    if not isinstance(raw, dict):
        raise f.fail(name, "expected a table")
    kind = raw.get("kind")
    if kind not in SOURCE_KINDS:
        raise f.fail(f"{name}.kind", f"expected one of {', '.join(SOURCE_KINDS)}, got {kind!r}")
    required = ("repo",) if kind == "hf" else ("package", "version", "file", "sha256")
    values: dict[str, str] = {}
    for key in ("repo", "package", "version", "file", "sha256"):
        value = raw.get(key)
        if value is None:
            if key in required:
                raise f.fail(f"{name}.{key}", f"missing (needed for kind '{kind}')")
            continue
        if not isinstance(value, str) or not value:
            raise f.fail(f"{name}.{key}", f"expected a non-empty string, got {value!r}")
        values[key] = value
    if "sha256" in values and not _SHA256.match(values["sha256"]):
        raise f.fail(f"{name}.sha256", "expected 64 lowercase hex digits")
    return ModelSource(kind=kind, **values)
