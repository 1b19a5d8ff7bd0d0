"""`anima-ui verify` on the tiny random model: passes on correct graphs, fails (exit 1) on wrong ones."""

import json
import shutil
import subprocess
import sys

import pytest



@pytest.fixture(scope="module")
def tiny_models(tiny_model, tmp_path_factory):
    return shutil.copytree(tiny_model, tmp_path_factory.mktemp("verify") / "tiny")  # verify exports into it


def verify(models, *extra):
    command = [sys.executable, "-m", "anima_ui", "verify", "--models", str(models), "--width", "64", "--height", "64", *extra]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("backend", ["onnx", "sim"])
def test_verify_passes_on_the_exported_graphs(tiny_models, backend):
    result = verify(tiny_models, "--backend", backend)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    summary = json.loads(lines[-1])
    assert summary["passed"] and summary["min_cosine"] >= 0.99999 and summary["nonfinite"] == 0
    assert [line.split()[0:2] for line in lines[2:4]] == [["block", "0"], ["block", "1"]]
    assert lines[4].split()[0:2] == ["final", "prediction"]
    assert (tiny_models / "exported" / "64x64" / "manifest.json").is_file()  # exported on first use


def test_verify_fails_when_two_blocks_graphs_are_swapped(tiny_models, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_models, broken, symlinks=True)
    graphs = broken / "exported" / "64x64"
    if not graphs.exists():
        assert verify(broken, "--backend", "onnx").returncode == 0
    first, second = graphs / "block00_mlp.onnx", graphs / "block01_mlp.onnx"
    first.rename(graphs / "swap")
    second.rename(first)
    (graphs / "swap").rename(second)
    result = verify(broken, "--backend", "onnx", "--no-prefetch")
    assert result.returncode == 1
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert not summary["passed"] and summary["min_cosine"] < 0.99


def test_verify_rknn_without_converted_graphs_says_what_to_run(tiny_models):
    result = verify(tiny_models, "--backend", "rknn")
    assert result.returncode == 2
    assert "--width 64 --height 64` first" in result.stderr and "run `anima-ui prepare --models" in result.stderr
