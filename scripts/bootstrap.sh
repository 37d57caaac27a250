#!/usr/bin/env bash
# Create .venv (once) and install ldlm into it with the extras given as one argument (e.g. "cpu,test").
# On a machine without torch this installs the CPU build first: a bare `torch` requirement would
# otherwise pull a multi-GB CUDA build. Bring your own torch for GPUs (install it into .venv first).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
py=.venv/bin/python
if ! "$py" -c "import torch" 2>/dev/null; then
  "$py" -m pip install --quiet "torch==2.13.0"
fi
spec="."
[ -n "$extras" ] && spec=".[$extras]"
"$py" -m pip install --quiet -e "$spec"
