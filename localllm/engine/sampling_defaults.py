"""What a model wants to be sampled with when the caller does not say.

Two sources, as vLLM and llama.cpp read them: an HF folder's ``generation_config.json``
(``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``; ``do_sample: false``
means greedy), and, for GGUF files and catalog models, the entry's ``sampling`` table in
models.toml. The file wins over the catalog for the keys it sets: it is the model authors' own
choice. The result holds only the keys some source sets, by ``SamplingParams`` name, so every
caller can put its own fallback under it (OpenAI's defaults on the server, 0.7 in ``run``).
"""

from __future__ import annotations

from pathlib import Path

from localllm.catalog import DEFAULT_MODEL, SAMPLING_KEYS, CatalogEntry, get_entry, load_catalog
from localllm.engine.sequence import SamplingParams
from localllm.errors import LocalLLMError
from localllm.paths import models_dir
from localllm.tokenizer import _read_json

SamplingDefaults = dict[str, float | int]


def sampling_defaults(path: Path, name: str | None) -> SamplingDefaults:
    """The defaults for the model loaded from ``path`` (which the user named ``name``).

    Raises LocalLLMError naming the source when a value is out of range or of the wrong type.
    """
    values: SamplingDefaults = {}
    sources: list[str] = []
    entry = catalog_entry_for(path, name)
    if entry is not None and entry.sampling:
        values.update(entry.sampling)
        sources.append(f"the 'sampling' table of models.toml entry {entry.id!r}")
    gen_file = path / "generation_config.json"
    if path.is_dir() and gen_file.is_file():
        from_file = read_generation_config(gen_file)
        if from_file:
            values.update(from_file)
            sources.append(str(gen_file))
    try:
        SamplingParams(**values)
    except LocalLLMError as e:
        raise LocalLLMError(f"sampling defaults from {' and '.join(sources)}: {e}") from None
    return values


def read_generation_config(path: Path) -> SamplingDefaults:
    """The sampling keys of an HF ``generation_config.json`` (types checked, ranges not)."""
    raw = _read_json(path)
    if not isinstance(raw, dict):
        raise LocalLLMError(f"{path}: expected a JSON object")
    values: SamplingDefaults = {}
    for key, kind in SAMPLING_KEYS.items():
        value = raw.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
            raise LocalLLMError(f"{path}: {key!r} must be {'an integer' if kind is int else 'a number'}, "
                                f"got {value!r}")
        values[key] = kind(value)
    if values.get("top_k") == 0:  # transformers' "no top-k"; SamplingParams spells it -1
        values["top_k"] = -1
    if raw.get("do_sample") is False:
        # transformers then decodes greedily and ignores the truncation settings
        values = {k: v for k, v in values.items() if k == "repetition_penalty"}
        values["temperature"] = 0.0
    return values


def catalog_entry_for(path: Path, name: str | None) -> CatalogEntry | None:
    """The catalog entry a loaded model is, if any: by the name the user gave (a catalog id or
    HF repo id), by the store folder it was pulled into, or by the file name of a GGUF a
    catalog source ships (the same file copied elsewhere)."""
    entry = get_entry(name or DEFAULT_MODEL)
    if entry is not None:
        return entry
    try:
        folder = path.resolve() if path.is_dir() else path.resolve().parent
        if folder.parent == models_dir().resolve():
            entry = get_entry(folder.name.replace("--", "/"))
            if entry is not None:
                return entry
    except OSError:
        pass
    if path.suffix == ".gguf":
        for candidate in load_catalog().values():
            if any(s.file and Path(s.file).name == path.name for s in candidate.sources):
                return candidate
    return None
