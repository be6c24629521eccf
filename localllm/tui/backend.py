"""What the TUI needs from the rest of localllm, without Textual: the engine interface it
talks to, the config file, sampling parameters, model verdicts for the palette, and small
text helpers.

Keeping these free of Textual lets them be tested and reused (``localllm chat --endpoint``
swaps the engine for a remote one behind the same interface).
"""

from __future__ import annotations

import ctypes
import gc
import math
import re
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from localllm.hardware.planner import fmt_bytes
from localllm.paths import config_path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib

if TYPE_CHECKING:
    from localllm.engine.async_engine import AsyncEngine
    from localllm.engine.engine import EngineStats, Prompt, RequestOutput
    from localllm.engine.sequence import SamplingParams
    from localllm.reasoning import ReasoningFormat
    from localllm.tokenizer import Message, Tokenizer

# (stage, done, total) from a loading or pulling thread; total == 0 means "size unknown".
Progress = Callable[[str, int, int], None]


class ChatEngine(Protocol):
    """What the chat needs of an engine. ``LocalChatEngine`` (the engine in this process) and
    ``RemoteEngine`` (an OpenAI-compatible server) provide it.

    Invariants: ``generate`` yields outputs whose last one has ``finished`` set, and closing
    its iterator early aborts the request; ``stats`` is a cheap snapshot, safe to read from the
    UI thread at any time; after ``shutdown`` the engine holds no model memory."""

    @property
    def tokenizer(self) -> Tokenizer | None:
        """None when the engine tokenizes out of reach (a remote server)."""

    @property
    def max_model_len(self) -> int | None:
        """The most tokens one chat may hold, prompt and reply together; None if unknown."""

    @property
    def sampling_defaults(self) -> dict[str, float | int]:
        """The model's own sampling settings (keys are ``SamplingParams`` fields), only those
        the model sets; a new tab starts from these."""

    @property
    def served_models(self) -> list[str]:
        """Models a switch can reach without a pull: a server's list; empty for the local engine."""

    @property
    def reasoning(self) -> ReasoningFormat | None:
        """How the model's replies mark their reasoning, which the chat shows apart from the
        answer; None when they hold none to split (or a server splits it off itself)."""

    def generate(self, prompt: Prompt, params: SamplingParams | None = None,
                 request_id: str | None = None) -> AsyncIterator[RequestOutput]: ...

    def stats(self) -> EngineStats: ...

    def abort(self, request_id: str) -> None: ...

    def shutdown(self) -> None: ...


# model name (None = the default) + a progress callback -> a ready engine. Runs in a thread.
EngineFactory = Callable[[str | None, Progress | None], ChatEngine]


class LocalChatEngine:
    """The in-process ``AsyncEngine`` as a ``ChatEngine``."""

    def __init__(self, engine: AsyncEngine, reasoning_parser: str | None = None) -> None:
        """``reasoning_parser``: ``--reasoning-parser`` (vLLM's names, ``none``); by default the
        model's chat template and architecture decide."""
        from localllm.reasoning import format_for

        self._engine: AsyncEngine | None = engine
        llm = engine.engine
        self.tokenizer: Tokenizer | None = llm.tokenizer
        self.reasoning: ReasoningFormat | None = format_for(llm.tokenizer, llm.runner.model.config.architecture,
                                                             reasoning_parser)
        self.max_model_len: int | None = llm.context_limit  # the limit add_request enforces
        # what the model asks for (generation_config.json, or models.toml for a GGUF file)
        self.sampling_defaults: dict[str, float | int] = dict(llm.sampling_defaults)
        self.served_models: list[str] = []
        self._last_stats = engine.stats()

    @property
    def engine(self) -> AsyncEngine | None:
        """The wrapped engine; None once shut down."""
        return self._engine

    def generate(self, prompt: Prompt, params: SamplingParams | None = None,
                 request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        if self._engine is None:
            from localllm.errors import LocalLLMError

            raise LocalLLMError("the engine was shut down")
        return self._engine.generate(prompt, params, request_id)

    def stats(self) -> EngineStats:
        if self._engine is not None:
            self._last_stats = self._engine.stats()
        return self._last_stats

    def abort(self, request_id: str) -> None:
        if self._engine is not None:
            self._engine.abort(request_id)

    def shutdown(self) -> None:
        """Stops the engine thread and gives the model's memory back to the system: without
        the collection and the trim, RSS stays at its peak after a model switch."""
        engine, self._engine = self._engine, None
        if engine is None:
            return
        engine.shutdown()
        del engine
        gc.collect()
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            torch.cuda.empty_cache()
        if sys.platform.startswith("linux"):
            try:
                ctypes.CDLL("libc.so.6").malloc_trim(0)
            except (OSError, AttributeError):  # not glibc (musl): the allocator keeps its own pace
                pass


# ---- config.toml ----

# The last resort, below the model's own defaults and the config file's [chat] table.
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
PARAM_LABELS = {
    "temperature": "Temperature", "top_p": "Top p", "top_k": "Top k (-1 off)", "min_p": "Min p",
    "repetition_penalty": "Repetition penalty", "max_tokens": "Max tokens", "seed": "Seed",
}


@dataclass(slots=True)
class ChatConfig:
    keymap: dict[str, str] = field(default_factory=dict)  # binding id -> keys, for App.set_keymap
    system_prompt: str = ""  # "" = the model's own default (its chat template decides)
    params: dict[str, Any] = field(default_factory=dict)  # only those [chat] sets
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
        return _int(value)
    if key in ("top_k", "max_tokens"):
        return _int(value)
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"expected a number, got {value!r}") from None
    if not math.isfinite(number):
        raise ValueError(f"expected a finite number, got {value!r}")
    return number


def _int(value: Any) -> int:
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ValueError(f"expected a whole number, got {value!r}")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"expected a whole number, got {value!r}") from None


def base_params(model_defaults: dict[str, float | int], config_params: dict[str, Any]) -> dict[str, Any]:
    """What a tab runs with before its own settings: the model's defaults over ours, the
    config file over both."""
    model = {k: v for k, v in model_defaults.items() if k in PARAM_KEYS}
    return {**DEFAULT_PARAMS, **model, **config_params}


def parse_params(raw: dict[str, str], base: dict[str, Any]) -> dict[str, Any]:
    """Form fields (strings; empty = keep the default) -> the tab's own settings, checked
    together with ``base`` by ``SamplingParams``. Raises ValueError with a one-line message
    naming the field."""
    from localllm.errors import LocalLLMError

    out: dict[str, Any] = {}
    for key in PARAM_KEYS:
        text = raw.get(key, "").strip()
        if not text:
            continue
        try:
            out[key] = _coerce_param(key, text)
        except ValueError as e:
            raise ValueError(f"{PARAM_LABELS[key]}: {e}") from None
    try:
        sampling_params({**base, **out})
    except LocalLLMError as e:
        raise ValueError(str(e)) from None
    return out


def sampling_params(params: dict[str, Any]) -> SamplingParams:
    from localllm.engine.sequence import SamplingParams

    known = {k: v for k, v in params.items() if k in SamplingParams.__dataclass_fields__}
    return SamplingParams(**known)


# ---- the context window ----

def estimate_tokens(text: str) -> int:
    """A guess at the tokens ``text`` takes as a chat message, for when nothing exact is at
    hand (a server that reports no usage): generous, 3 characters a token (English averages
    about 4), plus a template's framing around a message (ChatML: 5)."""
    return len(text) // 3 + 1 + 8


def chat_tokens(tokenizer: Tokenizer, messages: list[Message], add_generation_prompt: bool) -> int | None:
    """The exact length of ``messages`` through the chat template, as the engine tokenizes a
    chat prompt (``add_generation_prompt=True``: the prompt itself); None where the template
    refuses them (some require alternating roles), which the engine would refuse too."""
    if not messages:
        return 0  # some templates index messages[0]
    try:
        return len(tokenizer.encode_chat(messages, add_generation_prompt))
    except Exception:  # noqa: BLE001 - a count is never worth a crash; the caller guesses
        return None


def continuation_prompt(tokenizer: Tokenizer | None, messages: list[Message], partial: str,
                        reasoning: str = "") -> Prompt:
    """The prompt that makes the model go on with ``partial``, a reply it left unfinished
    (``reasoning``: what it thought before it, for a format that keeps it apart).
    With a tokenizer: the chat template up to the reply, then the reply's own tokens; for
    gpt-oss (harmony) the reply is an open message, so the model goes on inside it: its
    reasoning as the ``analysis`` message it wrote, then ``<|start|>assistant<|channel|>final<|message|>``
    and the partial answer (inside ``analysis`` when the reply was cut before any answer).
    Without a tokenizer (a server): the partial reply as the last message, which servers that
    support assistant prefill (llama-server, vLLM with continue_final_message) continue."""
    if tokenizer is not None and tokenizer.speaks_harmony:
        from localllm import harmony

        cut = {"role": "assistant", "content": partial, **({"reasoning_content": reasoning} if reasoning else {})}
        # the open message's text follows <|message|>, a special token: its ids are the reply's own
        return tokenizer.encode_rendered(harmony.render([*messages, cut], add_generation_prompt=False,
                                                        continue_final=True))
    if tokenizer is not None:
        return tokenizer.encode_chat(messages) + tokenizer.encode(partial, add_special_tokens=False)
    return [*messages, {"role": "assistant", "content": partial}]


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
