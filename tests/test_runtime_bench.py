"""`anima-ui bench runtime --board` prints the blog's phase table; here it runs with the simulated
board on the tiny model (on an RK3588 the same code runs the rknn backend)."""

import argparse
import shutil

from anima_ui.bench import runtime as bench
from anima_ui.convert.export import export_graphs
from anima_ui.modelfiles import ModelPaths


def test_board_table_reports_every_branch_kind(tiny_model, tmp_path, capsys):
    models = shutil.copytree(tiny_model, tmp_path / "tiny")
    paths = ModelPaths.find(models)
    blocks = len(export_graphs(paths, 64, 64, paths.exported_dir(64, 64)).graphs) // 3
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--board", "--backend", "sim", "--models", str(models), "--width", "64", "--height", "64",
                              "--steps", "2", "--time-scale", "0.01"])
    assert bench.run(args) == 0
    out = capsys.readouterr().out
    assert "serial:" in out and "prefetch K=2:" in out
    for kind in ("self_attn", "cross_attn", "mlp"):
        rows = [line.split() for line in out.splitlines() if line.startswith(kind)]
        assert len(rows) == 2  # serial and prefetch
        serial, prefetch = rows
        assert int(serial[1]) == 2 * blocks  # each model opened once per step, 2 steps
        assert int(prefetch[1]) >= 2 * blocks  # plus what was prefetched for a third step
        for row in rows:
            load, init, inference, release = map(float, row[2:6])
            assert load > 0 and init > 0 and inference > 0 and release >= 0
    assert "peak process PSS" in out and "swap growth" in out
