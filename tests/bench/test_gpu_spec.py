"""bench/gpu_spec.py's own paths, on the CPU (``--smoke``: tiny models, eager): the counting
model copies its prompt's span and every proposal is kept; greedy output is the same with
speculation as without, batched and alone; a draft model made of the target's first layer
loads beside it. On the GPU the same run reports the verify step's graphs and cost."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_smoke_run_copies_exactly_and_loads_a_draft(tmp_path: Path) -> None:
    out = tmp_path / "gpu_spec.json"
    env = dict(os.environ, TMPDIR=str(tmp_path), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_spec.py"), "--smoke", "--cases", "copy,draft",
                           "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    cases = json.loads(out.read_text())["cases"]
    for name in ("copy", "draft"):
        c = cases[name]
        assert "error" not in c, c.get("traceback")
        assert c["greedy_batch6"]["equal"] == c["greedy_batch6"]["of"] == 6
        assert c["greedy_alone"] == {"equal": 1, "of": 1, "first_difference_at": []}
    copy = cases["copy"]
    assert copy["copy_answer_right"] is True
    assert copy["batch1"]["acceptance"] == [1.0, 1.0, 1.0]
    assert all(n > 3 for n in copy["batch1"]["tokens_per_verify_step"])
    assert copy["streams16"]["drafts"] == 0  # 16 > disable_by_batch_size: it steps aside
    assert cases["draft"]["draft"]["layers"] == 1
