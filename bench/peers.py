#!/usr/bin/env python
"""``python bench/peers.py``: localllm against llama.cpp on the same GGUF file. The code is the
package ``bench/peers/`` (usage: ``bench/peers/cli.py``, or ``--help``); this file runs its CLI.
With ``bench/`` first on ``sys.path``, ``import peers`` finds that package, not this file."""

from __future__ import annotations

import sys

from peers.cli import main

if __name__ == "__main__":
    sys.exit(main())
