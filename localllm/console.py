"""Rich output on stdout for the commands that print tables (``models``, ``probe``).

A reader that stops early (``localllm models | head -1``) must end the command quietly with
exit code 0: rich's own handler exits with status 1, so this console raises the plain
BrokenPipeError instead, which ``localllm.cli.main`` turns into a quiet exit for every command.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console


class _PipeConsole(Console):
    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError


def stdout_console(**options: Any) -> Console:
    """A Console on stdout (``options`` as rich's) whose broken pipe raises BrokenPipeError."""
    return _PipeConsole(**options)
