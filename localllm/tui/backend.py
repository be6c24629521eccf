"""What the TUI needs from the rest of localllm, without Textual: the engine interface it
talks to, the config file, model verdicts for the palette, and small text helpers.

Keeping these free of Textual lets them be tested and reused (``localllm chat --endpoint``
swaps the engine for a remote one behind the same interface).
"""

from __future__ import annotations

import re
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from localllm.hardware.planner import fmt_bytes, precision_label  # noqa: F401 - precision_label: the TUI imports it from here
from localllm.paths import config_path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib

# (stage, done, total) from a loading or pulling thread; total == 0 means "size unknown".
Progress = Callable[[str, int, int], None]


class ChatEngine(Protocol):
    """The slice of ``AsyncEngine`` the TUI uses; ``RemoteEngine`` offers the same.

    ``stats()`` returns an object with the ``EngineStats`` attributes (model, precision,
    device, batch_size, kv_usage, ...); ``tokenizer`` may be None for a remote engine."""

    @property
    def tokenizer(self) -> Any: ...

    def generate(self, prompt: Any, params: Any = None, request_id: str | None = None) -> AsyncIterator[Any]: ...

    def stats(self) -> Any: ...

    def abort(self, request_id: str) -> None: ...

    def shutdown(self) -> None: ...


# model name (None = the default) + a progress callback -> a ready engine. Runs in a thread.
EngineFactory = Callable[[str | None, Progress | None], ChatEngine]


# ---- config.toml ----

DEFAULT_PARAMS: dict[str, Any] = {
    "temperature": 0.7,
    "top_p": 0.95,
    "top_k": -1,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "max_tokens": 1024,
    "seed": None,
}
PARAM_KEYS = tuple(DEFAULT_PARAMS)


@dataclass(slots=True)
class ChatConfig:
    keymap: dict[str, str] = field(default_factory=dict)  # binding id -> keys, for App.set_keymap
    system_prompt: str = ""  # "" = the model's own default (its chat template decides)
    params: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_PARAMS))
    model: str | None = None
    export_dir: Path | None = None
    problems: list[str] = field(default_factory=list)  # shown as notifications, never fatal


def load_config(path: Path | None = None) -> ChatConfig:
    """Reads ``[keymap]`` and ``[chat]`` from config.toml. A missing file is the default; a bad
    one is reported in ``problems`` and ignored, so a typo never keeps the app from starting."""
    path = path or config_path()
    cfg = ChatConfig()
    if not path.is_file():
        return cfg
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        cfg.problems.append(f"{path}: ignored ({' '.join(str(e).split())})")
        return cfg
    keymap = data.get("keymap", {})
    if isinstance(keymap, dict):
        for key, value in keymap.items():
            if isinstance(value, str) and value.strip():
                cfg.keymap[str(key)] = value
            else:
                cfg.problems.append(f"{path}: [keymap] {key}: expected a key string like \"ctrl+n\"")
    else:
        cfg.problems.append(f"{path}: [keymap] must be a table")
    chat = data.get("chat", {})
    if not isinstance(chat, dict):
        cfg.problems.append(f"{path}: [chat] must be a table")
        return cfg
    if isinstance(chat.get("system_prompt"), str):
        cfg.system_prompt = chat["system_prompt"]
    if isinstance(chat.get("model"), str) and chat["model"]:
        cfg.model = chat["model"]
    if isinstance(chat.get("export_dir"), str) and chat["export_dir"]:
        cfg.export_dir = Path(chat["export_dir"]).expanduser()
    for key in PARAM_KEYS:
        if key in chat:
            try:
                cfg.params[key] = _coerce_param(key, chat[key])
            except ValueError as e:
                cfg.problems.append(f"{path}: [chat] {key}: {e}")
    return cfg


def _coerce_param(key: str, value: Any) -> Any:
    if key == "seed":
        if value is None or value == "":
            return None
        return int(value)
    if key in ("top_k", "max_tokens"):
        if isinstance(value, bool):
            raise ValueError(f"expected an integer, got {value!r}")
        return int(value)
    return float(value)


def parse_params(raw: dict[str, str]) -> dict[str, Any]:
    """Form fields (strings) -> typed sampling parameters, validated by ``SamplingParams``.
    Raises ValueError with a message fit for the user."""
    from localllm.errors import LocalLLMError

    out: dict[str, Any] = {}
    for key in PARAM_KEYS:
        text = raw.get(key, "").strip()
        try:
            out[key] = _coerce_param(key, text) if text else DEFAULT_PARAMS[key]
        except ValueError:
            raise ValueError(f"{key}: {text!r} is not a number") from None
    try:
        sampling_params(out)
    except LocalLLMError as e:
        raise ValueError(str(e)) from None
    return out


def sampling_params(params: dict[str, Any]) -> Any:
    from localllm.engine.sequence import SamplingParams

    known = {k: v for k, v in params.items() if k in SamplingParams.__dataclass_fields__}
    return SamplingParams(**known)


# ---- models: what the palette offers ----


@dataclass(slots=True)
class ModelChoice:
    id: str
    local: bool
    verdict: str  # "fp32 · fits" / "does not fit" / "not in the catalog"
    fits: bool | None
    size_bytes: int = 0
    detail: str = ""


@dataclass(slots=True)
class ProbeReport:
    hardware: list[str]
    rows: list[ModelChoice]


def probe_report(chats: int = 4) -> ProbeReport:
    """The hardware and a verdict for every catalog model and every pulled model. Slow-ish
    (probes devices), so callers run it in a thread."""
    from localllm import store
    from localllm.catalog import load_catalog
    from localllm.errors import LocalLLMError
    from localllm.hardware.planner import DoesNotFit, plan, probe_hardware

    hw = probe_hardware()
    cpu = hw.cpu
    lines = [
        f"CPU  {cpu.model}, {cpu.physical_cores} physical / {cpu.logical_cores} logical cores, {cpu.arch}",
        f"RAM  {fmt_bytes(hw.ram_total_bytes)} total, {fmt_bytes(hw.ram_available_bytes)} available",
    ]
    if hw.gpus:
        lines += [f"GPU  {g.index}: {g.name}, {fmt_bytes(g.total_bytes)} ({fmt_bytes(g.free_bytes)} free),"
                  f" compute capability {g.cc_str}" for g in hw.gpus]
    else:
        lines.append("GPU  none")
    lines += [f"note {n}" for n in hw.notes]

    catalog = load_catalog()
    local = {m.id: m for m in store.local_models()}
    rows: list[ModelChoice] = []
    seen: set[str] = set()
    for entry in catalog.values():
        seen.add(entry.id)
        lm = local.get(entry.id) or local.get(entry.hf_repo)
        if not entry.supported:
            rows.append(ModelChoice(entry.id, lm is not None, "architecture not supported yet", False,
                                    lm.size_bytes if lm else 0, entry.architecture))
            continue
        try:
            p = plan(entry, hw, chats=chats, suggest_models=False)
        except DoesNotFit as e:
            rows.append(ModelChoice(entry.id, lm is not None, "does not fit", False,
                                    lm.size_bytes if lm else 0, str(e)))
        except LocalLLMError as e:
            rows.append(ModelChoice(entry.id, lm is not None, "cannot plan", False, 0, str(e)))
        else:
            rows.append(ModelChoice(entry.id, lm is not None, f"{p.precision} on {p.device} · fits", True,
                                    lm.size_bytes if lm else 0,
                                    f"{p.max_model_len:,} ctx · {p.precision_reason}"))
    for mid, lm in local.items():
        if mid not in seen and not any(r.id == mid for r in rows):
            rows.append(ModelChoice(mid, True, "not in the catalog: fit unknown", None, lm.size_bytes))
    return ProbeReport(lines, rows)


# ---- text helpers ----

_FENCE_OPEN = re.compile(r"^\s{0,3}(`{3,}|~{3,})")


def code_blocks(markdown: str) -> list[str]:
    """The fenced code blocks of a reply, in order. An unterminated last fence counts: a reply
    stopped mid-block still has its code."""
    blocks: list[str] = []
    current: list[str] | None = None
    fence = ""
    for line in markdown.splitlines():
        if current is None:
            m = _FENCE_OPEN.match(line)
            if m:
                fence, current = m.group(1), []
            continue
        closing = line.strip()
        if closing and set(closing) == {fence[0]} and len(closing) >= len(fence):
            blocks.append("\n".join(current))
            current = None
        else:
            current.append(line)
    if current is not None:
        blocks.append("\n".join(current))
    return blocks


_process: Any = None


def memory_label(device: str) -> str:
    """VRAM when the engine runs on a local GPU, else this process's RSS."""
    global _process
    if device.startswith("cuda"):
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            return f"VRAM {fmt_bytes(torch.cuda.memory_reserved())}"
    try:
        import psutil

        if _process is None:
            _process = psutil.Process()
        return f"RAM {fmt_bytes(_process.memory_info().rss)}"
    except Exception:  # noqa: BLE001 - a status figure is never worth a crash
        return "RAM ?"


def title_from(text: str, width: int = 24) -> str:
    line = " ".join(text.split())
    return line if len(line) <= width else line[: width - 1].rstrip() + "…"
