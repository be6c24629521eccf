#!/usr/bin/env bash
# Builds the sdist and the wheel, installs the wheel with pipx into a throwaway PIPX_HOME, and
# runs it from there: proves that `pipx install localllm` works (entry point, package data,
# the kernels package mapping) on every change.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m build --sdist --wheel --outdir "$work/dist" . >"$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
wheel=$(ls "$work"/dist/localllm-*.whl)
python3 - "$wheel" <<'PY'
import sys, zipfile
names = set(zipfile.ZipFile(sys.argv[1]).namelist())
for need in ("localllm/models.toml", "localllm/kernels/paged_attention.py", "localllm/cli.py"):
    assert need in names, f"{need} missing from the wheel"
assert not any(n.startswith("kernels/") for n in names), "kernels/ must ship only as localllm.kernels"
print(f"wheel ok: {len(names)} files")
PY
export PIPX_HOME="$work/pipx" PIPX_BIN_DIR="$work/bin"
# --system-site-packages reuses the CPU torch already installed here instead of downloading
# a CUDA build; every other dependency is resolved by pipx as a user's install would be.
python3 -m pipx install --system-site-packages "$wheel" >"$work/pipx.log" 2>&1 || { cat "$work/pipx.log"; exit 1; }
"$work/bin/localllm" --version
"$work/bin/localllm" models --json | python3 -c "import json,sys; d=json.load(sys.stdin); assert any(m['default'] for m in d['models']); print(len(d['models']), 'catalog models')"
echo "pipx install ok"
