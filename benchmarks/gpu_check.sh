#!/usr/bin/env bash
# The one-GPU check (benchmarks/gpu_check.py): kernels per family at the study's shapes, a
# measured profile (h200-measured.yaml), and a CP rank and a CSBP rank of Nemotron-8B-shaped
# layers emulated at 64K, 128K and 256K, measured vs predicted. It times itself: 440 s budget,
# killed at 470 s (the issue allows 8 minutes on one H200).
#
#   benchmarks/gpu_check.sh --dry-run [--out-dir DIR]   # the same steps on CPU, tiny shapes (CI)
#   benchmarks/gpu_check.sh [--out-dir DIR] [gpu_check.py flags]   # on the GPU
#
# On the device machine (Python 3.12, torch 2.11, no package registry, no pydantic): first, here,
#   benchmarks/carry_wheels.sh          # pydantic & co. for cp312 into .whl/ (ignored by git)
# then the device tool's `run` with
#   carry: [".whl"]   timeout_s: 540
#   command: benchmarks/gpu_check.sh
# It writes to $OUT (which comes back): h200-measured.yaml, gpu_check_report.md,
# gpu_check_report.json, gpu_check_emulations.log. Commit the profile as
# hardware_profiles/h200-measured.yaml and the report under experiments/results/ afterwards.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-python3}"
dry=0
for arg in "$@"; do [ "$arg" = "--dry-run" ] && dry=1; done

if [ "$dry" = 0 ]; then
  command -v nvidia-smi >/dev/null || { echo "gpu_check: error: no NVIDIA GPU here (nvidia-smi not found; use --dry-run)" >&2; exit 2; }
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader >&2 || true
  if ! (cd / && "$python" -c "import pydantic" 2>/dev/null); then
    compgen -G "$root/.whl/*.whl" >/dev/null || { echo "gpu_check: error: pydantic missing and no wheels in .whl/ (run benchmarks/carry_wheels.sh here and carry .whl)" >&2; exit 2; }
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/csbp-site "$root"/.whl/*.whl
    export PYTHONPATH="/tmp/csbp-site${PYTHONPATH:+:$PYTHONPATH}"
  fi
fi

# csbp not installed (the device machine): a namespace over this checkout, as pyproject maps it
if ! (cd / && "$python" -c "import csbp.runtime.emulation.emulate" 2>/dev/null); then
  shim="$(mktemp -d)"
  mkdir "$shim/csbp"
  cp "$root"/csbp/*.py "$shim/csbp/"
  for d in simulator runtime experiments hardware_profiles; do ln -s "$root/$d" "$shim/csbp/$d"; done
  export PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}"
fi

export PYTHONUNBUFFERED=1
cd /  # never the checkout: its csbp/ folder would shadow the namespace
if [ "$dry" = 1 ]; then
  exec timeout 120 "$python" "$root/benchmarks/gpu_check.py" "$@"
fi
exec timeout 470 "$python" "$root/benchmarks/gpu_check.py" "$@"
