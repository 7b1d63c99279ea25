#!/usr/bin/env bash
# The GPU subset in one run, for a machine with a CUDA GPU (tailreplay_eval/gpu_check.py says what runs):
#   kernels against float64 references, stock and Tail-Replay hits under SGLang's GPU defaults against their own
#   no-cache runs (needs sglang==0.5.23 with CUDA and this package installed: pip install -e .), the TTFT table.
# Usage: scripts/gpu_check.sh [--model DIR] [--out runs/gpu_check.json] [--skip kernels serving ttft]
# Writes one JSON (default runs/gpu_check.json); exit status 1 if a part that ran failed. Nothing in CI runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout 600 "$PYTHON" -m tailreplay_eval.gpu_check "$@"
