"""Cond and uncond as two chains (two threads, each with its own runners, contexts and host ops, meeting at the CFG
combine) give the serial latent; so do the other variants and a mix of them per branch kind."""

import shutil

import numpy as np
import pytest

from anima_ui.convert.export import export_graphs
from anima_ui.model.checkpoint import load_dit
from anima_ui.model.config import BRANCH_KINDS
from anima_ui.model.forward import prepare_kv, prepare_rope
from anima_ui.modelfiles import ModelPaths
from anima_ui.pipeline import Pipeline, ResultEvent
from anima_ui.request import GenerationRequest
from anima_ui.runtime import VARIANTS, Plan, open_runtime
from anima_ui.runtime.sim import SimulatedBoard
from recording_backend import RecordingBackend

MIXED = {"self_attn": "two-chains", "cross_attn": "prefetch", "mlp": "batch2-0_1_2"}


@pytest.fixture(scope="module")
def tiny(tiny_model, tmp_path_factory):
    return shutil.copytree(tiny_model, tmp_path_factory.mktemp("chains") / "tiny")


@pytest.fixture(scope="module")
def pipelines(tiny):
    return {backend: Pipeline.load(tiny, backend=backend, time_scale=0.001, use_profile=False) for backend in ("sim", "onnx")}


def latent(pipeline, variants, spectrum):
    request = GenerationRequest(prompt="a lighthouse at dusk", negative="fog", seed=3, steps=8 if spectrum else 3,
                                width=64, height=64, spectrum=spectrum, decode=False)
    pipeline.runtime_options["variants"] = variants  # the --variant flag, without loading the model again
    result = [event for event in pipeline.generate(request) if isinstance(event, ResultEvent)][0]
    assert pipeline.runtime.open_contexts == 0
    return result.latent, result.summary


def relative_l2(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("backend", ["sim", "onnx"])
@pytest.mark.parametrize("spectrum", [False, True])
def test_two_chains_give_the_serial_latent(pipelines, backend, spectrum):
    serial, _ = latent(pipelines[backend], dict.fromkeys(BRANCH_KINDS, "serial"), spectrum)
    chains, summary = latent(pipelines[backend], dict.fromkeys(BRANCH_KINDS, "two-chains"), spectrum)
    assert summary["runtime"].startswith("runtime: two-chains (K=2) (chosen by flags)")
    assert relative_l2(chains, serial) < 1e-5
    mixed, _ = latent(pipelines[backend], MIXED, spectrum)  # chains meeting at a shared batch-2 graph for the FFN
    assert relative_l2(mixed, serial) < 1e-5
    assert np.abs(serial).max() > 0.1  # a real latent, not zeros


def test_every_variant_gives_the_serial_forward(tiny):
    paths = ModelPaths.find(tiny)
    cfg, weights = load_dit(paths.dit)
    graphs = [paths.exported_dir(64, 64, b) for b in (1, 2)]
    for batch, folder in zip((1, 2), graphs):
        export_graphs(paths, 64, 64, folder, batch=batch)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 16, 8, 8)).astype(np.float32)
    context = rng.standard_normal((2, cfg.context_len, cfg.context_dim)).astype(np.float32)
    kv, rope = prepare_kv(weights, context), prepare_rope(cfg, 8, 8)
    results = {}
    for name in VARIANTS:
        backend = RecordingBackend(SimulatedBoard(time_scale=0.001))
        with open_runtime(backend, graphs, Plan.uniform(name)) as runtime:
            results[name] = runtime.forward(weights, x, np.full(2, 0.6, np.float32), kv, rope)
            per_kind = runtime.timings["per_kind"]
        assert all(per_kind[kind]["visits"] == cfg.num_blocks for kind in BRANCH_KINDS)
        expected_masks = set(VARIANTS[name].core_masks) or {"auto"}
        assert {mask for mask, n in backend.inits.items() if n} == expected_masks
        assert backend.total_open() == 0
    for name, out in results.items():
        assert relative_l2(out, results["serial"]) < 1e-5, name


def test_wait_for_inference_keeps_init_and_release_off_a_running_npu(tiny):
    """The first-run safety option: with two chains prefetching, no init or release overlaps any inference."""
    paths = ModelPaths.find(tiny)
    cfg, weights = load_dit(paths.dit)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 16, 8, 8)).astype(np.float32)
    kv = prepare_kv(weights, rng.standard_normal((2, cfg.context_len, cfg.context_dim)).astype(np.float32))
    backend = RecordingBackend(SimulatedBoard(time_scale=0.002))
    plan = Plan.uniform("two-chains", wait_for_inference=True)
    with open_runtime(backend, paths.exported_dir(64, 64), plan) as runtime:
        for _ in range(2):
            runtime.forward(weights, x, np.full(2, 0.6, np.float32), kv, prepare_rope(cfg, 8, 8))
    runs = [(start, end) for phase, _, start, end in backend.intervals if phase == "run"]
    lifecycle = [(start, end) for phase, _, start, end in backend.intervals if phase in ("init", "release")]
    assert len(runs) == 4 * 3 * cfg.num_blocks and lifecycle
    assert not [(a, b) for a in lifecycle for b in runs if a[0] < b[1] and b[0] < a[1]]
    assert backend.inits["0"] and backend.inits["1"]  # both chains opened their own contexts
