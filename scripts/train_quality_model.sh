#!/usr/bin/env bash
# Train models/quality-qwen35 from scratch, as committed: recipe 4 (copy drills, then the task mix up to 2K
# tokens), then its continuation onto 8K-token contexts (docs/quality.md). Seeded; each stage resumes from its
# --work directory if killed. About 32 + 75 minutes on 2 CPU cores. Run after scripts/setup_cpu.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
"$PY" -m tailreplay_eval.training --out .train/quality-qwen35-base --work .train/quality-qwen35-r4
"$PY" -m tailreplay_eval.training --init-from .train/quality-qwen35-base --out models/quality-qwen35 \
    --work .train/quality-qwen35-r5 --steps 1100 --min-len 512 --max-len 8192 --tokens-per-step 8192 \
    --curriculum-steps 400 --lr 0.001 --warmup 30
