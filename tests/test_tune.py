"""`anima-ui tune` on the tiny model with the simulated board: it writes a profile, drops a variant that fails and one
that disagrees with serial (saying why), and `generate` then runs with the profile (or ignores it when told)."""

import json
import shutil

import numpy as np
import pytest

from anima_ui.convert.export import export_graphs
from anima_ui.model.config import BRANCH_KINDS
from anima_ui.modelfiles import ModelPaths
from anima_ui.runtime import tune
from anima_ui.runtime.profile import PROFILE, find_profiles, read_profile
from anima_ui.runtime.sim import SimulatedBoard
from anima_ui.runtime.variants import VARIANTS
from recording_backend import RecordingBackend
from test_generate_cli import run_cli


@pytest.fixture(scope="module")
def tuned(tiny_model, tmp_path_factory):
    """A tiny model folder after `anima-ui tune --backend sim` (which exports its graphs on first use)."""
    models = shutil.copytree(tiny_model, tmp_path_factory.mktemp("tune") / "tiny")
    code = run_cli(["tune", "--models", str(models), "--width", "64", "--height", "64", "--backend", "sim",
                    "--time-scale", "0.002", "--rounds", "2"])
    assert code == 0
    return models


def test_tune_writes_a_profile_with_every_kind_and_variant(tuned):
    graphs = tuned / "exported" / "64x64"
    data = json.loads((graphs / PROFILE).read_text())
    assert data["backend"] == "sim" and (data["width"], data["height"]) == (64, 64)
    assert set(data["choice"]) == set(BRANCH_KINDS) and set(data["choice"].values()) <= set(VARIANTS)
    for kind in BRANCH_KINDS:
        assert set(data["measured"][kind]) == set(VARIANTS)
        assert all(m["median_seconds"] > 0 for m in data["measured"][kind].values())  # all agree on the sim
        assert data["choice"][kind] == min(data["measured"][kind], key=lambda n: data["measured"][kind][n]["median_seconds"])
    assert "dropped" not in data["chosen_mix"]
    assert "exported at batch 2" in data["batch2_sample"]  # the sample's batch-2 graphs were built, then deleted
    assert not list(graphs.parent.glob(".tune-batch2-*"))
    assert data["versions"]["onnxruntime"] and data["versions"]["graphs"]["opset"] == 19
    assert data["created"][:2] == "20"
    decoders = data["decoder"]["measured"]
    assert "width 16" in decoders["sdcpp"]["dropped"]  # sd.cpp takes only the release VAE width, not the tiny one
    assert decoders["onnx"]["seconds"] > 0 and data["decoder"]["chosen"] == "onnx"
    # the NPU decoder on the sim: the board's estimate, shown but not compared with this PC's real timings
    assert decoders["npu"]["board_seconds"] > 0 and "seconds" not in decoders["npu"]
    assert decoders["npu"]["psnr_vs_onnx"] == "identical"  # the same fp32 graphs: strict JSON has no Infinity
    assert read_profile(graphs).backend == "sim"
    found = find_profiles(tuned, "sim")  # what serve prints at start
    assert [p.path for p in found] == [graphs / PROFILE] and found[0].summary().startswith("64x64: ")
    assert "decoder onnx" in found[0].summary() and find_profiles(tuned, "onnx") == []


def test_a_variant_that_fails_and_one_that_disagrees_are_dropped_with_reasons(tuned):
    def fail(entry, core_mask):
        return RuntimeError("init_runtime returned -1") if core_mask == "0_1" else None

    def disagree(entry, core_mask, out):  # batch-2 graphs a little off: in direction on core 0, in scale on 0_1_2
        if entry.inputs[0].shape[0] != 2:
            return out
        return out + 0.01 * np.roll(out, 1, axis=-1) if core_mask == "0" else out * 1.01

    make_backend = lambda: RecordingBackend(SimulatedBoard(time_scale=0.002), fail=fail, alter=disagree)
    graphs = {1: tuned / "exported" / "64x64", 2: tuned / "exported" / "64x64-b2"}
    paths = ModelPaths.find(tuned)
    export_graphs(paths, 64, 64, graphs[2], batch=2)
    reference, outcomes = tune.measure(make_backend, graphs, list(VARIANTS), blocks=2, rounds=2)
    assert outcomes["batch2-0_1"].dropped == "failed: RuntimeError: init_runtime returned -1"
    assert outcomes["batch2"].dropped.startswith("disagrees with serial: cosine 0.99")
    assert outcomes["batch2-0_1_2"].dropped.startswith("disagrees with serial: norm 1.01000 x serial's")
    kept = {name for name, o in outcomes.items() if o.dropped is None}
    assert kept == {"serial", "prefetch", "two-chains", "batch1-0_1_2"}
    assert set(tune.choose(outcomes).values()) <= kept
    assert all(np.isfinite(out).all() for out in reference.values())


def generate(models, tmp_path, *extra):
    return run_cli(["generate", "--models", str(models), "--prompt", "a lighthouse", "--steps", "2", "--width", "64",
                    "--height", "64", "--backend", "sim", "--time-scale", "0.001", "--out", str(tmp_path / "out.png"), *extra])


def last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


def test_generate_uses_the_profile_and_says_so(tuned, tmp_path, capsys):
    profile = read_profile(tuned / "exported" / "64x64")
    plan, notes = profile.plan({1, 2})
    assert generate(tuned, tmp_path) == 0
    out, err = capsys.readouterr()
    said = f"runtime: {plan.describe()} (from the tune profile {profile.path}, {profile.created})"
    assert said in err
    summary = last_json(out)
    assert summary["runtime"].startswith(said)
    assert summary["decoder"] == profile.decoder == "onnx"  # the profile's decoder, with no --decoder given
    if 2 in plan.graph_batches():  # a batch-2 choice: generate exported the whole batch-2 set first
        assert (tuned / "exported" / "64x64-b2" / "manifest.json").is_file()

    assert generate(tuned, tmp_path, "--no-tune-profile") == 0
    out, err = capsys.readouterr()
    assert "runtime: prefetch (K=2) (the default" in err and "tune profile" not in last_json(out)["runtime"]

    assert generate(tuned, tmp_path, "--variant", "serial") == 0
    out, err = capsys.readouterr()
    assert "runtime: serial (chosen by flags); the tune profile" in err and "is not used" in err


def test_a_damaged_profile_names_the_way_out(tuned, tmp_path, capsys):
    graphs = tuned / "exported" / "64x64"
    saved = (graphs / PROFILE).read_text()
    try:
        (graphs / PROFILE).write_text('{"format": 1, "choice": {"mlp": "warp-drive"}}')
        assert generate(tuned, tmp_path) == 2
        assert "is damaged" in capsys.readouterr().err
        assert generate(tuned, tmp_path, "--no-tune-profile") == 0
    finally:
        (graphs / PROFILE).write_text(saved)


def test_a_profile_of_another_backend_is_not_used(tuned, tmp_path, capsys):
    assert generate(tuned, tmp_path, "--backend", "onnx") == 0
    err = capsys.readouterr().err
    assert "was measured on the sim backend, not used" in err and "runtime: prefetch (K=2) (the default" in err


def test_on_onnx_variants_that_differ_only_by_cores_are_not_measured_twice():
    from anima_ui.commands.tune import onnx_twins

    assert onnx_twins(list(VARIANTS)) == {"batch2-0_1": "batch2", "batch2-0_1_2": "batch2", "batch1-0_1_2": "prefetch"}
    assert onnx_twins(["batch2-0_1_2", "two-chains"]) == {}


def test_the_status_panel_shows_the_profile_then_the_runtime_it_chose(tuned):
    from anima_ui.pipeline import Pipeline
    from anima_ui.request import GenerationRequest
    from anima_ui.ui.system import runtime_lines

    profile = find_profiles(tuned, "sim")[0]
    assert runtime_lines(None, "sim", tuned) == [f"**Tune profile** {profile.summary()}"]  # before any generation
    assert runtime_lines(None, "onnx", tuned)[0].startswith("**Tune profile** none: `anima-ui tune`")
    assert runtime_lines(None, "torch", tuned) == []
    pipeline = Pipeline.load(tuned, backend="sim", time_scale=0.001)
    request = GenerationRequest(prompt="a lighthouse", steps=1, width=64, height=64, decode=False)
    list(pipeline.generate(request))
    [line] = runtime_lines(pipeline, "sim", tuned)
    assert line.startswith("**Runtime** ") and f"from the tune profile {profile.path}" in line
