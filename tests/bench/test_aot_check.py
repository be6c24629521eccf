"""bench/aot_check.py's split-K ordering check: the real compiler (Triton's, with its bundled
ptxas; no GPU or driver needed) compiles split-K GEMV kernels for sm90 and sm80, and the PTX
must hold a bar.sync between the partial-tile stores and the arrival atomic, which must be a
GPU-scope release. The interpreter runs programs one after another, so this is the only CI
check of that protocol. The checker itself must reject PTX with that barrier removed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.bench.scripts import ROOT, load_bench

triton = pytest.importorskip("triton")
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
pytestmark = pytest.mark.skipif(not PTXAS.is_file(), reason="Triton without its bundled ptxas")


aot_check = load_bench("aot_check")  # imports no kernel: load_kernels() does, in its own process
# One AWQ (fp32 partials) and one W8A8 (int32 partials) split-K GEMV config.
CASES = "awq fp16 gemv[0] g128,int8 w8a8 bf16 gemv[0]"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    out = tmp_path_factory.mktemp("aot")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LOCALLLM_TRITON_ON_CPU")}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "aot_check.py"), "--arch", "90,80", "--only", "gemm",
         "--match", CASES, "--json", str(out / "r.json"), "--ptx-dir", str(out / "ptx")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "r.json").read_text()), out / "ptx"


def test_split_k_partials_are_stored_before_the_arrival_atomic(compiled: tuple[list[dict[str, Any]], Path]) -> None:
    rows, _ = compiled
    assert {(r["arch"], r["case"].split(" {")[0]) for r in rows} == {
        (a, c) for a in (90, 80) for c in CASES.split(",")
    }
    for row in rows:
        assert row["splitk_order"] == "ok", row


def test_the_check_rejects_ptx_without_the_barrier(compiled: tuple[list[dict[str, Any]], Path]) -> None:
    _, ptx_dir = compiled
    files = sorted(ptx_dir.glob("*.ptx"))
    assert len(files) == 4
    for path in files:
        lines = path.read_text().splitlines()
        atom = next(i for i, ln in enumerate(lines) if re.search(r"atom\.global\.\S*add", ln))
        assert "acq_rel" in lines[atom] and ".gpu" in lines[atom]
        barrier = max(i for i in range(atom) if "bar.sync" in lines[i])
        assert all("st.global" not in ln for ln in lines[barrier:atom])
        assert any("st.global" in ln for ln in lines[:barrier])
        # the same kernel with that one barrier gone, and with a relaxed atomic instead
        no_barrier = "\n".join(lines[:barrier] + lines[barrier + 1:])
        assert aot_check.splitk_order(no_barrier).startswith("no bar.sync between the last st.global")
        relaxed = "\n".join(lines).replace(lines[atom], lines[atom].replace(".acq_rel", ".relaxed"))
        assert aot_check.splitk_order(relaxed).startswith("the atom is not a release")
        assert aot_check.splitk_order("\n".join(lines)) == "ok"
