#!/usr/bin/env bash
# One H200, a few minutes: the reference model and a one-GPU plan at a realistic layer size in
# bf16, measured step time and peak memory printed next to the simulator's prediction.
#
#   benchmarks/gpu_check.sh [--layers 4] [--seq-len 8192] [--steps 5] [--out gpu_check.json]
#
# Needs torch with CUDA, pydantic, numpy, pyyaml (and simpy for the prediction). On a bare GPU
# image without pydantic, carry wheels in .whl/ (see /work/.library/device/README.md): pydantic,
# pydantic-core, annotated-types, typing-inspection, simpy; they are installed from there.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c "import pydantic" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
command -v nvidia-smi >/dev/null || { echo "gpu_check: no NVIDIA GPU here (nvidia-smi not found)" >&2; exit 2; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
export PYTHONUNBUFFERED=1
exec timeout 540 python3 benchmarks/gpu_check.py "$@"
