#!/usr/bin/env bash
# The main job on a fresh machine: set up, make a tiny random-init checkpoint, generate from it.
# Random weights give gibberish text: this exercises the whole tool chain, not text quality.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh cpu
ckpt="${LDLM_DEMO_CHECKPOINT:-runs/tiny}"
if [ ! -d "$ckpt" ]; then
  .venv/bin/ldlm init "$ckpt" --preset tiny --seed 0
fi
echo "note: a random-init checkpoint generates gibberish; that is expected (see README)." >&2
.venv/bin/ldlm generate "$ckpt" --n 4 --length 32 --steps 50 --seed 0 "$@"
