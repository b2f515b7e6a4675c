#!/usr/bin/env bash
# Creates the PyTorch peer environment used by the benches and the parity-fixture script:
#   bash scripts/setup_pytorch.sh            # -> $HEARTH_TORCH_VENV (default ~/.cache/hearth/venv-torch)
# About 5 GB (the PyPI torch wheel carries CUDA libraries even for CPU use).
set -euo pipefail
VENV="${HEARTH_TORCH_VENV:-$HOME/.cache/hearth/venv-torch}"
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import torch, torchvision" 2>/dev/null; then
  echo "PyTorch already set up in $VENV"
  exit 0
fi
python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
"$VENV/bin/pip" install --quiet torch torchvision numpy
"$VENV/bin/python" -c "import torch, torchvision; print('torch', torch.__version__, 'torchvision', torchvision.__version__)"
echo "PyTorch ready: $VENV/bin/python"
