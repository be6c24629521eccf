"""The status bar's one line: the model and where it runs, the reply rate, the batch (or this
client's streams), the active tab's context against the limit, KV use, prefix-cache hits, memory
and background optimizing; or, without an engine, the load's progress or why there is none.

Built from the ``EngineHost`` and the active tab's figures each repaint (``STATUS_HZ``); at 80
columns the line is cut from the right, so what matters most comes first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from rich.text import Text

from localllm.hardware.planner import precision_label
from localllm.tui.backend import memory_label
from localllm.tui.engine_host import EngineHost

STATUS_HZ = 4  # status figures change slowly; 4 repaints a second are plenty and cheap
FILL_WARN, FILL_FULL = 0.8, 0.95  # the context gauge turns yellow, then red


class TabFigures(Protocol):
    """What the line reads from the active tab."""

    last_tok_s: float
    last_cached_tokens: int

    def context(self, upto: int | None = None) -> tuple[int, bool]: ...

    def context_limit(self) -> int | None: ...


def status_text(host: EngineHost, chat: TabFigures | None) -> Text:
    text = Text()
    if host.engine is None:
        if host.loading:
            stage, done, total = host.load_progress
            pct = done / total if total else 0.0
            filled = int(pct * 20)
            text.append(f" loading {host.model_request or 'the default model'} ", style="bold")
            text.append("█" * filled + "░" * (20 - filled), style="cyan")
            text.append(f" {stage} {pct:.0%}" if total else f" {stage}…")
        elif host.error:
            text.append(f" {host.error}", style="bold red")
        elif host.endpoint:
            text.append(f" not connected to {host.endpoint}: ctrl+p, then Reconnect", style="yellow")
        else:
            text.append(" no model: ctrl+p, then Pull model", style="yellow")
        return text
    try:
        s = host.engine.stats()
    except Exception as e:  # noqa: BLE001
        text.append(f" engine stats unavailable: {e}", style="red")
        return text
    remote = host.endpoint is not None
    sep = (" │ ", "dim")
    text.append(f" {_short_model(s.model)}", style="bold")
    if remote:
        text.append(f"  {host.endpoint}")
    else:
        text.append(f"  {precision_label(s.precision, None)}/{s.device}")
    text.append(*sep)
    text.append(f"{chat.last_tok_s if chat is not None else 0.0:.1f} tok/s")
    text.append(*sep)
    batch = s.batch_size if s.num_running else 0
    # A server does not say how it batches: what this client knows is its own streams.
    text.append(f"{'streams' if remote else 'batch'} {batch}", style="bold green" if batch > 1 else "")
    if s.num_waiting:
        text.append(f" +{s.num_waiting} waiting", style="yellow")
    # The tab's context before the engine's KV: at 80 columns the line is cut from the right.
    if chat is not None:
        (used, guess), limit = chat.context(), chat.context_limit()
        shown = f"ctx {'~' if guess else ''}{used:,}"  # "~": a server that reported no usage
        text.append(*sep)
        if limit:
            fill = used / limit
            style = "bold red" if fill >= FILL_FULL else "yellow" if fill >= FILL_WARN else ""
            text.append(f"{shown}/{limit:,}", style=style)
        else:
            text.append(shown)
    if not remote:
        text.append(*sep)
        text.append(f"KV {s.kv_usage:.1%}")
    cached = chat.last_cached_tokens if chat is not None else 0
    if not remote or cached:  # a server that reports no cache hits would read as "0 hits"
        text.append(*sep)
        text.append(f"prefix hit {cached}")
    if not remote:  # this process's memory says nothing about a server's
        text.append(*sep)
        text.append(memory_label(s.device))
    if s.compiling:  # before the figures that matter less: the line is cut from the right
        text.append(*sep)
        text.append("optimizing for this CPU…", style="yellow")
    return text


def _short_model(name: str) -> str:
    """A model given as a path shows as its file or folder name: the status bar is one line."""
    return Path(name).name if name.startswith(("/", "~", ".")) else name
