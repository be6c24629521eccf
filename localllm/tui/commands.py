"""The command palette (ctrl+p): every action, plus switching and pulling models.

Model verdicts come from a probe the app runs in a thread once the model is loaded; the
palette never probes itself, so it opens at once. A remote server's models come from its
``/v1/models``, read when it was connected. The provider reaches the app only through
``PaletteHost``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol, cast

from textual.command import DiscoveryHit, Hit, Hits, Provider

if TYPE_CHECKING:
    from localllm.tui.backend import ProbeReport


class PaletteHost(Protocol):
    """What the palette reads and calls on the app."""

    @property
    def model_name(self) -> str: ...

    @property
    def probe_cache(self) -> ProbeReport | None: ...

    @property
    def endpoint(self) -> str | None:
        """The server URL in remote mode; None for the engine in this process."""

    def served_models(self) -> list[str]: ...

    def active_code_blocks(self) -> list[str]:
        """The code blocks of the active tab's last reply with any."""

    def run_action(self, action: str) -> Awaitable[bool]: ...

    def request_switch_model(self, name: str) -> None: ...

    def pull_model(self, name: str) -> None: ...

    def copy_text(self, text: str, what: str) -> None: ...


class ChatCommands(Provider):
    @property
    def host(self) -> PaletteHost:
        return cast("PaletteHost", self.app)

    def _commands(self, query: str = "") -> list[tuple[str, str, Callable[[], Any]]]:
        host = self.host
        run = host.run_action
        cmds: list[tuple[str, str, Callable[[], Any]]] = [
            ("New chat", "open a new tab", partial(run, "new_tab")),
            ("Close chat", "close this tab (a running reply is stopped and kept)", partial(run, "close_tab")),
            ("Rename chat", "rename this tab", partial(run, "rename_tab")),
            ("Clear chat", "delete every message of this tab, its settings stay", partial(run, "clear_chat")),
            ("Delete chat", "delete this chat from the history and close its tab", partial(run, "delete_chat")),
            ("Chat settings", "system prompt and sampling parameters of this tab", partial(run, "settings")),
            ("History", "reopen, search, delete or export past chats", partial(run, "history")),
            ("Export chat to Markdown", "write this chat to a .md file", partial(run, "export_chat")),
            ("Stop generation", "stop this tab's reply, keeping what came so far", partial(run, "chat_do('stop')")),
            ("Regenerate reply", "a new last reply; the old one stays as a branch", partial(run, "chat_do('regenerate')")),
            ("Go on with the reply", "continue a stopped, cut or interrupted reply", partial(run, "chat_do('continue')")),
            ("Edit last message", "edit your last message; sending makes a new branch",
             partial(run, "chat_do('edit_last')")),
            ("Edit or branch an earlier message", "alt+up selects messages: e edits, r regenerates, ←/→ branches",
             partial(run, "chat_do('focus_messages')")),
            ("Make room", "drop the oldest turns, or go on in a new chat with the last turns or a summary",
             partial(run, "chat_do('make_room')")),
            ("Copy last reply", "to the clipboard (OSC 52)", partial(run, "chat_do('copy_reply')")),
            ("Keys", "every key of the chat (F1)", partial(run, "help_screen")),
        ]
        for i, code in enumerate(host.active_code_blocks(), start=1):
            first = next((line.strip() for line in code.splitlines() if line.strip()), "")[:40]
            cmds.append((f"Copy code block {i}", f"{len(code.splitlines())} lines: {first}",
                         partial(host.copy_text, code, f"code block {i}")))
        current = host.model_name
        if host.endpoint is not None:
            cmds.append((f"Reconnect to {host.endpoint}", "connect again (after the server restarted)",
                         partial(run, "reconnect")))
            for name in host.served_models():
                loaded = " (loaded)" if name == current else ""
                cmds.append((f"Switch model: {name}", f"served by {host.endpoint}{loaded}",
                             partial(host.request_switch_model, name)))
            return cmds
        cmds.append(("Hardware probe", "this machine and what each model would run as", partial(run, "probe")))
        report = host.probe_cache
        if report is None:
            cmds.append(("Switch model", "probing models… try again in a moment", partial(run, "refresh_models")))
        else:
            for row in report.rows:
                if row.local:
                    loaded = " (loaded)" if row.id == current else ""
                    cmds.append((f"Switch model: {row.id}", f"{row.verdict}{loaded}",
                                 partial(host.request_switch_model, row.id)))
                else:
                    cmds.append((f"Pull model: {row.id}", row.verdict, partial(host.pull_model, row.id)))
        if "/" in query.strip() and " " not in query.strip():  # an HF repo id typed in full
            repo = query.strip()
            cmds.append((f"Pull model: {repo}", "from the Hugging Face hub", partial(host.pull_model, repo)))
        return cmds

    async def discover(self) -> Hits:
        for title, help_text, callback in self._commands():
            yield DiscoveryHit(title, callback, help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for title, help_text, callback in self._commands(query):
            score = matcher.match(title)
            if score > 0:
                yield Hit(score, matcher.highlight(title), callback, help=help_text)
