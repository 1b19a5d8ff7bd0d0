"""After the download, the app prepares the model for its backend: ONNX export, or `anima-ui prepare` (export and
RKNN conversion) where the conversion environment is present (else it says how to make it)."""

import json
import shutil

import pytest

from anima_ui import download
from anima_ui.convert import convert_rknn
from anima_ui.vae.npu_graphs import LAYOUTS, MIN_SIM_PSNR, VaeGraphs


@pytest.fixture()
def tiny(tiny_model, tmp_path):
    return shutil.copytree(tiny_model, tmp_path / "tiny")


def test_torch_needs_no_preparation(tiny):
    assert list(download.prepare(tiny, "torch")) == []
    assert not (tiny / "exported").exists()


def test_onnx_exports_the_graphs_once(tiny):
    lines = list(download.prepare(tiny, "onnx", 64, 64))
    manifest = json.loads((tiny / "exported" / "64x64" / "manifest.json").read_text())
    assert len(manifest["graphs"]) == 3 * 2  # tiny: 2 blocks x (self_attn, cross_attn, mlp)
    assert lines[0] == "anima-ui export: starting" and lines[-1] == "anima-ui export: done"
    assert list(download.prepare(tiny, "sim", 64, 64)) == []  # already there: nothing to do


def test_rknn_without_the_toolkit_says_where_to_convert(tiny, monkeypatch, tmp_path):
    monkeypatch.setattr(convert_rknn, "VENV_PYTHON", tmp_path / "no-venv" / "bin" / "python")
    (line,) = download.prepare(tiny, "rknn", 64, 64)
    assert "scripts/make_rknn_venv.sh" in line and f"anima-ui prepare --models {tiny}" in line
    assert not (tiny / "exported").exists() and not (tiny / "rknn").exists()


@pytest.mark.rknn
def test_rknn_with_the_toolkit_exports_and_converts(tiny):
    lines = list(download.prepare(tiny, "rknn", 64, 64))
    assert lines[0] == "anima-ui prepare: starting" and lines[-1] == "anima-ui prepare: done"
    assert any("convert 6/6" in line for line in lines)
    assert (tiny / "rknn" / "64x64" / "manifest.json").is_file()
    # the NPU decoder's graphs too, every layout checked on the simulator
    decoder = VaeGraphs.read(tiny / "vae" / "npu" / "rknn" / "64x64")
    assert decoder.format == "rknn" and set(decoder.layouts) == set(LAYOUTS)
    assert all(g.extra["sim_psnr"] >= MIN_SIM_PSNR and not g.extra["cpu_ops"] for g in decoder.graphs)
    assert any(line.startswith("anima-ui prepare: decoder convert: ") and "simulator against fp32: untiled" in line for line in lines)
