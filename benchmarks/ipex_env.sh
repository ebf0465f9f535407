#!/usr/bin/env bash
# Build the IPEX 2.8 peer environment for benchmarks/vs_ipex.py: a separate venv, never a
# dependency of torchkiln (CI does not build it).
#
#   bash benchmarks/ipex_env.sh            # -> $IPEX_VENV (default ~/.cache/torchkiln/ipex-venv)
#
# Size: torch 2.8.0 comes from PyPI as its CUDA build (the CPU index this machine reaches only
# carries current torch), so the venv pulls the nvidia-* wheels too: about 7 GB on disk, a few
# minutes at ~90 MB/s. intel-extension-for-pytorch 2.8.0 itself is a 50 MB wheel. transformers
# is pinned below 5 (the IPEX 2.8 era) for bert-base.
set -euo pipefail
VENV="${IPEX_VENV:-$HOME/.cache/torchkiln/ipex-venv}"
PY="${IPEX_PYTHON:-python3.11}"
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import intel_extension_for_pytorch" 2>/dev/null; then
  echo "IPEX venv ready: $VENV"; exit 0
fi
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q "torch==2.8.0" "intel-extension-for-pytorch==2.8.0" "transformers>=4.45,<5" numpy psutil
"$VENV/bin/python" -c "import torch, intel_extension_for_pytorch as ipex; print('torch', torch.__version__, 'ipex', ipex.__version__)"
du -sh "$VENV"
echo "IPEX venv ready: $VENV"
