#!/usr/bin/env bash
# Set up (CPU torch, the package, its test and lint extras), run the lint gate, then the whole test suite.
# It first says what it installs and why: .venv gains TensorRT-RTX and Ray (after which scripts/demo.sh
# builds engines too) and, as root, the system gains chromium.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/install_steps.sh
source scripts/install_steps.sh
extras=cpu,rtx,test,ray,lint

requirements() {  # one extra's requirements as pyproject.toml lists them (empty where python3 cannot read it)
  python3 - "$1" 2>/dev/null <<'EOF' || true
import sys, tomllib
with open("pyproject.toml", "rb") as f:
    print(", ".join(tomllib.load(f)["project"]["optional-dependencies"][sys.argv[1]]))
EOF
}

why() {
  case "$1" in
    cpu) echo "ONNX Runtime (CPU build), the backend most tests run" ;;
    rtx) echo "TensorRT-RTX, so the engine tests build engines even without a GPU; scripts/demo.sh then builds engines too" ;;
    test) echo "pytest and the tests' oracles and clients (transformers is the GPT-2 oracle, locust drives the soak)" ;;
    ray) echo "Ray Serve, for the tests of the replica deployment (ldlm serve --ray)" ;;
    lint) echo "the pinned ruff and mypy of the lint gate (scripts/lint.sh)" ;;
  esac
}

echo "scripts/test.sh installs what is missing, then runs scripts/lint.sh and pytest:"
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "  .venv: torch 2.13.0, CPU build (.venv has no torch; a bare torch requirement would pull a multi-GB CUDA build)"
fi
echo "  .venv: ldlm, editable, with its dependencies (pyproject.toml), and the extras $extras:"
for extra in ${extras//,/ }; do
  echo "  .venv: [$extra] $(requirements "$extra"): $(why "$extra")"
done
if command -v chromium >/dev/null 2>&1; then
  chromium_plan=present
elif command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  chromium_plan=install
  echo "  system (apt-get, as root): chromium, for the playground's browser test ($chromium_test)"
  dpkg_interrupted | sed 's/^/  but /' || true
else
  chromium_plan=skip
  echo "  not installed: chromium (no apt-get as root); $chromium_test will skip"
fi
echo "  .cache/triton-env, on first use by tests/serve/deploy/test_triton_server.py: nvidia-pytriton's tritonserver (network once; it skips without)"

bash scripts/bootstrap.sh "$extras"
bash scripts/lint.sh
# The playground's browser test drives Debian's chromium. Install it when missing; where apt cannot
# (no root, no network, dpkg left interrupted) the test skips and says so.
if [ "$chromium_plan" = install ]; then
  install_chromium
elif [ "$chromium_plan" = skip ]; then
  echo "no chromium and no apt-get as root; $chromium_test will skip" >&2
fi
# Two workers, a test file each at a time (its module fixtures, such as a running server, built once):
# most of the suite's time is single-threaded Python (torch.onnx tracing, servers, subprocesses), so on
# two cores it runs in about 60% of the time of one process. `-n 0` runs it in one process.
exec .venv/bin/python -m pytest -n 2 --dist loadfile "$@"
