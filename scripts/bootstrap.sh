#!/usr/bin/env bash
# Create .venv (once) and install ldlm into it with the extras given as one argument (e.g. "cpu,test").
# On a machine without torch this installs the CPU build first: a bare `torch` requirement would
# otherwise pull a multi-GB CUDA build. Bring your own torch for GPUs (install it into .venv first).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/install_steps.sh
source scripts/install_steps.sh
extras="${1:-}"
if [ ! -x .venv/bin/python ]; then
  echo "creating .venv (python3 -m venv)"
  with_heartbeat "creating .venv" python3 -m venv .venv
fi
py=.venv/bin/python
if ! "$py" -c "import torch" 2>/dev/null; then
  echo "pip install torch==2.13.0 (.venv has no torch; each wheel is named with its size as it comes)"
  with_heartbeat "installing torch (pip)" pip_install_shown "torch==2.13.0"
fi
spec="."
[ -n "$extras" ] && spec=".[$extras]"
echo "pip install -e $spec: what .venv lacks of ldlm's dependencies (each wheel is named with its size as it comes)"
with_heartbeat "installing ldlm's dependencies (pip install -e $spec)" pip_install_shown -e "$spec"
