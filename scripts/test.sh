#!/usr/bin/env bash
# Set up (CPU torch, the package, its test and lint extras), run the lint gate, then the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh cpu,rtx,test,ray,lint
bash scripts/lint.sh
# The playground's browser test drives Debian's chromium. Install it when missing; where apt cannot
# (no root, no network) the test skips and says so.
if ! command -v chromium >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    { apt-get install -y --no-install-recommends chromium || { apt-get update && apt-get install -y --no-install-recommends chromium; }; } \
      >/dev/null 2>&1 || echo "chromium could not be installed; tests/test_playground.py will skip" >&2
  else
    echo "no chromium and no apt-get as root; tests/test_playground.py will skip" >&2
  fi
fi
exec .venv/bin/python -m pytest "$@"
