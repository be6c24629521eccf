"""The command palette (ctrl+p): every action, plus switching and pulling models.

Model verdicts come from a probe the app runs in a thread once the model is loaded; the
palette never probes itself, so it opens at once.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from textual.command import DiscoveryHit, Hit, Hits, Provider

if TYPE_CHECKING:
    from localllm.tui.app import ChatApp


class ChatCommands(Provider):
    @property
    def chat_app(self) -> ChatApp:
        return self.app  # type: ignore[return-value]

    def _commands(self, query: str = "") -> list[tuple[str, str, Callable[[], Any]]]:
        app = self.chat_app
        run = app.run_action
        cmds: list[tuple[str, str, Callable[[], Any]]] = [
            ("New chat", "open a new tab", partial(run, "new_tab")),
            ("Close chat", "close this tab (a running reply is stopped and kept)", partial(run, "close_tab")),
            ("Rename chat", "rename this tab", partial(run, "rename_tab")),
            ("Chat settings", "system prompt and sampling parameters of this tab", partial(run, "settings")),
            ("History", "reopen, search, delete or export past chats", partial(run, "history")),
            ("Export chat to Markdown", "write this chat to a .md file", partial(run, "export_chat")),
            ("Stop generation", "stop this tab's reply, keeping what came so far", partial(run, "chat_do('stop')")),
            ("Regenerate reply", "replace the last reply", partial(run, "chat_do('regenerate')")),
            ("Edit last message", "take back the last message to edit it", partial(run, "chat_do('edit_last')")),
            ("Copy last reply", "to the clipboard (OSC 52)", partial(run, "chat_do('copy_reply')")),
            ("Copy last code block", "to the clipboard (OSC 52)", partial(run, "chat_do('copy_code')")),
            ("Hardware probe", "this machine and what each model would run as", partial(run, "probe")),
        ]
        current = app.model_name
        report = app.probe_cache
        if report is None:
            cmds.append(("Switch model", "probing models… try again in a moment", partial(run, "refresh_models")))
        else:
            for row in report.rows:
                if row.local:
                    loaded = " (loaded)" if row.id == current else ""
                    cmds.append((f"Switch model: {row.id}", f"{row.verdict}{loaded}",
                                 partial(app.request_switch_model, row.id)))
                else:
                    cmds.append((f"Pull model: {row.id}", row.verdict, partial(app.pull_model, row.id)))
        if "/" in query.strip() and " " not in query.strip():  # an HF repo id typed in full
            repo = query.strip()
            cmds.append((f"Pull model: {repo}", "from the Hugging Face hub", partial(app.pull_model, repo)))
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
