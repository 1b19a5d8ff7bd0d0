"""The mechanism, without real weights: on the synthetic outlier model (the tiny model with 20-50x FFN input
channels and weight columns, written in the official layout), `anima-ui calibrate` then `anima-ui quantize-ffn`
quantize every FFN and pass both gates, while plain W8A8 fails the per-block gate and the end-to-end one."""

import json
import os
import re
import shutil
import subprocess
import sys
from functools import partial

import numpy as np
import pytest

from anima_ui.errors import UserError
from anima_ui.infotext import format_infotext, parse_infotext
from anima_ui.model.checkpoint import load_dit
from anima_ui.model.forward import dit_forward, prepare_kv, prepare_rope
from anima_ui.model.reference import TorchBranches
from anima_ui.modelfiles import ModelPaths
from anima_ui.pipeline import Pipeline, ResultEvent
from anima_ui.quant import gate
from anima_ui.quant.build import ffn_weights, quantize_model
from anima_ui.quant.capture import read_calibration
from anima_ui.quant.e2e import PROMPTS, end_to_end
from anima_ui.quant.ffn import QuantizedFfn, emulate, emulate_plain
from anima_ui.quant.install import install_quantized_ffns
from anima_ui.request import GenerationRequest
from anima_ui.model.config import BRANCH_KINDS
from anima_ui.runtime import board_latency, open_runtime, tune
from anima_ui.runtime.host_weights import load_host_weights
from anima_ui.runtime.manifest import Manifest
from anima_ui.runtime.quantized_ffn import quantized_blocks
from anima_ui.runtime.variants import Plan
from anima_ui.fixtures.outliers import write_outlier_model
from anima_ui.text.encoder import TextEncoder
from test_generate_cli import run_cli
from anima_ui.vae.decode import decode_latent

# One BLAS/torch thread per process: on a shared 2-core machine their default thread pools mostly wait on each other.
ONE_THREAD = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}


def anima_ui(*args):
    return subprocess.run([sys.executable, "-m", "anima_ui", *args], capture_output=True, text=True, timeout=900, env=ONE_THREAD)


@pytest.fixture(scope="module")
def outlier_model(tmp_path_factory):
    folder, chosen = write_outlier_model(tmp_path_factory.mktemp("quant") / "outliers", seed=0)
    result = anima_ui("calibrate", "--models", str(folder), "--backend", "torch", "--width", "64", "--height", "64", "--tokens", "16")
    assert result.returncode == 0, result.stderr[-3000:]
    return folder, chosen


@pytest.fixture(scope="module")
def quantized(outlier_model):
    folder, _ = outlier_model
    result = anima_ui("quantize-ffn", "--models", str(folder), "--width", "64", "--height", "64", "--backend", "torch", "--prompts", "2")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((folder / "quant" / "64x64" / "report.json").read_text()), result.stdout


def test_calibration_has_outliers_and_both_splits(outlier_model):
    folder, chosen = outlier_model
    meta, blocks = read_calibration(folder / "calibration" / "64x64")
    assert meta["capture_steps"][0] == 0 and meta["capture_steps"][-1] == 19 and len(meta["capture_steps"]) == 8
    assert "" in meta["calib_prompts"] and not set(meta["calib_prompts"]) & set(meta["heldout_prompts"])
    for block, calib in enumerate(blocks):
        # 8 prompts x 8 steps x (cond, uncond) x 16 tokens; 4 held-out prompts
        assert calib.calib_x.shape == (8 * 8 * 2 * 16, 64) and calib.heldout_x.shape == (4 * 8 * 2 * 16, 64)
        outliers = calib.amax_x[chosen[block]["activation"]]
        assert np.median(outliers) > 5 * np.median(calib.amax_x), "the scaled channels must stand out"
        assert np.all(calib.amax_x >= np.abs(calib.calib_x).max(axis=0) * (1 - 1e-3))  # amax covers every token, not only kept ones


def test_low_rank_passes_where_plain_w8a8_fails_per_block(outlier_model, quantized):
    folder, _ = outlier_model
    report, stdout = quantized
    _, blocks = read_calibration(folder / "calibration" / "64x64")
    dit = ModelPaths.find(folder).dit
    assert report["passed"] and report["quantized_blocks"] == [0, 1]
    for entry, calib in zip(report["blocks"], blocks):
        chosen = entry["tries"][-1]
        assert entry["quantized"] and chosen["passed"] and chosen["rank"] == 32
        assert chosen["cosine"] >= gate.MIN_FFN_COSINE and chosen["rel_error"] <= gate.MAX_FFN_REL_ERROR
        assert chosen["residual_error"] <= gate.MAX_RESIDUAL_ERROR
        w1, w2 = ffn_weights(dit, entry["block"])
        reference = gate.onnx_reference(w1, w2, calib.heldout_x)
        plain = gate.measure(emulate_plain(w1, w2, calib.calib_x, calib.heldout_x), reference, calib)
        assert not gate.passes(plain) and plain["rel_error"] > 5 * chosen["rel_error"]
        q = QuantizedFfn.load(folder / "quant" / "64x64" / f"block{entry['block']:02d}_mlp_w8a8.npz")
        # (BLAS thread counts differ between this process and the command's: equal to summation order)
        assert gate.measure(emulate(q, calib.heldout_x / q.smooth_in), reference, calib)["rel_error"] == pytest.approx(chosen["rel_error"], rel=1e-4)
    assert "2 of 2 FFNs quantized; PASSED" in stdout


def test_end_to_end_passes_for_low_rank(quantized):
    report, _ = quantized
    e2e = report["end_to_end"]
    assert e2e["passed"] and not e2e["failures"] and len(e2e["rows"]) == 2 * 2
    t = e2e["thresholds"]
    for row in e2e["rows"]:
        assert row["quant_vs_fp16"]["psnr_db"] >= t["min_psnr_db"] >= 30.0
        assert row["quant_vs_fp16"]["latent_cosine"] >= t["min_latent_cosine"]
        assert row["fp16_vs_fp32"]["psnr_db"] > row["quant_vs_fp16"]["psnr_db"]  # FP16's own noise is smaller still
    # the thresholds are 20 dB / 1 % of the distance between two seeds' images
    assert t["min_psnr_db"] == pytest.approx(max(s["psnr_db"] for s in e2e["seed_spread"]) + 20.0)


def test_plain_w8a8_fails_end_to_end(outlier_model, quantized, one_torch_thread):
    folder, _ = outlier_model
    report, _ = quantized
    paths = ModelPaths.find(folder)
    config, state = load_dit(paths.dit)
    _, blocks = read_calibration(folder / "calibration" / "64x64")
    weights = {b: ffn_weights(paths.dit, b) for b in range(config.num_blocks)}
    plain = {b: partial(emulate_plain, *weights[b], calib.calib_x) for b, calib in enumerate(blocks)}
    decode = lambda latent: np.asarray(decode_latent(latent, paths.vae, prefer="onnx")[0])
    encoder = TextEncoder.load(paths)
    result = end_to_end(state, config, TorchBranches(state, config), lambda prompt: encoder.encode([prompt])[0], decode, weights,
                        (plain, {}), prompts=PROMPTS[:1], width=64, height=64)
    assert not result.passed
    low_rank_psnr = min(r["quant_vs_fp16"]["psnr_db"] for r in report["end_to_end"]["rows"])
    assert max(r["quant_vs_fp16"]["psnr_db"] for r in result.rows) < low_rank_psnr - 10


def test_a_block_that_cannot_pass_stays_fp16(outlier_model, tmp_path, monkeypatch):
    folder, _ = outlier_model
    _, blocks = read_calibration(folder / "calibration" / "64x64")
    monkeypatch.setattr(gate, "MAX_FFN_REL_ERROR", 1e-4)
    report = quantize_model(ModelPaths.find(folder).dit, blocks[:1], (1, 16, 64), tmp_path / "q", end_to_end=lambda e: pytest.fail("no e2e without a quantized block"))
    entry = report["blocks"][0]
    assert not entry["quantized"] and not report["passed"] and report["quantized_blocks"] == []
    # rank 32 with the searched α, then higher α, then rank 64 likewise
    assert [t["rank"] for t in entry["tries"]][0] == 32 and entry["tries"][-1]["rank"] == 64
    assert entry["tries"][1]["alpha1"] >= entry["tries"][0]["alpha1"] and entry["tries"][1]["alpha2"] >= entry["tries"][0]["alpha2"]
    assert not any(t["passed"] for t in entry["tries"])
    assert sorted(p.name for p in (tmp_path / "q").iterdir()) == ["report.json"]


def test_commands_say_what_to_run_first(tmp_path, outlier_model):
    folder, _ = outlier_model
    result = anima_ui("quantize-ffn", "--models", str(folder), "--width", "128", "--height", "128", "--backend", "torch")
    assert result.returncode == 2 and "run `anima-ui calibrate` first" in result.stderr
    result = anima_ui("calibrate", "--models", str(folder), "--backend", "onnx", "--width", "128", "--height", "128")
    assert result.returncode == 2 and "run `anima-ui export`" in result.stderr


def test_capture_through_onnx_graphs_matches_torch(tmp_path):
    """The graph backends capture the same activations without the fp32 DiT in memory."""
    from anima_ui.fixtures.model import write_random_model

    folder = write_random_model(tmp_path / "tiny", "tiny", 1)
    assert anima_ui("export", "--models", str(folder), "--width", "64", "--height", "64",
                    "--out", str(folder / "exported" / "64x64")).returncode == 0
    (tmp_path / "calib.txt").write_text("a red bicycle\n")
    (tmp_path / "heldout.txt").write_text("a blue boat\n")
    outputs = {}
    for backend in ("onnx", "torch"):
        outputs[backend] = tmp_path / backend
        result = anima_ui("calibrate", "--models", str(folder), "--backend", backend, "--width", "64", "--height", "64",
                          "--calib-prompts", str(tmp_path / "calib.txt"), "--heldout-prompts", str(tmp_path / "heldout.txt"),
                          "--capture-steps", "0", "19", "--out", str(outputs[backend]))
        assert result.returncode == 0, result.stderr[-3000:]
    (_, from_onnx), (_, from_torch) = read_calibration(outputs["onnx"]), read_calibration(outputs["torch"])
    for a, b in zip(from_onnx, from_torch):
        assert a.calib_x.shape == b.calib_x.shape == (2 * 2 * 16, 64)
        for name in ("calib_x", "heldout_x", "amax_x", "amax_hidden", "heldout_gate", "heldout_residual_norm"):
            assert np.allclose(getattr(a, name), getattr(b, name), rtol=2e-3, atol=2e-3), name


def test_installed_quantized_ffns_run_through_the_fold_and_are_recorded(quantized, outlier_model, tmp_path):
    """install_quantized_ffns into an exported folder (the .onnx twins of the quantized graphs: the same smoothing
    and low-rank split in float, so only the wiring can make them differ from the FP16 FFNs), then the runtime runs
    them with λ1 folded into the modulation (runtime.forward on one chain and on two: each chain's dit_forward folds),
    and the pipeline's summary and PNG parameters say so."""
    report, _ = quantized
    models = tmp_path / "models"
    shutil.copytree(outlier_model[0], models)  # installing rewrites the graphs' manifest: not the shared fixture's
    assert anima_ui("export", "--models", str(models), "--width", "64", "--height", "64").returncode == 0
    exported = models / "exported" / "64x64"
    manifest = install_quantized_ffns(exported, models / "quant" / "64x64")
    assert quantized_blocks(manifest) == report["quantized_blocks"] == [0, 1]
    assert quantized_blocks(Manifest.read(exported)) == [0, 1] and Manifest.read(exported).graph(0, "mlp").file == "block00_mlp.onnx"

    config, weights = load_host_weights(ModelPaths.find(models).dit)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, config.latent_channels, 8, 8)).astype(np.float32)
    kv = prepare_kv(weights, rng.standard_normal((2, config.context_len, config.context_dim)).astype(np.float32))
    rope = prepare_rope(config, 8, 8)
    sigma = np.full(2, 0.6, np.float32)
    forward = lambda runtime, scales: dit_forward(weights, runtime, x, sigma, kv, rope, ffn_input_scales=scales)
    with open_runtime("onnx", exported, ffn="fp16") as runtime:
        assert runtime.ffn == "fp16" and runtime.ffn_input_scales == {}
        fp = forward(runtime, None)
    with open_runtime("onnx", exported) as runtime:  # "auto": the quantized graphs, since the folder has them
        assert runtime.ffn == "w8a8-lowrank (blocks 0,1)" and sorted(runtime.ffn_input_scales) == [0, 1]
        folded = forward(runtime, runtime.ffn_input_scales)
        unfolded = forward(runtime, None)
    assert gate.cosine(folded, fp) > 0.99999 and gate.rel_error(folded, fp) < 1e-4
    assert gate.rel_error(unfolded, fp) > 100 * gate.rel_error(folded, fp)  # without the fold the graphs get the wrong input
    for plan in (Plan.uniform("serial"), Plan.uniform("two-chains"),
                 Plan({"self_attn": "prefetch", "cross_attn": "two-chains", "mlp": "prefetch"}),
                 Plan({"self_attn": "prefetch", "cross_attn": "prefetch", "mlp": "two-chains"})):
        with open_runtime("onnx", exported, plan) as runtime:
            assert runtime.ffn == "w8a8-lowrank (blocks 0,1)"
            assert gate.rel_error(runtime.forward(weights, x, sigma, kv, rope), folded) < 1e-5, plan.variants

    request = GenerationRequest(prompt="a red fox", width=64, height=64, steps=2, seed=3, decode=False)
    pipeline = Pipeline.load(models, backend="onnx")  # auto, no tune profile: nothing has timed them, FP16 runs
    assert generated_summary(pipeline, request)["ffn"] == "fp16"
    assert "`anima-ui tune` has not timed them" in pipeline.choice.summary()
    summary = generated_summary(Pipeline.load(models, backend="onnx", ffn="w8a8-lowrank"), request)
    assert summary["ffn"] == "w8a8-lowrank (blocks 0,1)"
    assert parse_infotext(format_infotext(request, summary))[2]["FFN"] == "w8a8-lowrank (blocks 0,1)"


def generated_summary(pipeline, request):
    return [e for e in pipeline.generate(request) if isinstance(e, ResultEvent)][0].summary


@pytest.fixture
def installed(quantized, outlier_model, tmp_path):
    """A copy of the outlier model whose exported 64x64 graphs have the quantized FFNs installed."""
    models = tmp_path / "models"
    shutil.copytree(outlier_model[0], models)
    assert anima_ui("export", "--models", str(models), "--width", "64", "--height", "64").returncode == 0
    install_quantized_ffns(models / "exported" / "64x64", models / "quant" / "64x64")
    return models


def tune_sim(models, *extra) -> dict:
    """`anima-ui tune --backend sim` on two blocks, the batch-1 variants; the profile it wrote."""
    argv = ["tune", "--models", str(models), "--width", "64", "--height", "64", "--backend", "sim", "--time-scale", "0.05",
            "--rounds", "2", "--blocks", "2", "--variants", "serial,prefetch,two-chains", "--no-decoders", *extra]
    assert run_cli(argv) == 0
    return json.loads((models / "exported" / "64x64" / "tune.json").read_text())


def test_tune_takes_quantized_ffns_only_when_faster_and_generate_follows(installed, monkeypatch):
    """The simulated board times a quantized FFN at FP16's / QUANTIZED_FFN_SPEEDUP: made 4x faster, tune chooses them
    (and a batch-1 variant for the FFN) and generate runs them; made 4x slower, tune keeps FP16 and so does generate."""
    request = GenerationRequest(prompt="a red fox", width=64, height=64, steps=2, seed=3, decode=False)
    monkeypatch.setattr(board_latency, "QUANTIZED_FFN_SPEEDUP", 4.0)
    data = tune_sim(installed)
    ffn = data["ffn"]
    assert ffn["chosen"] == "w8a8-lowrank" and ffn["blocks"] == [0, 1]
    assert ffn["measured"]["w8a8-lowrank"]["median_seconds"] < ffn["measured"]["fp16"]["median_seconds"]
    assert data["choice"]["mlp"] == ffn["measured"]["w8a8-lowrank"]["variant"] in ("prefetch", "two-chains")
    pipeline = Pipeline.load(installed, backend="sim", time_scale=0.001)
    assert generated_summary(pipeline, request)["ffn"] == "w8a8-lowrank (blocks 0,1)"
    assert "quantized FFNs (the tune profile's)" in pipeline.choice.summary()

    monkeypatch.setattr(board_latency, "QUANTIZED_FFN_SPEEDUP", 0.25)
    data = tune_sim(installed)
    assert data["ffn"]["chosen"] == "fp16" and "dropped" not in data["ffn"]["measured"]["w8a8-lowrank"]
    assert data["ffn"]["measured"]["w8a8-lowrank"]["median_seconds"] > data["ffn"]["measured"]["fp16"]["median_seconds"]
    pipeline = Pipeline.load(installed, backend="sim", time_scale=0.001)
    assert generated_summary(pipeline, request)["ffn"] == "fp16"
    assert "the tune profile found the installed quantized ones slower than FP16" in pipeline.choice.summary()
    # asked for by flag, they run whatever the profile says
    assert generated_summary(Pipeline.load(installed, backend="sim", time_scale=0.001, ffn="w8a8-lowrank"), request)["ffn"] != "fp16"


def test_tune_drops_quantized_ffns_that_disagree_or_fail_the_board_check(installed, monkeypatch):
    monkeypatch.setattr(board_latency, "QUANTIZED_FFN_SPEEDUP", 4.0)
    scale = installed / "exported" / "64x64" / "block01_mlp_w8a8.smooth_in.npy"
    np.save(scale, np.load(scale)[::-1].copy())  # λ1 of the wrong channels: the graph gets the wrong input
    data = tune_sim(installed)
    assert data["ffn"]["chosen"] == "fp16"
    assert data["ffn"]["measured"]["w8a8-lowrank"]["dropped"].startswith("block 1's quantized FFN is far from the FP16 one")

    rows = [{"block": 0, "cosine": 0.42, "rel_error": 0.9, "nonfinite": 0, "passed": False}]
    monkeypatch.setattr(tune, "board_check", lambda *args: rows)  # what a board computing block 0 wrongly reports
    sets = {1: installed / "exported" / "64x64"}
    reference, outcomes = tune.measure(lambda: "onnx", sets, ["prefetch"], blocks=2, rounds=1)
    ffn = tune.measure_quantized_ffn(lambda: "onnx", sets, dict.fromkeys(BRANCH_KINDS, "prefetch"), outcomes, 2, 1,
                                     reference, board_backend=object())
    assert ffn.chosen == "fp16" and ffn.board_check == rows and ffn.seconds == []
    assert ffn.dropped.startswith("block 0's quantized FFN on the NPU differs from the simulator: cosine 0.420000")


def test_a_batch2_ffn_variant_with_quantized_ffns_names_the_variant(installed):
    exported = installed / "exported"
    assert anima_ui("export", "--models", str(installed), "--width", "64", "--height", "64", "--batch", "2").returncode == 0
    graphs = {1: exported / "64x64", 2: exported / "64x64-b2"}
    plan = Plan({"self_attn": "prefetch", "cross_attn": "prefetch", "mlp": "batch2"})
    with pytest.raises(UserError, match="the FFN's variant batch2 runs batch-2 graphs, and the quantized FFNs are installed for batch-1"):
        open_runtime("onnx", graphs, plan, ffn="w8a8-lowrank")
    with open_runtime("onnx", graphs, plan) as runtime:  # auto: FP16 FFNs there
        assert runtime.ffn == "fp16"


def test_install_refuses_what_did_not_pass_or_another_checkpoint(quantized, outlier_model, tmp_path):
    models = tmp_path / "models"
    shutil.copytree(outlier_model[0], models)
    assert anima_ui("export", "--models", str(models), "--width", "64", "--height", "64").returncode == 0
    exported, quant = models / "exported" / "64x64", models / "quant" / "64x64"
    before = (exported / "manifest.json").read_bytes()
    report = json.loads((quant / "report.json").read_text())
    for change, message in ((dict(passed=False), "did not pass its gates"), (dict(checkpoint_sha256="0" * 64), "another checkpoint"),
                            (dict(shape=[1, 64, 64]), re.escape("was made for FFN inputs [1, 64, 64]"))):
        (quant / "report.json").write_text(json.dumps({**report, **change}))
        with pytest.raises(UserError, match=message):
            install_quantized_ffns(exported, quant)
    (quant / "report.json").unlink()
    with pytest.raises(UserError, match="run `anima-ui calibrate` and `anima-ui quantize-ffn --convert`"):
        install_quantized_ffns(exported, quant)
    assert (exported / "manifest.json").read_bytes() == before
    with open_runtime("onnx", exported) as runtime:
        assert runtime.ffn == "fp16"
    with pytest.raises(UserError, match="has no quantized FFNs"):
        open_runtime("onnx", exported, ffn="w8a8-lowrank")
