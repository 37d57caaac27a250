#!/usr/bin/env bash
# The main job on a fresh machine, on the embedded default (ONNX Runtime on CPU):
#   1. take the trained reference checkpoint models/ldlm-austen-tiny (or LDLM_CHECKPOINT; a directory
#      that does not exist yet is made with ldlm init: random weights, realistic norms)
#   2. export it to ONNX (the decoder keeps its logits, for temperature sampling), verify every
#      LayerNormalization and probe each one's eps
#   3. build TensorRT engines, where a TensorRT flavour is installed
#   4. check parity of ONNX Runtime against eager PyTorch
#   5. serve it on 127.0.0.1, printing a ready-to-paste curl, the playground's link and an OpenAI
#      example, each asking only for what the server would not choose itself (Ctrl-C stops it)
# The reference is a small model of Austen and Melville: it writes their words, not good prose.
set -euo pipefail

usage() {
  cat <<'EOF'
usage: bash scripts/demo.sh [--port N] [-h|--help]

Sets up .venv (scripts/bootstrap.sh cpu), then on models/ldlm-austen-tiny: a short generation, ONNX export
with verification and eps probes, TensorRT engines where .venv holds TensorRT, parity of ONNX Runtime
against eager PyTorch, and `ldlm serve` on 127.0.0.1 until Ctrl-C. Everything it writes goes under runs/.

  --port N     the port ldlm serve listens on, 1..65535 (default: $LDLM_PORT, else 8000)
  -h, --help   print this and exit, changing nothing

environment: LDLM_CHECKPOINT=DIR (another checkpoint; one that does not exist is made with ldlm init),
LDLM_RUNS=DIR (instead of runs/), LDLM_API_KEY (the key the server asks clients for)
EOF
}

port="${LDLM_PORT:-8000}"
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --port) [ $# -ge 2 ] || { echo "demo.sh: --port needs a value: a port, 1..65535" >&2; exit 2; }; port="$2"; shift 2 ;;
    --port=*) port="${1#--port=}"; shift ;;
    *) echo "demo.sh: unknown argument '$1'; allowed: --port N, --help" >&2; exit 2 ;;
  esac
done
# checked before anything is installed or written; 10# reads 08 as eight, not as octal
if ! [[ "$port" =~ ^[0-9]{1,5}$ ]] || (( 10#$port < 1 || 10#$port > 65535 )); then
  echo "demo.sh: port '$port' is not a port; allowed: a whole number in 1..65535 (--port N, or LDLM_PORT)" >&2
  exit 2
fi
port=$((10#$port))

cd "$(dirname "$0")/.."
ldlm=.venv/bin/ldlm
runs="${LDLM_RUNS:-runs}"
ckpt="${LDLM_CHECKPOINT:-models/ldlm-austen-tiny}"

# Which TensorRT flavour .venv holds decides stage 3. bootstrap.sh cpu (below) installs neither, so
# the answer before it is the answer after; scripts/test.sh (or bootstrap.sh cpu,rtx) adds TensorRT-RTX.
trt=""
if .venv/bin/python -c "import tensorrt_rtx" 2>/dev/null; then
  trt="TensorRT-RTX found in .venv: building engines too (installed by scripts/test.sh or bootstrap.sh cpu,rtx)"
elif .venv/bin/python -c "import tensorrt" 2>/dev/null; then
  trt="NVIDIA TensorRT found in .venv: building engines too"
fi
echo "scripts/demo.sh runs these stages (everything under $runs/):"
echo "  0 setup: scripts/bootstrap.sh cpu (.venv, CPU torch if missing, ldlm with ONNX Runtime)"
if [ -d "$ckpt" ]; then
  echo "  1 checkpoint: $ckpt (its files checked against SHA256SUMS where it has one); a short generation"
else
  echo "  1 checkpoint: $ckpt made with ldlm init --preset tiny (random weights); a short generation"
fi
echo "  2 export to ONNX (with the decoder's logits) + verify + probe every LayerNorm's eps: $runs/onnx"
echo "  3 engines: ${trt:-no TensorRT in .venv: engines skipped (bash scripts/bootstrap.sh cpu,rtx adds TensorRT-RTX)}"
echo "  4 parity, ONNX Runtime vs eager: $runs/parity"
echo "  5 serve $runs/onnx on 127.0.0.1:$port until Ctrl-C"
bash scripts/bootstrap.sh cpu

echo "== 1/5 checkpoint: $ckpt"
if [ ! -d "$ckpt" ]; then
  # --norm-init random: every norm has its own scale and bias, as in a trained checkpoint, so a
  # norm paired with the wrong parameters shows in verification and parity.
  "$ldlm" init "$ckpt" --preset tiny --seed 0 --norm-init random
fi
.venv/bin/ldlm generate "$ckpt" --n 2 --length 32 --quiet
echo "(the reference checkpoint writes the corpus's words without much syntax; a random-init one writes gibberish)"

echo "== 2/5 export + verify: $runs/onnx"
# --with-logits: temperature, top_p and logprobs (the OpenAI example below) draw from the decoder's logits
"$ldlm" export "$ckpt" "$runs/onnx" --with-logits --force --quiet
"$ldlm" verify-onnx "$runs/onnx"
"$ldlm" probe-eps "$ckpt" --onnx-dir "$runs/onnx" --quiet  # every LayerNorm alone, where eps decides

echo "== 3/5 engines"
if [ -n "$trt" ]; then
  "$ldlm" build-engine "$runs/onnx" "$runs/engines" --force --quiet
else
  echo "no TensorRT flavour installed: skipped (pip install -e .[rtx] builds engines even without a GPU)"
fi

echo "== 4/5 parity: ONNX Runtime vs eager -> $runs/parity"
"$ldlm" parity "$ckpt" --backend ort --onnx-dir "$runs/onnx" --out "$runs/parity" --bisect

echo "== 5/5 serve $runs/onnx on http://127.0.0.1:$port (Ctrl-C stops it); once it says 'ldlm serving', try:"
url="http://127.0.0.1:$port"
auth=""  # with a key, the examples name it without printing it
[ -n "${LDLM_API_KEY:-}" ] && auth=" -H \"Authorization: Bearer \$LDLM_API_KEY\""
echo "  playground: $url/"
echo "  curl -s $url/v1/generate$auth -H 'Content-Type: application/json' -d '{\"n\": 2, \"length\": 32}'"
echo "  curl -s $url/v1/completions$auth -H 'Content-Type: application/json' -d '{\"model\": \"ldlm\", \"prompt\": \"It is a truth universally\", \"max_tokens\": 24, \"temperature\": 0.7}'"
echo "  python -c 'import os; from openai import OpenAI; c = OpenAI(base_url=\"$url/v1\", api_key=os.environ.get(\"LDLM_API_KEY\", \"unused\")); print(c.completions.create(model=\"ldlm\", prompt=\"It is a truth universally\", max_tokens=24, temperature=0.7).choices[0].text)'   # pip install openai"
exec "$ldlm" serve "$runs/onnx" --backend ort --port "$port"
