"""The NPU decoder's graphs on the tiny model through onnxruntime: the halo tile plan, the exact tiling
(bit-identical to the untiled up path), the layouts' folder, the lifecycle through the runtime backends
(onnx, the simulated board, RKNN-Lite's call contract), cancel, the board gate, and `generate --decoder npu`."""

import dataclasses
import json
import re
import shutil
import threading

import numpy as np
import onnxruntime
import pytest
from PIL import Image

from anima_ui.cli import main
from anima_ui.commands.tune import time_decoders
from anima_ui.errors import Cancelled, UserError
from anima_ui.metrics import psnr
from anima_ui.runtime import board_latency
from anima_ui.runtime.backends import OnnxBackend
from anima_ui.runtime.sim import SimulatedBoard
from anima_ui.runtime.manifest import GraphEntry, TensorSpec
from anima_ui.vae.graphs import build_decoder_graph
from anima_ui.vae.npu_decoder import check_npu_decoder, decode_npu, graphs_folder, pick_layout
from anima_ui.vae.npu_graphs import CHECK_IMAGES, CHECK_LATENT, LAYOUTS, VaeGraphs, build_vae_graphs, convert_layouts
from anima_ui.vae.onnx_decoder import OnnxDecoder, ort_session
from anima_ui.vae.tiling import HALO, assemble, cut_windows, halo_plan
from anima_ui.vae.weights import load_decoder_weights
from vae_helpers import random_latent, small_vae_file

SIZE = 256  # px: a 32x32 latent, the smallest a 2x2 grid with a 13-px halo really tiles (windows 29x29)


@pytest.fixture(scope="module")
def small_vae(tmp_path_factory):
    return small_vae_file(tmp_path_factory)[0]


@pytest.fixture(scope="module")
def folder(small_vae, tmp_path_factory):
    out = tmp_path_factory.mktemp("npu") / "onnx"
    build_vae_graphs(small_vae, SIZE, SIZE, out, grid=(2, 2))
    return out


@pytest.fixture(scope="module")
def latent():
    return random_latent(SIZE // 8, SIZE // 8)


# ---------------------------------------------------------------- the tile plan

@pytest.mark.parametrize("h, w, grid", [(64, 64, (2, 2)), (64, 96, (1, 3)), (40, 40, (3, 3)), (32, 32, (2, 2)),
                                        (16, 16, (2, 2)), (64, 64, (1, 1)), (128, 80, (4, 2))])
def test_halo_plan_covers_the_image_once_with_real_neighbours(h, w, grid):
    plan = halo_plan(h, w, grid)
    wh, ww = plan.window
    covered = np.zeros((h, w), int)
    for t in plan.tiles:
        y0, y1, x0, x1 = t.keep
        assert 0 <= t.y and t.y + wh <= h and 0 <= t.x and t.x + ww <= w  # every window inside the latent
        assert (t.y == 0 or y0 >= t.y + HALO) and (t.y + wh == h or y1 <= t.y + wh - HALO)
        assert (t.x == 0 or x0 >= t.x + HALO) and (t.x + ww == w or x1 <= t.x + ww - HALO)
        covered[y0:y1, x0:x1] += 1
    assert (covered == 1).all()


def test_halo_plan_sizes():
    assert halo_plan(64, 64, (2, 2)).window == (45, 45)  # 512 px: 2x2 tiles of 45x45 latent px
    assert halo_plan(64, 64, (1, 3)).window == (64, 39)
    assert len(halo_plan(16, 16, (2, 2)).tiles) == 1  # too small to tile: one window, the whole latent
    with pytest.raises(UserError, match="at least one tile"):
        halo_plan(64, 64, (0, 2))


# ---------------------------------------------------------------- exactness on onnxruntime

def _tiled_up_path(weights, base_dim, features, plan):
    up = ort_session(build_decoder_graph(weights, base_dim, *plan.window, part="up"), threads=1)
    windows = cut_windows(features, plan)
    return assemble(np.concatenate([up.run(None, {"features": w[None]})[0] for w in windows]), plan)


def test_halo_tiles_are_bit_identical_to_the_untiled_up_path(small_vae, latent):
    base_dim, weights = load_decoder_weights(small_vae)
    h, w = latent.shape[2:]
    features = ort_session(build_decoder_graph(weights, base_dim, h, w, part="trunk"), threads=1).run(None, {"latent": latent})[0]
    untiled = ort_session(build_decoder_graph(weights, base_dim, h, w, part="up"), threads=1).run(None, {"features": features})[0]
    for grid in [(2, 2), (1, 3)]:
        plan = halo_plan(h, w, grid)
        assert len(plan.tiles) == grid[0] * grid[1]
        np.testing.assert_array_equal(_tiled_up_path(weights, base_dim, features, plan), untiled)
    # one latent pixel less of halo is not exact: the up path's reach is 12.25 latent px
    short = _tiled_up_path(weights, base_dim, features, halo_plan(h, w, (2, 2), HALO - 1))
    assert (short != untiled).any() and psnr(short, untiled) > 100.0


# ---------------------------------------------------------------- the folder and the layouts

def test_folder_lists_every_layout_and_graph(folder):
    graphs = VaeGraphs.read(folder)
    assert graphs.format == "onnx" and (graphs.width, graphs.height) == (SIZE, SIZE)
    assert graphs.layouts == {"untiled": ["vae_full_32x32.onnx"],
                              "halo": ["vae_trunk_32x32.onnx", "vae_up_29x29.onnx"],
                              "halo-batch": ["vae_trunk_32x32.onnx", "vae_up_b4_29x29.onnx"]}
    assert [g.kind for g in graphs.graphs] == ["vae_full", "vae_trunk", "vae_up", "vae_up"]
    flops = {g.file: g.extra["gflop"] for g in graphs.graphs}
    assert flops["vae_up_b4_29x29.onnx"] == pytest.approx(4 * flops["vae_up_29x29.onnx"], rel=1e-3)
    for g in graphs.graphs:
        session = onnxruntime.InferenceSession(str(folder / g.file), providers=["CPUExecutionProvider"])
        assert [(i.name, tuple(i.shape)) for i in session.get_inputs()] == [(s.name, s.shape) for s in g.inputs]
        assert [(o.name, tuple(o.shape)) for o in session.get_outputs()] == [(s.name, s.shape) for s in g.outputs]
    assert not [p for p in folder.iterdir() if ".partial-" in p.name]  # no temporary files left


def test_a_second_build_keeps_every_finished_graph_and_redoes_a_damaged_one(folder, small_vae, tmp_path):
    again = tmp_path / "onnx"
    shutil.copytree(folder, again)
    runs = []
    first = build_vae_graphs(small_vae, SIZE, SIZE, again, grid=(2, 2), progress=lambda *a: runs.append(a))
    assert [reused for *_, reused in runs] == [True] * 4 and first == VaeGraphs.read(folder)
    (again / "vae_up_29x29.onnx").write_bytes(b"cut short")
    (again / "manifest.json").unlink()  # as a killed run leaves it
    runs.clear()
    second = build_vae_graphs(small_vae, SIZE, SIZE, again, grid=(2, 2), progress=lambda *a: runs.append(a))
    assert [(file, reused) for _, _, file, _, reused in runs] == [
        ("vae_full_32x32.onnx", True), ("vae_trunk_32x32.onnx", True), ("vae_up_29x29.onnx", False), ("vae_up_b4_29x29.onnx", True)]
    assert second == first and (again / "vae_up_29x29.onnx").read_bytes() == (folder / "vae_up_29x29.onnx").read_bytes()


def test_every_layout_decodes_the_untiled_image(folder, small_vae, latent):
    images = {layout: decode_npu(latent, folder, OnnxBackend(threads=1), layout)[0] for layout in LAYOUTS}
    np.testing.assert_array_equal(images["halo"], images["halo-batch"])
    expected = OnnxDecoder(small_vae, threads=1).decode(latent)
    for image in images.values():
        assert image.shape == (SIZE, SIZE, 3) and image.dtype == np.uint8
        assert np.abs(image.astype(int) - expected).max() <= 1  # float rounding across graph boundaries only


def test_bad_requests_are_user_errors(folder, small_vae, tmp_path):
    with pytest.raises(UserError, match="are for 256x256"):
        decode_npu(random_latent(8, 8), folder, "onnx")
    with pytest.raises(UserError, match="no 'tiles' NPU decoder layout"):
        decode_npu(random_latent(32, 32), folder, "onnx", layout="tiles")
    with pytest.raises(UserError, match="multiples of 16"):
        build_vae_graphs(small_vae, 100, 64, tmp_path / "x")
    with pytest.raises(UserError, match="unknown NPU decoder layout"):
        build_vae_graphs(small_vae, 64, 64, tmp_path / "x", layouts=["fast"])
    with pytest.raises(UserError, match="no NPU decoder graphs"):
        decode_npu(random_latent(8, 8), tmp_path, "onnx")
    with pytest.raises(UserError, match="holds onnx decoder graphs but the rknn backend"):
        decode_npu(random_latent(32, 32), folder, _FakeRknnBackend())


class _FakeRknnBackend(OnnxBackend):
    name, graph_format = "rknn", "rknn"


# ---------------------------------------------------------------- lifecycle, cancel, errors

class RecordingBackend(OnnxBackend):
    """onnxruntime, recording each phase; `fail_on` makes that run call raise."""

    def __init__(self, cancel_after_runs=None, cancel=None, fail_on=None):
        super().__init__(threads=1)
        self.calls, self.runs, self.open_count = [], 0, 0
        self.cancel_after_runs, self.cancel, self.fail_on = cancel_after_runs, cancel, fail_on

    def load(self, path, entry):
        self.calls.append(("load", entry.file))
        return super().load(path, entry)

    def init(self, loaded, entry, core_mask):
        self.calls.append(("init", entry.file))
        self.open_count += 1
        return super().init(loaded, entry, core_mask)

    def run(self, context, entry, arrays):
        self.calls.append(("run", entry.file, arrays[0].shape))
        self.runs += 1
        if self.fail_on == self.runs:
            raise RuntimeError("the NPU said no")
        if self.runs == self.cancel_after_runs:
            self.cancel.set()
        return super().run(context, entry, arrays)

    def release(self, context, entry):
        self.calls.append(("release", entry.file))
        self.open_count -= 1
        super().release(context, entry)


def test_one_context_at_a_time_and_one_run_per_tile(folder, latent):
    backend = RecordingBackend()
    decode_npu(latent, folder, backend, "halo")
    window = (1, 64, 29, 29)
    assert backend.calls == [("load", "vae_trunk_32x32.onnx"), ("init", "vae_trunk_32x32.onnx"),
                             ("run", "vae_trunk_32x32.onnx", (1, 16, 32, 32)), ("release", "vae_trunk_32x32.onnx"),
                             ("load", "vae_up_29x29.onnx"), ("init", "vae_up_29x29.onnx"),
                             *[("run", "vae_up_29x29.onnx", window)] * 4, ("release", "vae_up_29x29.onnx")]
    assert backend.open_count == 0
    backend = RecordingBackend()
    decode_npu(latent, folder, backend, "halo-batch")
    assert [c for c in backend.calls if c[0] == "run"][1] == ("run", "vae_up_b4_29x29.onnx", (4, 64, 29, 29))


@pytest.mark.parametrize("runs", [1, 3])  # after the trunk; between two tiles
def test_cancel_between_graphs_and_tiles_releases_the_context(folder, latent, runs):
    cancel = threading.Event()
    backend = RecordingBackend(cancel_after_runs=runs, cancel=cancel)
    with pytest.raises(Cancelled):
        decode_npu(latent, folder, backend, "halo", cancel=cancel)
    assert backend.runs == runs and backend.open_count == 0
    assert backend.calls[-1][0] == "release"
    cancel = threading.Event()
    cancel.set()
    backend = RecordingBackend()
    with pytest.raises(Cancelled):
        decode_npu(latent, folder, backend, "untiled", cancel=cancel)
    assert backend.calls == []  # cancelled before the decode: nothing loaded


def test_a_failing_run_releases_the_context(folder, latent):
    backend = RecordingBackend(fail_on=2)
    with pytest.raises(RuntimeError, match="the NPU said no"):
        decode_npu(latent, folder, backend, "halo")
    assert backend.open_count == 0 and backend.calls[-1] == ("release", "vae_up_29x29.onnx")


def test_simulated_board_decodes_the_same_image_on_the_latency_model(folder, latent):
    reference, _ = decode_npu(latent, folder, OnnxBackend(threads=1), "halo-batch")
    image, seconds = decode_npu(latent, folder, SimulatedBoard(time_scale=0.001, threads=1), "halo-batch")
    np.testing.assert_array_equal(image, reference)
    graphs = VaeGraphs.read(folder)
    trunk, up = (graphs.entry(f) for f in graphs.layouts["halo-batch"])
    board = [board_latency.graph_phase_seconds(e)["inference"] for e in (trunk, up)]
    assert seconds["inference"] >= 0.001 * sum(board)  # each call lasts at least its scaled board time


def test_decode_latency_model():
    """GFLOP at 0.23 TFLOPS per core; a batch of tiles over 3 cores at 2.5x, in rounds of 3."""
    def entry(gflop, batch):
        out = (TensorSpec("image", (batch, 3, 8, 8), "float32"),)
        return GraphEntry("g.rknn", 0, "vae_up", (), out, "", {"gflop": gflop})

    assert board_latency.graph_phase_seconds(entry(1100.3, 1))["inference"] == pytest.approx(4.784, abs=1e-3)
    one_tile = board_latency.graph_phase_seconds(entry(500.0, 1))["inference"]
    assert board_latency.graph_phase_seconds(entry(1500.0, 3))["inference"] == pytest.approx(one_tile * 3 / 2.5)
    assert board_latency.graph_phase_seconds(entry(2000.0, 4))["inference"] == pytest.approx(2 * one_tile * 3 / 2.5)
    dit_ffn = GraphEntry("f.rknn", 0, "mlp", (), (TensorSpec("out", (2, 4, 8), "float32"),), "")
    assert board_latency.graph_phase_seconds(dit_ffn)["inference"] == pytest.approx(
        board_latency.BATCH2_WORK * board_latency.phase_seconds("mlp")["inference"])


# ---------------------------------------------------------------- RKNN-Lite's call contract

def _as_rknn_folder(folder, out):
    """The ONNX folder relabelled as converted graphs (the fake runtime runs ONNX), with a check latent."""
    graphs = VaeGraphs.read(folder)
    out.mkdir()
    for g in graphs.graphs:
        (out / g.file.replace(".onnx", ".rknn")).write_bytes((folder / g.file).read_bytes())
    graphs.format = "rknn"
    graphs.graphs = [GraphEntry(g.file.replace(".onnx", ".rknn"), g.block, g.kind, g.inputs, g.outputs, g.sha256, g.extra)
                     for g in graphs.graphs]
    graphs.layouts = {k: [f.replace(".onnx", ".rknn") for f in v] for k, v in graphs.layouts.items()}
    graphs.write(out)
    return out


def test_rknn_lite_backend_feeds_nchw_and_releases(rknnlite_standin, folder, latent, tmp_path):
    """The stand-in, like the runtime, takes a 4-D input as NHWC unless told: the decode only comes out right
    with data_format nchw."""
    rknn = _as_rknn_folder(folder, tmp_path / "rknn")
    image, _ = decode_npu(latent, rknn, "rknn", "halo", core_mask="0_1_2")
    reference, _ = decode_npu(latent, folder, OnnxBackend(threads=1), "halo")
    assert np.abs(image.astype(int) - reference).max() <= 1  # the stand-in rounds each output through FP16
    calls = [c[:2] if c[0] == "inference" else c for c in rknnlite_standin.CALLS if c[0] != "RKNNLite"]
    trunk, tile = ((1, 16, 32, 32),), ((1, 64, 29, 29),)
    assert calls == [("load_rknn", "vae_trunk_32x32.rknn"), ("init_runtime", None, 7), ("inference", trunk), ("release",),
                     ("load_rknn", "vae_up_29x29.rknn"), ("init_runtime", None, 7), *[("inference", tile)] * 4,
                     ("release",)]
    assert not rknnlite_standin.OPEN


def test_bench_board_table_times_every_layout_on_rknn_lite(rknnlite_standin, folder, small_vae, tmp_path, capsys):
    rknn = _as_rknn_folder(folder, tmp_path / "rknn")
    _store_check(rknn, small_vae)
    assert main(["bench", "vae", "--board", str(rknn), "--decoders", "--repeats", "1", "--core-mask", "0"]) == 0
    out = capsys.readouterr().out
    assert "core mask 0" in out
    for layout in LAYOUTS:
        assert re.search(rf"^{layout} +[0-9.]+ .* ok$", out, re.MULTILINE), out


# ---------------------------------------------------------------- the board's gate

def _store_check(folder, vae):
    """What conversion stores for the board's gate: a latent and the fp32 image of it per layout (the same image:
    the halo plan is exact)."""
    latent = random_latent(32, 32, seed=5)
    np.save(folder / CHECK_LATENT, latent)
    reference = OnnxDecoder(vae, threads=1).decode_float(latent).transpose(2, 0, 1)[None]
    np.savez(folder / CHECK_IMAGES, **dict.fromkeys(LAYOUTS, reference))
    return reference


def test_gate_passes_the_stored_reference_and_fails_a_wrong_one(folder, small_vae, tmp_path):
    gated = tmp_path / "gated"
    shutil.copytree(folder, gated)
    with pytest.raises(UserError, match="no stored check latent and images; .*anima-ui prepare"):
        check_npu_decoder(gated, OnnxBackend(threads=1))
    reference = _store_check(gated, small_vae)
    results = check_npu_decoder(gated, OnnxBackend(threads=1))
    assert set(results) == set(LAYOUTS)
    for r in results.values():
        assert r["ok"] and r["psnr"] >= 100.0 and r["nonfinite"] == 0
    np.savez(gated / CHECK_IMAGES, **{**dict.fromkeys(LAYOUTS, reference), "untiled": np.clip(reference + 0.01, 0, 1)})  # 40 dB
    results = check_npu_decoder(gated, OnnxBackend(threads=1))
    assert not results["untiled"]["ok"] and 39 < results["untiled"]["psnr"] < 41 and results["halo"]["ok"]


def test_gate_without_stored_images_decodes_with_the_fp32_decoder_of_the_vae(folder, small_vae):
    results = check_npu_decoder(folder, SimulatedBoard(time_scale=0.0, threads=1), vae_path=small_vae)
    assert set(results) == set(LAYOUTS) and all(r["ok"] and r["psnr"] >= 100.0 for r in results.values())


# ---------------------------------------------------------------- verify --decoder npu

def test_verify_decoder_npu_passes_then_fails_on_wrong_numbers(tiny_model, tmp_path, capsys):
    tiny = shutil.copytree(tiny_model, tmp_path / "tiny")
    argv = ["verify", "--models", str(tiny), "--backend", "sim", "--time-scale", "0", "--decoder", "npu",
            "--width", "64", "--height", "64"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["passed"] and set(result["layouts"]) == set(LAYOUTS)
    assert all(r["psnr"] >= 100 and r["nonfinite"] == 0 for r in result["layouts"].values())
    # the graphs were built on first use; a broken graph must fail the gate
    folder = graphs_folder(tiny / "vae" / "qwen_image_vae.safetensors", "onnx", 64, 64)
    _break_bias(folder / "vae_full_8x8.onnx")
    assert main(argv) == 1
    captured = capsys.readouterr()
    result = json.loads(captured.out.strip().splitlines()[-1])
    assert not result["passed"] and not result["layouts"]["untiled"]["ok"] and result["layouts"]["halo"]["ok"]
    assert "the NPU decoder failed the gate (untiled: needs >= 50 dB" in captured.err and "--decoder sdcpp" in captured.err


def _break_bias(path):
    """Shift the head conv's bias: the image moves by 0.05, about 26 dB off."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    bias = next(t for t in model.graph.initializer if t.name.startswith("decoder.head.2.bias"))
    bias.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(bias) + np.float32(0.05), bias.name))
    onnx.save(model, str(path))


def test_verify_decoder_npu_on_rknn_without_converted_graphs_names_prepare(rknnlite_standin, tiny_model, capsys):
    assert main(["verify", "--models", str(tiny_model), "--backend", "rknn", "--decoder", "npu", "--width", "64",
                 "--height", "64"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no converted NPU decoder graphs for 64x64" in err[0]
    assert f"anima-ui prepare --models {tiny_model} --width 64 --height 64" in err[0]


# ---------------------------------------------------------------- generate --decoder npu

def test_generate_with_the_npu_decoder_on_the_simulated_board(tiny_model, tmp_path, capsys):
    tiny = tmp_path / "tiny"
    shutil.copytree(tiny_model, tiny)  # the export and the decoder graphs are written into the model folder
    argv = ["generate", "--models", str(tiny), "--prompt", "a lighthouse", "--seed", "2", "--steps", "2",
            "--width", "64", "--height", "96", "--backend", "sim", "--time-scale", "0.001", "--decoder", "npu",
            "--out", str(tmp_path / "out.png"), "--save-latent", str(tmp_path / "z.npy")]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["decoder"] == "npu" and summary["backend"] == "sim" and summary["warning"] is None
    assert summary["decoder_layout"] == "untiled"
    image = Image.open(tmp_path / "out.png")
    assert "VAE decoder: npu (untiled)," in image.text["parameters"]
    vae = tiny / "vae" / "qwen_image_vae.safetensors"
    assert VaeGraphs.read(graphs_folder(vae, "onnx", 64, 96)).width == 64  # built on first use, next to the VAE
    expected = OnnxDecoder(vae, threads=1).decode(np.load(tmp_path / "z.npy"))
    assert np.abs(np.asarray(image).astype(int) - expected).max() <= 1


def test_generate_runs_the_only_layout_the_folder_has(tiny_model, tmp_path, capsys):
    """A folder prepared on an 8 GB board holds only the halo layout: the NPU decoder runs that one and says so."""
    tiny = tmp_path / "tiny"
    shutil.copytree(tiny_model, tiny)
    vae = tiny / "vae" / "qwen_image_vae.safetensors"
    build_vae_graphs(vae, 64, 96, graphs_folder(vae, "onnx", 64, 96), layouts=["halo"])
    argv = ["generate", "--models", str(tiny), "--prompt", "a lighthouse", "--seed", "2", "--steps", "2",
            "--width", "64", "--height", "96", "--backend", "sim", "--time-scale", "0.001", "--decoder", "npu",
            "--out", str(tmp_path / "out.png"), "--save-latent", str(tmp_path / "z.npy")]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["decoder"] == "npu" and summary["decoder_layout"] == "halo" and summary["warning"] is None
    image = Image.open(tmp_path / "out.png")
    assert "VAE decoder: npu (halo)," in image.text["parameters"]
    assert list(VaeGraphs.read(graphs_folder(vae, "onnx", 64, 96)).layouts) == ["halo"]  # not rebuilt with the others
    expected = OnnxDecoder(vae, threads=1).decode(np.load(tmp_path / "z.npy"))
    assert np.abs(np.asarray(image).astype(int) - expected).max() <= 1


def test_the_decoder_picks_the_default_layout_else_by_preference(folder):
    graphs = VaeGraphs.read(folder)
    with_layouts = lambda *names: dataclasses.replace(graphs, layouts={n: graphs.layouts[n] for n in names})
    assert pick_layout(with_layouts("halo", "halo-batch", "untiled")) == "untiled"
    assert pick_layout(with_layouts("halo", "halo-batch")) == "halo-batch"
    assert pick_layout(with_layouts("halo")) == "halo"


# ---------------------------------------------------------------- which layouts prepare converts

GIB = 2**30


def test_prepare_converts_the_layouts_that_fit_in_memory():
    # an 8 GB board (7.75 GiB MemTotal) with the OS beside it: 7.1 GiB available, 5.6 GiB after the floor
    layouts, line = convert_layouts(512, 512, int(7.1 * GIB))
    assert layouts == ["halo"]
    assert line.startswith("decoder: skipping the untiled (~6.0 GiB), halo-batch (~10.5 GiB) layouts:")
    assert "5.6 GiB available" in line and "--decoder-layouts" in line and "on a PC" in line
    assert convert_layouts(512, 512, 14 * GIB) == (list(LAYOUTS), None)  # a 16 GB PC keeps every layout
    assert convert_layouts(256, 256, int(7.1 * GIB)) == (list(LAYOUTS), None)  # a quarter of the pixels: 2.6 GiB at most
    assert convert_layouts(1024, 1024, int(7.1 * GIB))[0] == []  # halo alone would need ~19 GiB


def test_decoder_layouts_flag_overrides_the_memory_check():
    assert convert_layouts(512, 512, 2 * GIB, ["halo-batch", "untiled"]) == (["halo-batch", "untiled"], None)
    with pytest.raises(UserError, match="unknown NPU decoder layout"):
        convert_layouts(512, 512, 2 * GIB, ["tiles"])


# ---------------------------------------------------------------- anima-ui tune's decoder timing

def test_tune_times_the_npu_decoder_only_when_its_graphs_pass_the_gate(rknnlite_standin, folder, small_vae, tmp_path):
    vae = shutil.copy(small_vae, tmp_path / small_vae.name)
    graphs_folder(vae, "rknn", SIZE, SIZE).parent.mkdir(parents=True)
    rknn = _as_rknn_folder(folder, graphs_folder(vae, "rknn", SIZE, SIZE))
    reference = _store_check(rknn, vae)
    npu = {"backend": "rknn", "time_scale": 1.0, "core_mask": "auto"}
    passed = time_decoders(vae, SIZE, SIZE, lambda line: None, npu)["measured"]
    assert "width 16" in passed["sdcpp"]["dropped"]  # sd.cpp takes only the release VAE width
    assert passed["onnx"]["seconds"] > 0
    assert passed["npu"]["seconds"] > 0 and passed["npu"]["psnr_vs_onnx"] >= 40  # FP16-rounded by the stand-in
    np.savez(rknn / CHECK_IMAGES, **dict.fromkeys(LAYOUTS, np.clip(reference + 0.01, 0, 1)))  # 40 dB off: the gate wants 50
    failed = time_decoders(vae, SIZE, SIZE, lambda line: None, npu)
    assert failed["measured"]["npu"]["dropped"].startswith("RuntimeError: failed its gate: untiled layout 4")
    assert failed["chosen"] == "onnx"
