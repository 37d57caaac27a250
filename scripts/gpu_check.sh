#!/usr/bin/env bash
# One prepared check for a GPU machine (no network there): install this checkout without
# dependencies, then run every backend that is present on the GPU against the CPU reference and
# print parity and latency. Stages whose packages are missing say so and are skipped.
#   bash scripts/gpu_check.sh [OUT_DIR]      (default: $OUT, or runs/gpu_check)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-runs/gpu_check}}"
mkdir -p "$out"
python -m pip install --quiet --no-deps --no-build-isolation -e . >"$out/pip.log" 2>&1 \
  || echo "pip install -e . failed (see $out/pip.log); falling back to the source tree" >&2
nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv 2>&1 | tee "$out/gpu.txt"
python scripts/gpu_check.py --out "$out" 2>&1 | tee "$out/gpu_check.log"
