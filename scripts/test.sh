#!/usr/bin/env bash
# Set up (CPU torch, the package and its test extras) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh cpu,rtx,test,ray
exec .venv/bin/python -m pytest "$@"
