"""Without a C++ compiler (a slim container, a clean macOS) ``localllm run`` answers at once
on the torch path: one line says what a compiler would give, nothing waits on a compile
that cannot happen (neither the CPU kernels' build nor torch.compile, whose Inductor needs
the compiler too), and no traceback reaches the user."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from localllm.kernels import cpu_ops


def test_run_without_a_compiler_answers_on_the_torch_path(default_model_path: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "LOCALLLM_NO_COMPILE"}  # the compile is asked for
    env.update(LOCALLLM_CACHE_DIR=str(tmp_path / "cache"), CXX=str(tmp_path / "no-such-g++"))
    localllm = shutil.which("localllm", path=os.path.dirname(sys.executable)) or shutil.which("localllm")
    assert localllm is not None
    proc = subprocess.run(
        [localllm, "run", "--model", str(default_model_path), "--temperature", "0", "--max-tokens", "8",
         "What is the capital of France?"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("The capital of France is Paris")
    line = cpu_ops.NO_COMPILER.format(cpu_ops.COMPILER_SPEEDUP)
    assert proc.stderr.count(line) == 1
    assert "Traceback" not in proc.stderr and "guard" not in proc.stderr
    # nothing was built or compiled: no library, no Inductor output, no saved decode step
    cache = tmp_path / "cache"
    assert not list(cache.glob("cpu_ops/*/*.so")) and not (cache / "inductor").exists()
    assert not list(cache.glob("graphs/*.bin"))
