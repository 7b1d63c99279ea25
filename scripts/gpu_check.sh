#!/usr/bin/env bash
# The GPU subset in one run, for a machine with a CUDA GPU (tailreplay_eval/gpu_check.py says what runs):
#   kernel and CUDA-path tests, the kernel-vs-fla table, stock and Tail-Replay hits under SGLang's GPU defaults
#   against their own no-cache runs (only where sglang==0.5.23 with CUDA is installed), the TTFT table at 16K-128K.
# Usage: scripts/gpu_check.sh [--out runs/gpu_check.json] [--skip PART ...] [--model DIR]
# What a machine lacks (fla-core, transformers, hypothesis) comes as wheels in .whl/ (scripts/gpu_wheels.sh, here),
# installed into .site/ first. On a lent device, from this machine:
#   scripts/gpu_wheels.sh, then run(command="scripts/gpu_check.sh --out $OUT/gpu_check.json", carry=[".whl",
#   ".venv/lib/python3.11/site-packages/sglang/kernels/ops/attention/linear/seg_la.py"]) (SGLang's lightning kernel,
#   standalone Triton, for tests/test_kernels.py)
# Writes one JSON after every part (default runs/gpu_check.json); exit status 1 if a part that ran failed.
# Nothing in CI runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
WHEELS="${WHEELS:-.whl}"
SITE=""
if compgen -G "$WHEELS/*.whl" > /dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --target .site "$WHEELS"/*.whl
    SITE="$PWD/.site:"
fi
PYTHONPATH="$SITE$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout 590 "$PYTHON" -m tailreplay_eval.gpu_check "$@"
