#!/usr/bin/env bash
# The main job on a fresh machine, on the embedded default (ONNX Runtime on CPU):
#   1. make a tiny random-init checkpoint with realistic norms (or take LDLM_CHECKPOINT)
#   2. export it to ONNX, verify every LayerNormalization and probe each one's eps
#   3. build TensorRT engines, where a TensorRT flavour is installed
#   4. check parity of ONNX Runtime against eager PyTorch
#   5. serve it on 127.0.0.1, printing the URL and a ready-to-paste curl (Ctrl-C stops it)
# Random weights give gibberish text: this exercises the whole tool chain, not text quality.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh cpu
ldlm=.venv/bin/ldlm
runs="${LDLM_RUNS:-runs}"
ckpt="${LDLM_CHECKPOINT:-$runs/tiny}"
port="${LDLM_PORT:-8000}"

echo "== 1/5 checkpoint: $ckpt"
if [ ! -d "$ckpt" ]; then
  # --norm-init random: every norm has its own scale and bias, as in a trained checkpoint, so a
  # norm paired with the wrong parameters shows in verification and parity.
  "$ldlm" init "$ckpt" --preset tiny --seed 0 --norm-init random
fi
.venv/bin/ldlm generate "$ckpt" --n 2 --length 16 --steps 20 --sampler ddim --quiet
echo "(a random-init checkpoint generates gibberish; that is expected)"

echo "== 2/5 export + verify: $runs/onnx"
"$ldlm" export "$ckpt" "$runs/onnx" --force --quiet
"$ldlm" verify-onnx "$runs/onnx"
"$ldlm" probe-eps "$ckpt" --onnx-dir "$runs/onnx" --quiet  # every LayerNorm alone, where eps decides

echo "== 3/5 engines"
if .venv/bin/python -c "import tensorrt" 2>/dev/null || .venv/bin/python -c "import tensorrt_rtx" 2>/dev/null; then
  "$ldlm" build-engine "$runs/onnx" "$runs/engines" --force --quiet
else
  echo "no TensorRT flavour installed: skipped (pip install -e .[rtx] builds engines even without a GPU)"
fi

echo "== 4/5 parity: ONNX Runtime vs eager -> $runs/parity"
"$ldlm" parity "$ckpt" --backend ort --out "$runs/parity" --bisect  # exports its own copy with decoder logits

echo "== 5/5 serve"
exec "$ldlm" serve "$runs/onnx" --backend ort --port "$port"
