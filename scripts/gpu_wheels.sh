#!/usr/bin/env bash
# The wheels a lent GPU machine lacks, for its Python (3.12, manylinux x86_64), into .whl/ (git-ignored): carried
# there with run(carry=[".whl"]) and installed by scripts/gpu_check.sh. The machine has torch, Triton, pytest and
# transformers' own dependencies. fla-core and transformers at this project's versions (requirements/cpu.lock);
# hypothesis, which only the tests use, at the newest the index has for that platform.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
lock() { grep -E "^$1==" requirements/cpu.lock; }
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d .whl \
    "$(lock fla-core)" "$(lock transformers)" hypothesis "$(lock sortedcontainers)"
du -sh .whl
