"""The one exception type users see: its message is a complete one-line diagnosis."""

from __future__ import annotations


class LocalLLMError(Exception):
    """Bad input or environment. The CLI prints ``localllm: error: <message>`` and exits 2.

    The message names the file or value at fault and what to do about it, on one line.
    """
