#!/usr/bin/env bash
# Quickstart command 1: install oasis_hf from this checkout (editable, with the extras given, default "models")
# into the active Python environment, with the torch build that fits the machine:
#   - a torch already installed is kept (the CUDA or CPU build you chose);
#   - where an NVIDIA GPU answers nvidia-smi, pip takes the CUDA build from PyPI with the package;
#   - otherwise the CPU build comes first, from PyTorch's CPU index (about 200 MB, against about 3 GB of CUDA wheels
#     that a plain `pip install -e .` pulls on a CPU machine).
# Usage: bash scripts/install.sh [EXTRAS]   (EXTRAS: comma-separated, e.g. "models,eval"; PYTHON=... picks python)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
EXTRAS="${1:-models}"
if "$PY" -c "import torch" >/dev/null 2>&1; then
    echo "install.sh: keeping the installed torch $("$PY" -c 'import torch; print(torch.__version__)')"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "install.sh: NVIDIA GPU found: torch with CUDA, from PyPI"
else
    echo "install.sh: no NVIDIA GPU: the CPU build of torch"
    "$PY" -m pip install -q --retries 0 --timeout 15 torch --index-url https://download.pytorch.org/whl/cpu
fi
"$PY" -m pip install -q -e ".[$EXTRAS]"
"$PY" -c "import torch, oasis_hf; print('install.sh: oasis_hf', oasis_hf.__version__, 'with torch', torch.__version__)"
