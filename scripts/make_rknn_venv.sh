#!/usr/bin/env bash
# Create .venv-rknn (repo root, gitignored): the rknn-toolkit2 conversion environment, on x86-64 or on the
# board (aarch64). rknn-toolkit2 cannot share the main environment (it pins numpy<=1.26.4, onnx<=1.18,
# protobuf<=4.25.4), so it gets its own venv.
#
#   bash scripts/make_rknn_venv.sh [--toolkit VERSION] [--with-torch]
#
# --toolkit: the rknn-toolkit2 version (default 2.5.0). Convert with the toolkit that matches the board's
#   librknnrt.so: a runtime older than the converting toolkit can refuse the graphs.
# --with-torch: also install a CPU torch. The FP16 conversion does not need it (rknn_worker.py puts a
#   stand-in in its place; the toolkit only imports torch for its quantizers), quantization does.
#   x86-64: torch 2.13.0 (the CPU build); aarch64: torch 2.2.0, the newest inside the toolkit's aarch64 pin
#   (torch<=2.2.0) and a CPU-only wheel on aarch64.
# The toolkit goes in with --no-deps (its torch pin would pull a multi-GB build), then its other needs.
# Idempotent: a venv that already has the requested toolkit (and torch, if asked) is left alone.
set -euo pipefail

toolkit=2.5.0
with_torch=0
while [ $# -gt 0 ]; do
  case "$1" in
    --toolkit) toolkit="$2"; shift 2 ;;
    --with-torch) with_torch=1; shift ;;
    *) echo "usage: $0 [--toolkit VERSION] [--with-torch]" >&2; exit 2 ;;
  esac
done

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${RKNN_VENV:-$repo_root/.venv-rknn}"
worker="$repo_root/anima_ui/convert/rknn_worker.py"
arch="$(uname -m)"
case "$arch" in
  x86_64) torch_pin="torch==2.13.0" ;;
  aarch64) torch_pin="torch==2.2.0" ;;
  *) echo "no rknn-toolkit2 wheels for $arch (x86_64 and aarch64 only)" >&2; exit 1 ;;
esac
# The toolkit has wheels for CPython 3.8-3.12 only.
python="${PYTHON:-}"
if [ -z "$python" ]; then
  for candidate in python3.11 python3.12 python3.10 python3; do
    if command -v "$candidate" >/dev/null; then python="$candidate"; break; fi
  done
fi
"$python" -c 'import sys; sys.exit(0 if (3, 8) <= sys.version_info[:2] <= (3, 12) else 1)' || {
  echo "$python is Python $("$python" -c 'import platform; print(platform.python_version())'); rknn-toolkit2 needs 3.8-3.12: set PYTHON=python3.11" >&2
  exit 1
}

ready() {  # the requested toolkit imports (through the worker, which supplies the torch stand-in if needed)
  [ -x "$venv/bin/python" ] || return 1
  local info
  info="$("$venv/bin/python" "$worker" --version 2>/dev/null)" || return 1
  case "$info" in *"\"rknn-toolkit2\": \"$toolkit\""*) ;; *) return 1 ;; esac
  if [ "$with_torch" = 1 ]; then case "$info" in *'"torch": null'*) return 1 ;; esac; fi
  "$venv/bin/python" "$worker" --check >/dev/null 2>&1
}

if ready; then
  echo "$venv is ready: $("$venv/bin/python" "$worker" --version)"
  exit 0
fi

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --disable-pip-version-check)
"${pip[@]}" "numpy==1.26.4" "onnx==1.18.0" "protobuf==4.25.4" "onnxruntime<1.23"
[ "$with_torch" = 1 ] && "${pip[@]}" "$torch_pin"
"${pip[@]}" --no-deps "rknn-toolkit2==$toolkit"
# setuptools<70 still ships pkg_resources, which the toolkit imports. pip warns that the torch pin and
# opencv-python are unmet: harmless for the ONNX -> RKNN FP16 conversion and the simulator.
"${pip[@]}" fast-histogram "opencv-python-headless<4.11" psutil ruamel-yaml "scipy<1.14" tqdm "setuptools<70"

ready || { echo "rknn-toolkit2 $toolkit does not import in $venv; see the pip output above" >&2; exit 1; }
echo "$venv is ready: $("$venv/bin/python" "$worker" --version)"
