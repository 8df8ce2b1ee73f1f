#!/usr/bin/env bash
# GPU self-check: init parity (cuda vs cpu), bf16 + compile, Llama 3.2 1B tokens/s and
# MFU, float8 against bf16, the planner's peak memory against the measured one,
# FlexAttention against SDPA, CP2 (two GPUs), the dry run against a real step; one
# table at the end, exit status 1 if any check fails (scripts/gpu_check.py).
#   bash scripts/gpu_check.sh                  # one GPU, about 10 minutes, nothing downloaded
#   bash scripts/gpu_check.sh --out "$OUT"     # logs under $OUT/gpu_check
#   bash scripts/gpu_check.sh --dry-run        # anywhere: the plan, every command validated
# PYTHON: the interpreter (default python3, else python).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"

# The tree need not be pip-installed. PYTHONPATH=$ROOT alone is not enough: models/
# installs as composer.models (pyproject's package-dir), so a view of composer/ with
# models/ inside it, made of symlinks, goes first.
VIEW="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_src.XXXXXX")"
trap 'rm -rf "$VIEW"' EXIT
mkdir "$VIEW/composer"
ln -s "$ROOT"/composer/* "$VIEW/composer/"
ln -s "$ROOT/models" "$VIEW/composer/models"
export PYTHONPATH="$VIEW:$ROOT${PYTHONPATH:+:$PYTHONPATH}"

status=0
"$PYTHON" "$ROOT/scripts/gpu_check.py" "$@" || status=$?
exit "$status"
