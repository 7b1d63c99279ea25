#!/usr/bin/env bash
# Build (or refresh) the project's CPU-only virtual environment: CPU torch, SGLang 0.5.23 without its CUDA-only
# dependencies, this package and the CPU port it is tested on (cpu_compat/) in editable mode. Idempotent: a stamp
# of the inputs skips work already done.
#
#   scripts/setup_cpu.sh                 # create/update .venv (VENV=path to choose another)
#   scripts/setup_cpu.sh --refresh-lock  # re-derive SGLang's deps from its wheel and re-pin requirements/cpu.lock
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3.11}
TORCH=torch==2.13.0
# The torchvision release built for torch 2.13. PyPI only has its CUDA build: its Python side (the image transforms
# that vision-language preprocessing uses) runs on CPU torch, its C++ ops cannot load (sglang_cpu_compat/fallback.py).
TORCHVISION=torchvision==0.28.0
SGLANG=sglang==0.5.23
PIP_FLAGS=(--quiet --disable-pip-version-check)

say() { printf '[setup] %s\n' "$*"; }

make_venv() {
  if [ ! -x "$VENV/bin/python" ]; then
    say "creating $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/pip" install "${PIP_FLAGS[@]}" pip==26.3
  fi
}

refresh_lock() {
  local tmp
  tmp=$(mktemp -d)
  say "deriving SGLang's runtime dependencies from its wheel metadata"
  "$VENV/bin/pip" download "${PIP_FLAGS[@]}" --no-deps "$SGLANG" -d "$tmp/wheel"
  "$VENV/bin/python" scripts/derive_sglang_deps.py "$tmp"/wheel/sglang-*.whl > requirements/sglang-cpu.in
  say "resolving them beside $TORCH in a scratch venv"
  "$PYTHON" -m venv "$tmp/venv"
  "$tmp/venv/bin/pip" install "${PIP_FLAGS[@]}" "$TORCH"
  echo "$TORCH" > "$tmp/constraints.txt"
  "$tmp/venv/bin/pip" install "${PIP_FLAGS[@]}" -c "$tmp/constraints.txt" \
    -r requirements/sglang-cpu.in -r requirements/project.in
  {
    echo "# Exact versions of SGLang's non-CUDA dependencies (requirements/sglang-cpu.in) plus requirements/project.in,"
    echo "# resolved beside $TORCH (CPU). Regenerate with: scripts/setup_cpu.sh --refresh-lock"
    "$tmp/venv/bin/pip" freeze --exclude-editable | grep -v -E '^(torch|sglang|tailreplay-sglang)[= @]'
  } > requirements/cpu.lock
  rm -rf "$tmp"
  say "wrote requirements/cpu.lock ($(grep -vc '^#' requirements/cpu.lock) packages)"
}

install() {
  local stamp="$VENV/.tailreplay-setup" want
  want=$(cat requirements/cpu.lock pyproject.toml cpu_compat/pyproject.toml scripts/setup_cpu.sh | sha256sum | cut -c1-16)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    say "$VENV is up to date"
    return
  fi
  local start=$SECONDS
  say "installing $TORCH (CPU build)"
  "$VENV/bin/pip" install "${PIP_FLAGS[@]}" "$TORCH"
  say "installing pinned dependencies (requirements/cpu.lock)"
  echo "$TORCH" > "$VENV/torch-constraint.txt"  # nothing may replace the CPU torch
  "$VENV/bin/pip" install "${PIP_FLAGS[@]}" -c "$VENV/torch-constraint.txt" -r requirements/cpu.lock
  say "installing $TORCHVISION (Python side only; its CUDA ops stay unloaded)"
  "$VENV/bin/pip" install "${PIP_FLAGS[@]}" --no-deps "$TORCHVISION"
  say "installing $SGLANG without its CUDA-only dependencies"
  "$VENV/bin/pip" install "${PIP_FLAGS[@]}" --no-deps "$SGLANG"
  say "installing tailreplay-sglang (editable)"
  "$VENV/bin/pip" install "${PIP_FLAGS[@]}" --no-deps -e .
  say "installing sglang-cpu-compat, SGLang's CPU port (editable)"
  "$VENV/bin/pip" install "${PIP_FLAGS[@]}" --no-deps -e cpu_compat
  "$VENV/bin/python" -c "import sglang, sgl_kernel, tailreplay_sglang, sglang_cpu_compat, torch, torchvision; assert not torch.cuda.is_available()"
  echo "$want" > "$stamp"
  say "done in $((SECONDS - start)) s"
}

make_venv
if [ "${1:-}" = "--refresh-lock" ]; then
  refresh_lock
fi
install
