"""The one exception type users see: its message is a complete one-line diagnosis."""

from __future__ import annotations


class LocalLLMError(Exception):
    """Bad input or environment. The CLI prints ``localllm: error: <message>`` and exits 2.

    The message names the file or value at fault and what to do about it, on one line.
    """


class InvalidParameterError(LocalLLMError):
    """A request parameter out of its type or range. ``param`` names the field (vLLM's and
    OpenAI's name for it), so a server can report it in the error's ``param``."""

    def __init__(self, param: str, problem: str) -> None:
        super().__init__(f"bad sampling parameter {param}: {problem}")
        self.param = param
        self.problem = problem
