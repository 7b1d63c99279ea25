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
# PD disaggregation's transfer engine on a CPU (--disaggregation-transfer-backend mooncake_tcp; the wheel
# mooncake-transfer-engine-non-cuda is pinned in requirements/cpu.lock). Its engine.so links
# libibverbs.so.1 even when only TCP is used; Debian's package and the libnl it needs are unpacked next to the
# wheel's own bundled libraries ($ORIGIN/../mooncake_transfer_engine_non_cuda.libs is in engine.so's RPATH), so no
# root and no system package are needed. Pinned by version and sha256.
DEBIAN_POOL=http://deb.debian.org/debian/pool/main
VERBS_DEBS=(
  "r/rdma-core/libibverbs1_44.0-2_amd64.deb 35054815259fee46173240254246d03b673a5cd5c528aaac96fd15ac428a8d59"
  "libn/libnl3/libnl-3-200_3.7.0-0.2+b1_amd64.deb d1fc3e9eb8e79b4c96b0a64c3d8c9e068ae2f665cab71bd19f417ffd0453a890"
  "libn/libnl3/libnl-route-3-200_3.7.0-0.2+b1_amd64.deb 0fdcc425ae2982788c085c76a7cb0eda3e3db99d41bd1ce56082ee18e9f1e21f"
)
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

provide_verbs() {
  say "providing the libibverbs that mooncake's engine links (Debian's, unpacked beside the wheel's libraries)"
  local libs tmp entry path sum
  libs=$("$VENV/bin/python" -c "import pathlib, sysconfig; print(pathlib.Path(sysconfig.get_paths()['purelib'], 'mooncake_transfer_engine_non_cuda.libs'))")
  tmp=$(mktemp -d)
  for entry in "${VERBS_DEBS[@]}"; do
    read -r path sum <<<"$entry"
    "$VENV/bin/python" -c "import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], sys.argv[2])" \
      "$DEBIAN_POOL/$path" "$tmp/pkg.deb"
    echo "$sum  $tmp/pkg.deb" | sha256sum --check --quiet
    dpkg-deb -x "$tmp/pkg.deb" "$tmp/root"
  done
  cp -a "$tmp"/root/usr/lib/x86_64-linux-gnu/lib*.so.* "$tmp"/root/lib/x86_64-linux-gnu/lib*.so.* "$libs/"
  rm -rf "$tmp"
  "$VENV/bin/python" -c "import mooncake.engine"
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
  provide_verbs
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
