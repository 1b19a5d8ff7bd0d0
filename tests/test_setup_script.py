"""scripts/setup.sh plans the x86-64 PC and the aarch64 board differently: the board gets the app only (no torch,
chromium, playwright, diffusers) and the board checks. Run with --dry-run (and ANIMA_ARCH to pick the branch) in a
copy of the repo's set-up files, which the dry run must leave untouched. The real run is .ci/run's first line."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def checkout(tmp_path):
    """The files setup.sh reads, in a fresh folder without .venv."""
    for name in ("scripts/setup.sh", "requirements.txt", "requirements-dev.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / name, tmp_path / name)
    return tmp_path


def plan(checkout, arch, **env):
    result = subprocess.run(["bash", str(checkout / "scripts/setup.sh"), "--dry-run"], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "ANIMA_ARCH": arch, **env})
    commands = [line[2:] for line in result.stdout.splitlines() if line.startswith("+ ")]
    return result, commands


def apt_packages(stdout: str) -> list[str]:
    line = next(line for line in stdout.splitlines() if line.startswith("== apt packages: "))
    return line[len("== apt packages: "):].split(" (missing here")[0].split()


def test_pc_plan_keeps_the_dev_extras_and_the_conversion_env(checkout):
    result, commands = plan(checkout, "x86_64")
    assert result.returncode == 0, result.stderr
    packages = apt_packages(result.stdout)
    assert {"cmake", "ninja-build", "g++", "make", "python3-venv", "fonts-liberation"} <= set(packages)
    assert "chromium" in packages or shutil.which("chromium")  # asked for only where it is missing
    assert commands[0] == "python3 -m venv .venv"
    assert ".venv/bin/python -m pip install -q -r requirements.txt -r requirements-dev.txt" in commands
    assert "env PYTHON=.venv/bin/python bash scripts/build_sdcpp_vae.sh" in commands
    assert commands[-1] == "bash scripts/make_rknn_venv.sh"
    assert not any("doctor" in c for c in commands)
    assert sorted(p.name for p in checkout.iterdir()) == ["requirements-dev.txt", "requirements.txt", "scripts"]  # nothing made


def test_board_plan_installs_the_app_only_and_checks_the_board(checkout):
    result, commands = plan(checkout, "aarch64")
    assert result.returncode == 0, result.stderr
    assert set(apt_packages(result.stdout)) == {"cmake", "ninja-build", "g++", "make", "python3-venv"}
    assert ".venv/bin/python -m pip install -q -r requirements.txt" in commands
    for absent in ("requirements-dev", "chromium", "playwright", "diffusers", "torch", "make_rknn_venv"):
        assert not any(absent in c for c in commands), absent
    assert "env PYTHON=.venv/bin/python bash scripts/build_sdcpp_vae.sh" in commands
    assert commands[-1] == ".venv/bin/anima-ui doctor --quick"
    assert not (checkout / ".venv").exists()


def test_board_refuses_a_python_without_lite2_wheels_and_says_how(checkout, tmp_path):
    fake = tmp_path / "python3.13"
    fake.write_text("#!/bin/sh\necho 3.13\n")
    fake.chmod(0o755)
    result, commands = plan(checkout, "aarch64", PYTHON=str(fake))
    assert result.returncode == 1 and not commands
    assert "has wheels for Python 3.7-3.12 only" in result.stderr
    assert "PYTHON=python3.12 bash scripts/setup.sh" in result.stderr
    # a PC has no such limit
    assert plan(checkout, "x86_64", PYTHON=str(fake))[0].returncode == 0


def test_unknown_machine_and_option(checkout):
    assert plan(checkout, "riscv64")[0].returncode == 2
    bad = subprocess.run(["bash", str(checkout / "scripts/setup.sh"), "--dryrun"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "known: --dry-run" in bad.stderr


def test_the_board_check_setup_runs_exists():
    """The command the board plan ends with is a real command and flag (test_doctor runs it)."""
    from anima_ui.cli import build_parser

    assert build_parser("doctor").parse_args(["doctor", "--quick"]).quick
