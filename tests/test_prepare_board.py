"""`anima-ui prepare` end to end (the RKNN tier: needs .venv-rknn): download from a local mirror, export without
torch, convert, simulator check, manifests, the NPU decoder's graphs too; then `verify` passes; and a run killed
mid-export, mid-conversion and mid-way through the decoder's conversion ends, after a rerun, with the manifests of an
uninterrupted run."""

import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import replace

import pytest

from anima_ui.convert.convert_rknn import MIN_SIM_COSINE, VENV_PYTHON
from anima_ui.fixtures.model import write_random_model
from anima_ui.fixtures.weights import write_random_dit
from anima_ui.model.config import AnimaConfig
from anima_ui.runtime.manifest import Manifest
from anima_ui.vae.npu_graphs import MIN_SIM_PSNR, VaeGraphs

pytestmark = pytest.mark.rknn
SIZE = ["--width", "64", "--height", "64"]


@pytest.fixture(scope="module", autouse=True)
def conversion_environment():
    if not VENV_PYTHON.exists():
        pytest.fail(f"{VENV_PYTHON} is missing: run scripts/make_rknn_venv.sh before `pytest -m rknn`")


@pytest.fixture(scope="module")
def mirror(tmp_path_factory):
    """The official files of the tiny model, served from a folder as a file:// mirror."""
    return write_random_model(tmp_path_factory.mktemp("mirror") / "tiny", "tiny", 0)


@pytest.fixture(scope="module")
def wide_mirror(tmp_path_factory):
    """The tiny model with a wider DiT (width 1024, FFN 4096), so that one graph takes long enough to be killed mid-way."""
    folder = write_random_model(tmp_path_factory.mktemp("mirror") / "wide", "tiny", 0)
    cfg = replace(AnimaConfig.tiny(), width=1024, num_heads=8, head_dim=128, mlp_dim=4096)
    write_random_dit(folder / "diffusion_models" / "anima-base-v1.0.safetensors", cfg, 1)
    return folder


def prepare_command(command_prefix, models, mirror):
    return [*command_prefix, "prepare", "--models", str(models), *SIZE, "--mirror", mirror.resolve().as_uri()]


def test_prepare_from_an_empty_folder_then_verify(mirror, tmp_path, anima_ui_without_torch):
    models = tmp_path / "models"
    result = subprocess.run(prepare_command(anima_ui_without_torch, models, mirror), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert any(line.startswith("convert 6/6 block01_mlp.rknn") and "ETA" in line for line in lines)
    assert lines[-1].startswith("start the app") and "anima-ui serve --models" in lines[-1]
    assert "peak RSS" in result.stderr
    onnx, rknn = Manifest.read(models / "exported" / "64x64"), Manifest.read(models / "rknn" / "64x64")
    assert onnx.format == "onnx" and rknn.format == "rknn" and len(rknn.graphs) == 6
    for graph, source in zip(rknn.graphs, onnx.graphs, strict=True):
        assert graph.extra["onnx_sha256"] == source.sha256 and graph.inputs == source.inputs
        assert graph.extra["sim_cosine"] >= MIN_SIM_COSINE and graph.extra["sim_nonfinite"] == 0
    decoder = VaeGraphs.read(models / "vae" / "npu" / "rknn" / "64x64")
    assert all(g.extra["sim_psnr"] >= MIN_SIM_PSNR for g in decoder.graphs)
    for backend in ("onnx", "sim"):
        verify = subprocess.run([sys.executable, "-m", "anima_ui", "verify", "--models", str(models), "--backend", backend, *SIZE],
                                capture_output=True, text=True, timeout=300)
        assert verify.returncode == 0, verify.stdout + verify.stderr
        assert json.loads(verify.stdout.strip().splitlines()[-1])["passed"]


def run_until(command, marker):
    """Start `command`, kill it (SIGKILL, as a power cut would) right after it prints a line containing `marker`."""
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in process.stderr:
        seen.append(line)
        if marker in line:
            os.kill(process.pid, signal.SIGKILL)
            break
    process.wait()
    assert process.returncode == -signal.SIGKILL, "".join(seen)[-2000:]
    return "".join(seen)


def deterministic(manifest: Manifest, folder) -> list:
    """What two conversions of the same ONNX graphs must agree on. Not the .rknn bytes (two builds of one graph
    differ in about 1 KB of embedded pointers) nor the exact simulator error; their size and everything else."""
    return [(g.file, g.block, g.kind, g.inputs, g.outputs, g.extra["onnx_sha256"], g.extra["toolkit"], g.extra["target"],
             (folder / g.file).stat().st_size) for g in manifest.graphs]


def test_prepare_killed_mid_export_and_mid_conversion_ends_like_one_run(wide_mirror, tmp_path, anima_ui_without_torch):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    done = subprocess.run(prepare_command(anima_ui_without_torch, whole, wide_mirror), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]

    command = prepare_command(anima_ui_without_torch, killed, wide_mirror)
    run_until(command, "export 3/6")
    assert not (killed / "exported" / "64x64" / "manifest.json").exists()  # killed inside the export
    second = run_until(command, "convert 2/6")
    assert "export 1/6 block00_self_attn.onnx (kept)" in second and "export 3/6 block00_mlp.onnx (kept)" in second
    assert "export 6/6 block01_mlp.onnx (kept)" not in second  # the graphs after the kill were built, not kept
    assert not (killed / "rknn" / "64x64" / "manifest.json").exists()  # killed inside the conversion
    third = run_until(command, "decoder convert 2/")
    assert "\nexport: 0 built, 6 kept" in third
    assert "convert 1/6 block00_self_attn.rknn (kept)" in third and "convert 2/6 block00_cross_attn.rknn (kept)" in third
    assert "\nconvert: 6 built" not in third and "\nconvert: 0 built" not in third
    decoder_killed = killed / "vae" / "npu" / "rknn" / "64x64"
    assert not (decoder_killed / "manifest.json").exists()  # killed inside the decoder's conversion
    last = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert last.returncode == 0, last.stderr[-3000:]
    assert "\nconvert: 0 built, 6 kept" in last.stderr and "\ndecoder export: 0 built" in last.stderr
    assert re.search(r"^decoder convert 1/\d vae_full_8x8.rknn \(kept\)", last.stderr, re.MULTILINE), last.stderr[-3000:]
    assert "decoder convert: 0 built" not in last.stderr

    for models in (whole, killed):
        assert not [p for p in models.rglob("*") if ".partial-" in p.name]
    onnx_whole, onnx_killed = whole / "exported" / "64x64", killed / "exported" / "64x64"
    assert (onnx_killed / "manifest.json").read_text() == (onnx_whole / "manifest.json").read_text()  # every ONNX sha256
    rknn_whole, rknn_killed = whole / "rknn" / "64x64", killed / "rknn" / "64x64"
    a, b = Manifest.read(rknn_whole), Manifest.read(rknn_killed)
    assert deterministic(a, rknn_whole) == deterministic(b, rknn_killed)
    assert a.source == b.source and a.tools == b.tools
    decoder_whole = whole / "vae" / "npu" / "rknn" / "64x64"
    c, d = VaeGraphs.read(decoder_whole), VaeGraphs.read(decoder_killed)
    assert [(g.file, g.inputs, g.extra["onnx_sha256"]) for g in c.graphs] == [(g.file, g.inputs, g.extra["onnx_sha256"]) for g in d.graphs]
    assert c.layouts == d.layouts and all(check["sim_psnr"] >= MIN_SIM_PSNR for check in d.checks.values())
