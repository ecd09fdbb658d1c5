#!/usr/bin/env bash
# Set up a virtual environment in .venv with sentineld and its test/demo extras.
#
# torch: an importable torch (e.g. a CUDA build on a GPU host) is kept: the venv sees the
# interpreter's site-packages and pip is constrained to the installed version. Only where no torch
# is importable is the CPU build installed, pinned (torch==2.13.0), never an unpinned multi-GB
# CUDA download. A second run with an unchanged pyproject.toml does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_CPU_VERSION=${SENTINELD_TORCH_VERSION:-2.13.0}
STAMP=.venv/.sentineld-setup

if [ -f "$STAMP" ] && [ "$STAMP" -nt pyproject.toml ] && .venv/bin/python -c "import sentineld.agent" 2>/dev/null; then
  exit 0
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv --system-site-packages .venv
fi
VPY=.venv/bin/python
quiet() {  # pip's notes about this machine's local package mirrors are noise; its errors are not
  "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
  return "${PIPESTATUS[0]}"
}
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  echo "setup: no importable torch; installing the CPU build torch==$TORCH_CPU_VERSION"
  # Pinned, never a range. Elsewhere than this project's machines, point SENTINELD_TORCH_INDEX at
  # https://download.pytorch.org/whl/cpu to get the CPU wheel instead of PyPI's CUDA build.
  quiet "$VPY" -m pip install -q "torch==$TORCH_CPU_VERSION" ${SENTINELD_TORCH_INDEX:+--index-url "$SENTINELD_TORCH_INDEX"}
fi
TORCH_VERSION=$("$VPY" -c "import torch; print(torch.__version__)")
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==$TORCH_VERSION" > "$constraints"
quiet "$VPY" -m pip install -q -e ".[demo,test,fast]" -c "$constraints"
"$VPY" -c "import sentineld.agent, sentineld.replay, torch; print('setup: sentineld ready in .venv with torch', torch.__version__)"
touch "$STAMP"
