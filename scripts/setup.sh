#!/usr/bin/env bash
# Set up everything on a fresh Debian/Ubuntu machine, idempotently. What it installs depends on the machine:
#   x86-64 PC: Debian packages (compiler and cmake for the native VAE decoder; chromium and fonts for the browser
#     tests), .venv with the app (requirements.txt) and the PC/dev extras (requirements-dev.txt: torch, the test
#     oracle, pytest, playwright), the native stable-diffusion.cpp VAE decoder (native/build/), and the RKNN
#     conversion environment .venv-rknn (rknn-toolkit2's pins clash with the main one).
#   aarch64 (the RK3588 board): the compiler packages, .venv with the app only (no torch, chromium, playwright or
#     diffusers; rknn-toolkit-lite2 comes with requirements.txt there), the native VAE decoder, then the board
#     checks (`anima-ui doctor --quick`): librknnrt.so and its version, the NPU driver and device access, the
#     user's groups, each with the exact fix.
# Options:
#   --dry-run      print the plan (every command it would run) and change nothing
#   ANIMA_ARCH=…   take this machine type instead of `uname -m` (x86_64 or aarch64; the tests plan both)
#   PYTHON=…       the interpreter for .venv (default python3; the board needs 3.7-3.12 for rknn-toolkit-lite2)
set -euo pipefail
cd "$(dirname "$0")/.."

dry_run=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry_run=1 ;;
    *) echo "unknown option $arg (known: --dry-run)" >&2; exit 2 ;;
  esac
done
arch="${ANIMA_ARCH:-$(uname -m)}"
case "$arch" in
  x86_64|amd64) machine=pc ;;
  aarch64|arm64) machine=board ;;
  *) echo "unsupported machine type $arch: this sets up x86_64 PCs and aarch64 RK3588 boards" >&2; exit 2 ;;
esac
python="${PYTHON:-python3}"

run() {  # print a step, then run it unless this is a dry run
  echo "+ $*"
  if [ "$dry_run" = 0 ]; then "$@"; fi
}
as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

echo "== setting up for $arch ($machine)$([ "$dry_run" = 1 ] && echo ', dry run: nothing is changed')"

if [ "$machine" = board ]; then
  # rknn-toolkit-lite2 2.5.0 publishes aarch64 wheels for CPython 3.7-3.12 only
  venv_python="$python"
  if [ -x .venv/bin/python ]; then venv_python=.venv/bin/python; fi
  version="$("$venv_python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
  case "$version" in
    3.7|3.8|3.9|3.10|3.11|3.12) ;;
    *)
      echo "$venv_python is Python $version, but rknn-toolkit-lite2 (the NPU runtime) has wheels for Python 3.7-3.12 only." >&2
      echo "fix: install Python 3.12 (e.g. with pyenv), $([ -x .venv/bin/python ] && echo 'remove .venv, ')then run: PYTHON=python3.12 bash scripts/setup.sh" >&2
      exit 1 ;;
  esac
fi

packages=(cmake ninja-build g++ make python3-venv)
if [ "$machine" = pc ]; then
  packages+=(fonts-liberation)  # the browser tests' screenshots
  command -v chromium >/dev/null || packages+=(chromium)
fi
missing=()
for p in "${packages[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
echo "== apt packages: ${packages[*]} (missing here: ${missing[*]:-none})"
if [ ${#missing[@]} -gt 0 ]; then
  run as_root apt-get update -qq
  run as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi

if [ -x .venv/bin/python ]; then
  echo "== .venv exists"
else
  echo "== creating .venv"
  run "$python" -m venv .venv
fi
echo "== pip: $([ "$machine" = pc ] && echo 'the app and the PC/dev extras' || echo 'the app only')"
if [ "$machine" = pc ]; then
  run .venv/bin/python -m pip install -q -r requirements.txt -r requirements-dev.txt
else
  run .venv/bin/python -m pip install -q -r requirements.txt
fi
run .venv/bin/python -m pip install -q --no-deps -e .

echo "== native stable-diffusion.cpp VAE decoder"
run env PYTHON=.venv/bin/python bash scripts/build_sdcpp_vae.sh

if [ "$machine" = pc ]; then
  echo "== RKNN conversion environment (.venv-rknn)"
  run bash scripts/make_rknn_venv.sh
else
  echo "== board checks (the full check, with a graph run on the NPU: .venv/bin/anima-ui doctor)"
  run .venv/bin/anima-ui doctor --quick || {
    echo "== set-up done, but the board is not ready for the NPU yet: apply the fixes above, then run .venv/bin/anima-ui doctor"
    exit 0
  }
fi
echo "== set-up done"
