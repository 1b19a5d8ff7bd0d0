#!/usr/bin/env bash
# Set up everything on a fresh Debian/Ubuntu machine (an x86-64 PC or the RK3588 board), idempotently:
#   Debian packages (compiler and cmake for the native VAE decoder, chromium for the browser tests),
#   the main virtual environment .venv (runtime + test requirements, this package),
#   the native stable-diffusion.cpp VAE decoder (native/build/),
#   and on x86-64 the RKNN conversion environment .venv-rknn (rknn-toolkit2 pins clash with the main one).
set -euo pipefail
cd "$(dirname "$0")/.."

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

packages=(cmake ninja-build g++ make python3-venv fonts-liberation)
command -v chromium >/dev/null || packages+=(chromium)
missing=()
for p in "${packages[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  echo "== apt: ${missing[*]}"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi

if [ ! -x .venv/bin/python ]; then
  echo "== creating .venv"
  python3 -m venv .venv
fi
echo "== pip: requirements"
.venv/bin/python -m pip install -q -r requirements.txt -r requirements-dev.txt
.venv/bin/python -m pip install -q --no-deps -e .

echo "== native stable-diffusion.cpp VAE decoder"
PYTHON=.venv/bin/python bash scripts/build_sdcpp_vae.sh

if [ "$(uname -m)" = "x86_64" ]; then
  echo "== RKNN conversion environment (.venv-rknn)"
  bash scripts/make_rknn_venv.sh
fi
echo "== set-up done"
