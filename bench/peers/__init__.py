"""localllm against llama.cpp on the same GGUF file (``python bench/peers.py``; usage in ``cli``).

One file per question: ``environment`` (the machine, each side's OpenMP settings, PeerError;
importing the package sets our OpenMP defaults before anything imports torch), ``build``
(finding and building llama.cpp), ``processes`` (llama-bench, llama-cpp-python, our engine, a
server per trial), ``client`` (prompts and one streamed chat, the same for both servers),
``run`` (the measures and trials), ``report`` (rows, ratios, the table), ``cli``.

The names below are what other bench scripts (``soak.py``, ``requantize.py``) import from
``peers``, with ``bench/`` on ``sys.path``; a package takes precedence over the launcher
``bench/peers.py`` beside it.
"""

from __future__ import annotations

from .environment import PeerError, machine  # first: sets the OpenMP defaults
from .build import build_llama_cpp, find_llama_cpp, peers_cache  # noqa: E402
from .cli import resolve_gguf  # noqa: E402
from .processes import Server, free_port, localllm_cmd  # noqa: E402

__all__ = ["PeerError", "Server", "build_llama_cpp", "find_llama_cpp", "free_port", "localllm_cmd", "machine",
           "peers_cache", "resolve_gguf"]
