"""The RKNN tier for the NPU decoder (`pytest -m rknn`, needs .venv-rknn): convert the tiny VAE's decoder
graphs in every layout, each checked on the toolkit's simulator against onnxruntime fp32 along its
layout's chain, with every op on the NPU; a second run keeps what the first finished."""

import shutil


import numpy as np
import pytest

from anima_ui.convert.convert_rknn import LOG, VENV_PYTHON
from anima_ui.errors import UserError
from anima_ui.vae import graphs as decoder_graphs
from anima_ui.vae.npu_graphs import (CHECK_IMAGES, CHECK_LATENT, LAYOUTS, MIN_SIM_PSNR, VaeGraphs, build_vae_graphs,
                                     convert_vae_graphs)
from vae_helpers import write_vae_file

pytestmark = pytest.mark.rknn
SIZE = 256  # a 32x32 latent: 2x2 halo tiles of 29x29


@pytest.fixture(scope="module")
def vae(tmp_path_factory):
    if not VENV_PYTHON.exists():
        pytest.fail(f"{VENV_PYTHON} is missing: run scripts/make_rknn_venv.sh before `pytest -m rknn`")
    path = tmp_path_factory.mktemp("vae") / "qwen_image_vae.safetensors"
    write_vae_file(path, 16)
    return path


@pytest.fixture(scope="module")
def converted(vae, tmp_path_factory):
    root = tmp_path_factory.mktemp("npu")
    build_vae_graphs(vae, SIZE, SIZE, root / "onnx", grid=(2, 2))
    runs = []
    convert_vae_graphs(root / "onnx", root / "rknn", progress=lambda *a: runs.append(a))
    return root, runs


def test_every_graph_converts_and_passes_the_simulator(converted):
    root, runs = converted
    graphs, source = VaeGraphs.read(root / "rknn"), VaeGraphs.read(root / "onnx")
    assert graphs.format == "rknn" and graphs.tools["rknn-toolkit2"] == "2.5.0"
    assert set(graphs.layouts) == set(LAYOUTS) and len(graphs.graphs) == len(source.graphs) == 4
    for g, onnx_entry in zip(graphs.graphs, source.graphs):
        assert g.file.endswith(".rknn") and (root / "rknn" / g.file).stat().st_size > 0
        assert g.extra["onnx_sha256"] == onnx_entry.sha256 and g.inputs == onnx_entry.inputs
        assert g.extra["sim_psnr"] >= MIN_SIM_PSNR and g.extra["sim_nonfinite"] == 0
        assert g.extra["cpu_ops"] == [] and g.extra["npu_ops"] >= 20  # every op on the NPU (only I/O on the CPU)
    for layout, check in graphs.checks.items():
        assert check["sim_psnr"] >= MIN_SIM_PSNR and check["sim_nonfinite"] == 0, layout
    latent, images = np.load(root / "rknn" / CHECK_LATENT), np.load(root / "rknn" / CHECK_IMAGES)
    assert latent.shape == (1, 16, 32, 32) and set(images.files) == set(LAYOUTS)
    for image in images.values():
        assert image.shape == (1, 3, SIZE, SIZE) and 0 <= image.min() < image.max() <= 1
    assert "exSDPAttention" in (root / "rknn" / LOG).read_text()  # the toolkit's op table, kept
    assert [(file, reused) for _, _, file, _, reused, _ in runs] == [(g.file, False) for g in graphs.graphs]
    assert sorted(p.name for p in root.iterdir()) == ["onnx", "rknn"]
    assert not [p for p in (root / "rknn").iterdir() if ".partial-" in p.name]  # no temporary files


def test_a_second_run_converts_only_what_is_missing(converted, tmp_path):
    root, _ = converted
    again = shutil.copytree(root / "rknn", tmp_path / "rknn")
    (again / "vae_up_29x29.rknn").unlink()
    (again / "manifest.json").unlink()  # as a run killed during that graph leaves the folder
    runs = []
    graphs = convert_vae_graphs(root / "onnx", again, progress=lambda *a: runs.append(a))
    assert [(file, reused) for _, _, file, _, reused, _ in runs] == [
        ("vae_full_32x32.rknn", True), ("vae_trunk_32x32.rknn", True), ("vae_up_29x29.rknn", False), ("vae_up_b4_29x29.rknn", True)]
    assert graphs.entry("vae_up_29x29.rknn").extra["sim_psnr"] >= MIN_SIM_PSNR
    assert VaeGraphs.read(again).checks.keys() == set(LAYOUTS)


def test_a_norm_the_compiler_cannot_fuse_shows_up(vae, tmp_path, monkeypatch):
    """The channel norm's eps as Max instead of Clip: the compiler leaves those ops on the CPU, and the
    conversion records them."""
    def max_norm(g, x, gamma, shape):
        norm = g.op("ReduceL2", x, g.const(np.array([1], np.int64), "channel_axis"), keepdims=1)
        norm = g.op("Max", norm, g.const(np.float32(decoder_graphs.NORM_EPS), "norm_eps"))
        x = g.op("Div", x, g.op("Expand", norm, g.const(np.array(shape, np.int64), "norm_shape")))
        return g.op("Mul", x, g.const((gamma.reshape(1, -1, 1, 1) * np.float32(shape[1] ** 0.5)), "gamma"))

    monkeypatch.setattr(decoder_graphs, "_rms_norm", max_norm)
    monkeypatch.chdir(tmp_path)
    build_vae_graphs(vae, 64, 64, tmp_path / "onnx", layouts=["untiled"])
    graphs = convert_vae_graphs(tmp_path / "onnx", tmp_path / "rknn")
    assert "Max" in graphs.graphs[0].extra["cpu_ops"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["onnx", "rknn"]  # the toolkit's check*.onnx stay in the worker's folder


def test_a_failed_simulator_check_writes_nothing(vae, tmp_path, monkeypatch):
    from anima_ui.vae import npu_graphs

    build_vae_graphs(vae, 64, 64, tmp_path / "onnx", layouts=["untiled"])
    monkeypatch.setattr(npu_graphs, "MIN_SIM_PSNR", 200.0)
    with pytest.raises(UserError, match=r"vae_full_8x8.onnx failed the simulator check .* see .*rknn/convert\.log"):
        convert_vae_graphs(tmp_path / "onnx", tmp_path / "rknn")
    assert sorted(p.name for p in (tmp_path / "rknn").iterdir()) == [".lock", "convert.log"]  # no graph, record or manifest
