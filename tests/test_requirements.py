"""The board's install: `requirements.txt` resolved for aarch64 (manylinux, Python 3.11 and 3.12, wheels only)
holds no torch, triton, nvidia-* or cuda-* package, and does hold the NPU runtime rknn-toolkit-lite2.

pip judges environment markers by the interpreter that runs it, not by --platform / --python-version: run as is,
it drops `rknn-toolkit-lite2; platform_machine == "aarch64"` on this x86-64 machine. So pip runs here with the
board's platform.machine() and Python version, which every marker (ours and those of the dependencies) reads.
Each run asks the index again (pip revalidates index pages every time; its cache keeps only immutable files)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BOARD_PYTHONS = ("3.11", "3.12")
# Any glibc from 2.17 (the lite2 wheel's tag) to 2.28 (onnxruntime's aarch64 wheels; Debian 10+, Ubuntu 20.04+):
# pip does not widen one --platform to the older manylinux tags itself.
PLATFORMS = tuple(f"manylinux_2_{minor}_aarch64" for minor in range(28, 16, -1))
FORBIDDEN = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*)$")
UNREACHABLE = ("NewConnectionError", "Max retries exceeded", "Temporary failure in name resolution",
               "Network is unreachable", "Connection refused", "ConnectTimeoutError", "ReadTimeoutError")

PIP_AS_BOARD = """
import platform, sys
version = sys.argv[1] + ".0"
platform.machine = lambda: "aarch64"
platform.python_version = lambda: version
platform.python_version_tuple = lambda: tuple(version.split("."))
from pip._internal.cli.main import main
sys.exit(main(sys.argv[2:]))
"""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def resolve_for_board(python_version: str, report: Path, target: Path) -> subprocess.Popen:
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    command = [sys.executable, "-c", PIP_AS_BOARD, python_version, "install", "--dry-run",
               "--report", str(report), "--target", str(target), *platforms, "--only-binary=:all:",
               "--python-version", python_version, "-r", str(REPO / "requirements.txt")]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_board_requirements_resolve_without_torch(tmp_path):
    runs = {v: resolve_for_board(v, tmp_path / f"report-{v}.json", tmp_path / f"target-{v}") for v in BOARD_PYTHONS}
    outputs = {v: p.communicate(timeout=600)[0] for v, p in runs.items()}  # the two resolutions run side by side
    for version, process in runs.items():
        output = outputs[version]
        if process.returncode != 0:
            errors = [line for line in output.splitlines() if any(s in line for s in UNREACHABLE)]
            if errors:
                pytest.skip(f"the package index is unreachable, so the board's requirements cannot be resolved: {errors[0][:200]}")
            pytest.fail(f"requirements.txt does not resolve for aarch64 / Python {version}:\n{output[-3000:]}")
        installed = {canonical(item["metadata"]["name"]) for item in json.loads((tmp_path / f"report-{version}.json").read_text())["install"]}
        forbidden = sorted(name for name in installed if FORBIDDEN.match(name))
        assert not forbidden, f"the board's install (Python {version}) would pull {forbidden}: keep them in requirements-dev.txt"
        for needed in ("rknn-toolkit-lite2", "onnxruntime", "gradio", "tokenizers", "transformers", "numpy"):
            assert needed in installed, f"{needed} missing from the board's install for Python {version}"
