"""`anima-ui bench runtime --board` prints a line per step as it goes and the blog's phase table per branch kind; here
it runs with the simulated board on the tiny model (on an RK3588 the same code runs the rknn backend)."""

import argparse
import shutil

import pytest

from anima_ui.bench import runtime as bench
from anima_ui.convert.export import export_graphs
from anima_ui.modelfiles import ModelPaths


@pytest.fixture(scope="module")
def tiny(tiny_model, tmp_path_factory):
    models = shutil.copytree(tiny_model, tmp_path_factory.mktemp("bench") / "tiny")
    paths = ModelPaths.find(models)
    for batch in (1, 2):
        manifest = export_graphs(paths, 64, 64, paths.exported_dir(64, 64, batch), batch=batch)
    return models, len(manifest.graphs) // 3


def board(models, *flags):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--board", "--backend", "sim", "--models", str(models), "--width", "64", "--height", "64",
                              "--time-scale", "0.01", *flags])
    return bench.run(args)


@pytest.mark.parametrize("flags, variant", [
    ([], "prefetch (K=2)"),
    (["--no-prefetch"], "serial"),
    (["--variant", "two-chains", "--wait-for-inference"], "two-chains (K=2, init/release wait for inference)"),
    (["--variant", "mlp=batch2-0_1_2", "--core-mask", "1", "--steps", "2"], "self_attn prefetch, cross_attn prefetch, mlp batch2-0_1_2"),
])
def test_board_table_reports_each_step_and_every_branch_kind(tiny, capsys, flags, variant):
    models, blocks = tiny
    assert board(models, *flags) == 0
    out = capsys.readouterr().out
    steps = 2 if "--steps" in flags else 3  # 3 by default with --board
    assert f"{steps} CFG steps, {variant}" in out.splitlines()[0]
    step_lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in step_lines] == [f"step {i}/{steps}" for i in range(1, steps + 1)]
    assert all("NPU" in line and "MemAvailable" in line for line in step_lines)
    for kind in ("self_attn", "cross_attn", "mlp"):
        rows = [line.split() for line in out.splitlines() if line.startswith(kind + " ")]
        assert len(rows) == 1
        models_opened = int(rows[0][1])
        chains = 2 if "two-chains" in variant else 1
        if "--no-prefetch" in flags:
            assert models_opened == steps * blocks  # each model opened once per step
        else:
            assert models_opened >= chains * steps * blocks  # plus what was prefetched for the next step
        load, init, inference, release, visit = map(float, rows[0][2:7])
        assert load > 0 and init > 0 and inference > 0 and release >= 0 and visit > 0
    assert "peak process PSS" in out and "swapped in during the run" in out


def test_board_table_refuses_a_core_mask_rknn_lite_does_not_have(tiny):
    with pytest.raises(SystemExit):
        board(tiny[0], "--core-mask", "0_2")


@pytest.mark.slow
def test_sim_table_prints_every_variant_under_each_contention_assumption(capsys):
    """(a) at a small time scale (minutes: 28-block graphs, every variant): the table's rows and columns, not its numbers."""
    from anima_ui.runtime import VARIANTS
    from anima_ui.runtime.board_latency import CONTENTION

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert bench.run(parser.parse_args(["--parts", "sim", "--time-scale", "0.02", "--steps", "2"])) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("variant"))
    assert all(f"s/step {c}" in header and f"image {c}" in header for c in CONTENTION)
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split() and line.split()[0] in VARIANTS}
    assert set(rows) == set(VARIANTS)
    assert all(float(rows[name][1]) > 0 for name in VARIANTS)
    assert "blog (serial)" in out and "120.4" in out and "1512" in out
    assert sum(line.startswith("per-kind best") for line in out.splitlines()) == len(CONTENTION)
    assert sum(line.startswith("+ W8A8 FFNs") for line in out.splitlines()) == len(CONTENTION)
