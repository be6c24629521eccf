"""bench/gpu_check.py, ready for its one device call: run in a Python where the packages the
lent H200 image lacks (the device tool's KINDS.md) cannot be imported, with only the wheels
the script says to carry (``CARRY``) added back, its ``--dry-run`` imports every module a run
needs; without the carried wheels it fails with one line naming them. A ``--smoke`` run of
the cheap sections writes each section's figures to the JSON."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.bench.scripts import ROOT, load_bench

# Installed here, absent from the H200 image ('cuda', read 2026-11-17: KINDS.md's list)
ABSENT_ON_IMAGE = ("platformdirs", "textual", "gguf", "llguidance", "starlette", "uvicorn", "openai")

# Made importable only from the folder of carried wheels (CARRIED, unpacked), as a --target
# install of .whl/*.whl on the device makes them; the rest of ABSENT_ON_IMAGE never.
SITECUSTOMIZE = '''
import importlib.machinery, os, sys

ABSENT = set(os.environ["GPU_CHECK_ABSENT"].split(","))
CARRIED = os.environ.get("GPU_CHECK_CARRIED", "")


class AbsentOnImage:
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top not in ABSENT:
            return None
        if CARRIED and os.path.exists(os.path.join(CARRIED, top)):
            return None if "." in name else importlib.machinery.PathFinder.find_spec(name, [CARRIED])
        raise ImportError(f"No module named {name!r} (absent on the H200 image)", name=name)


sys.meta_path.insert(0, AbsentOnImage())
'''


gpu_check = load_bench("gpu_check")


def _run(tmp_path: Path, args: list[str], carry: bool) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LOCALLLM_TRITON_ON_CPU")}
    env.update(GPU_CHECK_ABSENT=",".join(ABSENT_ON_IMAGE), PYTHONPATH=str(site), OUT=str(tmp_path / "out"),
               CUDA_VISIBLE_DEVICES="")  # fmt: skip
    if carry:  # what the carried wheels would unpack to
        carried = tmp_path / "carried"
        for name in gpu_check.CARRY:
            spec = importlib.util.find_spec(name)
            assert spec is not None and spec.origin is not None, f"{name} must be installed here to simulate carrying it"
            shutil.copytree(Path(spec.origin).parent, carried / name, dirs_exist_ok=True)
        env["GPU_CHECK_CARRIED"] = str(carried)
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    out = tmp_path / "out" / "gpu_check.json"
    return proc, json.loads(out.read_text()) if out.exists() else {}


def test_the_carried_wheels_are_all_a_run_lacks_on_the_image(tmp_path: Path) -> None:
    assert set(gpu_check.CARRY) <= set(ABSENT_ON_IMAGE)
    proc, report = _run(tmp_path, ["--dry-run", "--only", "env,bandwidth,kernels,tests,e2e", "--budget", "500"],
                        carry=True)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "dry run ok" in proc.stdout
    dry = report["dry_run"]
    assert dry["missing"] == [] and set(gpu_check.RUN_IMPORTS) <= set(dry["imports"])
    assert dry["imports"]["localllm.kernels.tuning"] == "ok"
    plan = report["plan"]
    assert plan["budget_s"] == 500 and plan["sections"] == list(gpu_check.SECTIONS)
    # the sections after the kernels keep a share that fits in the budget, with the watchdog's grace
    assert sum(plan["reserved_s"].values()) < 500 and 500 + 30 < 9 * 60


def test_without_the_carried_wheels_the_dry_run_names_them(tmp_path: Path) -> None:
    proc, report = _run(tmp_path, ["--dry-run"], carry=False)
    assert proc.returncode == 1
    assert "cannot import localllm.kernels: ImportError: No module named 'platformdirs'" in proc.stdout
    assert "carry the missing packages as wheels (platformdirs" in proc.stdout
    assert "localllm.kernels" in report["dry_run"]["missing"]


def test_a_smoke_run_writes_each_section_as_it_goes(tmp_path: Path) -> None:
    proc, report = _run(tmp_path, ["--smoke", "--only", "env,bandwidth", "--budget", "60"], carry=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    env, bw = report["sections"]["env"], report["sections"]["bandwidth"]
    assert env["ok"] and env["torch"] and env["python"]
    assert bw["ok"] and bw["peak_gbps"] > 0 and bw["copy_bytes"] == 1 << 20
    assert report["total_s"] <= 60 and "killed" not in report


def test_unknown_section_is_one_line(tmp_path: Path) -> None:
    proc, _ = _run(tmp_path, ["--dry-run", "--only", "kernals"], carry=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "gpu_check: unknown section(s) ['kernals'] in --only; choose from ['env', 'bandwidth', 'kernels', 'tests', 'e2e']"
    ]
