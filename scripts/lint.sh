#!/usr/bin/env bash
# The lint gate scripts/test.sh runs before the tests (settings in pyproject.toml):
# ruff check, ruff format --check, and mypy on ldlm/, export/ and serve/.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
py="${PYTHON:-.venv/bin/python}"
case "$py" in /*) ;; *) py="$root/$py" ;; esac  # mypy runs from another folder below
"$py" -m ruff check .
"$py" -m ruff format --check .
# mypy resolves ldlm.export and ldlm.serve through a tree of links shaped like the installed package
# (export/ and serve/ under ldlm/): pyproject's package-dir mapping is invisible to it.
tree="$root/.cache/mypy-tree"
rm -rf "$tree"
mkdir -p "$tree/ldlm"
for entry in ldlm/*; do
  ln -s "$root/$entry" "$tree/ldlm/"
done
ln -s "$root/export" "$tree/ldlm/export"
ln -s "$root/serve" "$tree/ldlm/serve"
cd "$tree"
"$py" -m mypy --config-file "$root/pyproject.toml" --cache-dir "$root/.cache/mypy" --python-executable "$py" -p ldlm
