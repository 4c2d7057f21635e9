#!/usr/bin/env bash
# Calibrate the compute side of one CUDA GPU (bf16 GEMMs, attention forward/backward, HBM) and
# write hardware_profiles/h200-measured.yaml beside the datasheet profile. Needs only torch;
# takes a few minutes on one H200. Copies the profile to $OUT when that is set (device runs).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-hardware_profiles/h200-measured.yaml}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv >&2 || true
python benchmarks/gpu_calibrate.py --out "$out"
if [ -n "${OUT:-}" ]; then cp "$out" "$OUT/"; fi
