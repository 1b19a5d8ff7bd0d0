#!/usr/bin/env bash
# Create .venv-rknn (repo root, gitignored): the rknn-toolkit2 2.5.0 conversion environment.
# rknn-toolkit2 cannot share the main environment (it pins numpy<=1.26.4, onnx<=1.18, protobuf<=4.25.4),
# so it gets its own venv, built with the "lighter conversion environment" recipe of
# docs/../shared/reference/rknn.md: the CPU torch 2.13.0 file on disk instead of the multi-GB CUDA torch 2.4
# its pins ask for, then the toolkit with --no-deps, then its remaining needs.
# Idempotent: a venv whose `from rknn.api import RKNN` already works is left alone.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${RKNN_VENV:-$repo_root/.venv-rknn}"
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null || python=python3

if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "from rknn.api import RKNN" >/dev/null 2>&1; then
    echo "$venv is ready: $("$venv/bin/python" -c 'import importlib.metadata as m; print("rknn-toolkit2", m.version("rknn-toolkit2"))')"
    exit 0
fi

"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --disable-pip-version-check)
# torch 2.13.0 is the CPU wheel on this machine's disk; the toolkit only imports torch.nn at import time.
"${pip[@]}" "torch==2.13.0" "numpy==1.26.4" "onnx==1.18.0" "protobuf==4.25.4" "onnxruntime<1.23"
"${pip[@]}" --no-deps "rknn-toolkit2==2.5.0"
# setuptools<70 still ships pkg_resources, which the toolkit imports. pip warns that the torch pin and
# opencv-python are unmet: harmless for ONNX -> RKNN FP16 conversion and the simulator.
"${pip[@]}" fast-histogram "opencv-python-headless<4.11" psutil ruamel-yaml "scipy<1.14" tqdm "setuptools<70"

"$venv/bin/python" -c "from rknn.api import RKNN; import importlib.metadata as m; print('rknn-toolkit2', m.version('rknn-toolkit2'), 'ready in $venv')"
