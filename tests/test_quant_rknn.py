"""The rknn tier for the W8A8 + low-rank FFNs (`pytest -m rknn`, needs .venv-rknn): the tiny synthetic outlier
model's quantized FFNs built with hybrid quantization, their op tables, and the emulator against the toolkit's
simulator; the toolkit's own W8A8 and FP16 builds against the emulator's models of them."""

import argparse
import io
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from anima_ui import checkup
from anima_ui.commands import verify as verify_command
from anima_ui.convert.convert_rknn import VENV_PYTHON
from anima_ui.convert.prepare import prepare
from anima_ui.modelfiles import ModelPaths
from anima_ui.quant.build import MAX_EMULATOR_GAP, check_conversion, ffn_weights, graph_inputs, quantize_model
from anima_ui.quant.capture import read_calibration
from anima_ui.quant.convert import convert_ffn
from anima_ui.quant.ffn import QuantizedFfn, emulate, emulate_plain, quantize_ffn
from anima_ui.quant.gate import onnx_reference, rel_error
from anima_ui.model.onnx_graph import write_model
from anima_ui.quant.graph import float_ffn_model, quantized_ffn_model
from anima_ui.quant.numerics import ffn_fp16, ffn_fp32
from anima_ui.fixtures.outliers import write_outlier_model
from anima_ui.runtime.backends import Backend
from anima_ui.runtime.board import Lite2
from anima_ui.runtime.manifest import Manifest
from anima_ui.runtime.quantized_ffn import KEY, board_check, folder_lines, quantized_blocks

pytestmark = pytest.mark.rknn
SHAPE = (1, 16, 64)  # 64x64 images: 16 tokens of the 64-wide tiny model


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    if not VENV_PYTHON.exists():
        pytest.fail(f"{VENV_PYTHON} is missing: run scripts/make_rknn_venv.sh before `pytest -m rknn`")
    folder, _ = write_outlier_model(tmp_path_factory.mktemp("quant-rknn") / "outliers", seed=0)
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "anima_ui", "calibrate", "--models", str(folder), "--backend", "torch",
                             "--width", "64", "--height", "64", "--tokens", "16"], capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return folder, read_calibration(folder / "calibration" / "64x64")[1]


def test_quantized_ffns_convert_with_int8_residuals_and_match_the_emulator(calibrated, tmp_path):
    folder, blocks = calibrated
    report = quantize_model(ModelPaths.find(folder).dit, blocks, SHAPE, tmp_path / "q", convert=True)
    assert report["quantized_blocks"] == [0, 1]
    for entry in report["blocks"]:
        conversion = entry["conversion"]
        assert conversion["problems"] == [] and conversion["toolkit"] == "2.5.0"
        # the emulator reproduces the simulator: bit for bit but where an FP16 GELU input sits on a rounding edge
        # (one ulp there moves the int8 code of a few hidden values: measured 0 to 1.5 % of the quantization error)
        assert max(conversion["emulator_vs_simulator"]) < MAX_EMULATOR_GAP * min(conversion["simulator_error"])
        assert max(conversion["simulator_error"]) < 0.02
        stem = tmp_path / "q" / f"block{entry['block']:02d}_mlp_w8a8"
        assert stem.with_suffix(".rknn").stat().st_size > 0
        saved = np.load(stem.with_suffix(".check.npz"))
        q = QuantizedFfn.load(stem.with_suffix(".npz"))
        assert saved["inputs"].shape == saved["outputs"].shape == (2, *SHAPE)
        emulated = emulate(q, saved["inputs"][0])
        assert rel_error(emulated, saved["outputs"][0]) == conversion["emulator_vs_simulator"][0]
        # (rounding-edge codes vary with the calibration run: measured 98.5 % to 100 % of outputs bit-identical)
        assert np.mean(emulated == saved["outputs"][0]) > 0.97


def test_residual_gemms_split_along_k_convert_as_int8_pieces_and_match_the_emulator(calibrated, tmp_path):
    """What the full-size layer 2 (K = 8192, three pieces) needs, at the tiny width: K = 256 in pieces of at most 96
    (layer 2: 96 + 96 + 64) and 32 (layer 1: two of 32, layer 2: eight), each piece its own INT8 Conv, untiled."""
    folder, blocks = calibrated
    w1, w2 = ffn_weights(ModelPaths.find(folder).dit, 0)
    for max_k, pieces in ((96, (1, 3)), (32, (2, 8))):
        q = quantize_ffn(w1, w2, blocks[0].calib_x, 16, blocks[0].amax_x, blocks[0].amax_hidden, max_k=max_k)
        assert (len(q.pieces1), len(q.pieces2)) == pieces
        write_model(quantized_ffn_model(q, SHAPE), tmp_path / f"split{max_k}.onnx")
        checks = graph_inputs(blocks[0].heldout_x, q, SHAPE, 2)
        conversion = convert_ffn(tmp_path / f"split{max_k}.onnx", tmp_path / f"split{max_k}.rknn", "hybrid",
                                 graph_inputs(blocks[0].calib_x, q, SHAPE, 4), checks, q=q)
        assert set(conversion.info["ranges_applied"].values()) == set(q.ranges)  # every piece's range reached the toolkit
        residual = [op for op in conversion.ops if op.name.startswith("Conv:res")]
        assert len(residual) == sum(pieces) and {op.dtype for op in residual} == {"INT8"}
        result = check_conversion(q, conversion, checks, lambda x: onnx_reference(w1, w2, x))
        assert result["problems"] == []
        assert max(result["emulator_vs_simulator"]) < MAX_EMULATOR_GAP * min(result["simulator_error"])
        assert np.mean(emulate(q, checks[0]) == conversion.sim_outputs[0]) > 0.97


def test_the_toolkits_own_w8a8_and_fp16_builds_match_their_emulations(calibrated, tmp_path):
    """The plain W8A8 row of the error table and the FP16 baseline are emulated too: check both models."""
    folder, blocks = calibrated
    w1, w2 = ffn_weights(ModelPaths.find(folder).dit, 0)
    write_model(float_ffn_model(w1, w2, SHAPE), tmp_path / "ffn.onnx")
    identity = type("Identity", (), {"smooth_in": np.float32(1.0)})  # graph_inputs without smoothing
    dataset = graph_inputs(blocks[0].calib_x, identity, SHAPE, 16)
    checks = graph_inputs(blocks[0].heldout_x, identity, SHAPE, 2)
    calib_tokens = np.concatenate(dataset).reshape(-1, SHAPE[-1])
    int8 = convert_ffn(tmp_path / "ffn.onnx", tmp_path / "int8.rknn", "int8", dataset, checks)
    fp16 = convert_ffn(tmp_path / "ffn.onnx", tmp_path / "fp16.rknn", "fp16", dataset, checks)
    assert {op.dtype for op in int8.ops if op.type.startswith("Conv")} == {"INT8"}
    assert {op.dtype for op in fp16.ops if op.type.startswith("Conv")} == {"FLOAT16"}
    for x, sim_int8, sim_fp16 in zip(checks, int8.sim_outputs, fp16.sim_outputs):
        reference = ffn_fp32(x, w1, w2)
        emulated = emulate_plain(w1, w2, calib_tokens, x)
        assert rel_error(sim_int8, reference) > 0.05  # plain W8A8 is far off on outliers
        assert rel_error(emulated, sim_int8) < 1e-3 * rel_error(sim_int8, reference)  # (measured: identical)
        assert rel_error(sim_fp16, reference) < 1e-3
        assert rel_error(ffn_fp16(x, w1, w2), sim_fp16) < 0.1 * rel_error(sim_fp16, reference)
    assert fp16.cycles > int8.cycles


class EmulatedNpu(Backend):
    """Runs a quantized FFN graph with the emulator (shown above to reproduce the simulator); `wrong` runs the other
    block's FFN instead, as a board computing a graph wrongly would."""

    graph_format = "rknn"

    def __init__(self, quant_dir, wrong: bool = False):
        self.quant_dir, self.wrong = quant_dir, wrong

    def load(self, path, entry):
        block = int(entry.file[len("block"):len("block") + 2])
        return QuantizedFfn.load(self.quant_dir / f"block{1 - block if self.wrong else block:02d}_mlp_w8a8.npz")

    def init(self, loaded, entry, core_mask):
        return loaded

    def run(self, context, entry, arrays):
        return emulate(context, arrays[0])

    def release(self, context, entry):
        pass


def test_prepare_with_quantized_ffns_installs_them_and_doctor_and_verify_check_them(calibrated, tmp_path, monkeypatch, capsys):
    models = tmp_path / "models"
    shutil.copytree(calibrated[0], models)
    out = io.StringIO()
    prepare(models, 64, 64, mirror=models.resolve().as_uri(), ffn="w8a8-lowrank", out=out)
    assert "quantized FFNs: W8A8 + low-rank in 2 of 2 blocks (0, 1)" in out.getvalue()
    folder, quant = models / "rknn" / "64x64", models / "quant" / "64x64"
    manifest = Manifest.read(folder)
    assert quantized_blocks(manifest) == [0, 1]
    for block in (0, 1):
        entry = manifest.graph(block, "mlp")
        assert entry.file == f"block{block:02d}_mlp.rknn"  # the FP16 graph stays listed
        installed = entry.extra[KEY]
        assert installed["file"] == f"block{block:02d}_mlp_w8a8.rknn" and (folder / installed["check"]).is_file()
        assert np.array_equal(np.load(folder / installed["smooth_in"]), QuantizedFfn.load(quant / f"block{block:02d}_mlp_w8a8.npz").smooth_in)
    assert folder_lines(models) == ["**FFNs** rknn/64x64: W8A8 + low-rank in blocks 0,1"]

    rows = board_check(folder, manifest, EmulatedNpu(quant))
    assert [r["block"] for r in rows] == [0, 1] and all(r["passed"] for r in rows) and max(r["rel_error"] for r in rows) < 1e-3
    assert not any(r["passed"] for r in board_check(folder, manifest, EmulatedNpu(quant, wrong=True)))

    # this machine has no rknn-toolkit-lite2: doctor lists the blocks and says what the check needs
    row = next(r for r in checkup.collect(models).rows if r.check == "quantized FFNs rknn/64x64")
    assert row.status == "skip" and "blocks [0, 1]" in row.value and "rknn-toolkit-lite2" in row.value
    # on a board: doctor's row and verify's rows, with an NPU that computes what the simulator did, then the wrong block
    lite2 = Lite2("2.5.0", None)
    [ok] = checkup._quantized_rows([folder], lambda: EmulatedNpu(quant), "auto", lite2)
    assert ok.status == "ok" and ok.value.startswith("blocks [0, 1]; NPU vs simulator on saved inputs: worst cosine ")
    [bad] = checkup._quantized_rows([folder], lambda: EmulatedNpu(quant, wrong=True), "auto", lite2)
    assert bad.status == "fail" and "blocks [0, 1] below 0.9999" in bad.value and "prepare without --ffn" in bad.fix
    args = argparse.Namespace(backend="rknn", core_mask="auto")
    for wrong in (False, True):
        monkeypatch.setattr(verify_command, "make_backend", lambda name: EmulatedNpu(quant, wrong=wrong))
        rows = verify_command.quantized_check(args, folder, manifest)
        assert [r["passed"] for r in rows] == [not wrong] * 2
        printed = capsys.readouterr().out.splitlines()
        assert printed[0].startswith("quantized FFNs on this NPU vs the toolkit's simulator")
        assert [line.split()[-1] for line in printed[1:]] == ["FAILED" if wrong else "ok"] * 2
    # prepare without --ffn: the FP16 FFNs again
    prepare(models, 64, 64, mirror=models.resolve().as_uri(), out=io.StringIO())
    assert quantized_blocks(Manifest.read(folder)) == []
