"""`anima-ui export`: 3 graphs per block with the manifest the runtime reads, written atomically."""

import json
import shutil
import subprocess
import sys

import onnx
import pytest

from anima_ui.convert import export as export_module
from anima_ui.convert.export import export_graphs
from anima_ui.errors import UserError
from anima_ui.model.checkpoint import load_dit
from anima_ui.modelfiles import ModelPaths
from anima_ui.runtime.manifest import Manifest, sha256_file


@pytest.fixture(scope="module")
def tiny_models(tiny_model, tmp_path_factory):
    return shutil.copytree(tiny_model, tmp_path_factory.mktemp("export") / "tiny")  # the export writes into it


def test_export_command_writes_graphs_and_manifest(tiny_models):
    result = subprocess.run(
        [sys.executable, "-m", "anima_ui", "export", "--models", str(tiny_models), "--width", "96", "--height", "64", "--batch", "2"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    paths = ModelPaths.find(tiny_models)
    folder = paths.exported_dir(96, 64)
    manifest = Manifest.read(folder)
    cfg, _ = load_dit(paths.dit)
    assert (manifest.format, manifest.width, manifest.height, manifest.batch, manifest.dtype) == ("onnx", 96, 64, 2, "fp32")
    assert manifest.source == {"file": paths.dit.name, "sha256": sha256_file(paths.dit)}
    assert set(manifest.tools) >= {"opset", "torch", "onnx", "onnxruntime"}
    assert manifest.cycle() == [(b, k) for b in range(cfg.num_blocks) for k in ("self_attn", "cross_attn", "mlp")]
    tokens = (64 // 16) * (96 // 16)
    for g in manifest.graphs:
        model = onnx.load(str(folder / g.file))
        assert model.opset_import[0].version == 19
        assert [i.name for i in model.graph.input] == [s.name for s in g.inputs]
        assert [o.name for o in model.graph.output] == ["out"]
        dims = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
        assert dims["h"] == [2, tokens, cfg.width]
        if g.kind == "self_attn":
            assert dims["rope_cos"] == [tokens, cfg.head_dim]
        if g.kind == "cross_attn":  # the text K/V come in from the host, already projected
            assert dims["k"] == dims["v"] == [2, cfg.context_len, cfg.width]
        assert g.sha256 == sha256_file(folder / g.file)
    assert json.loads((folder / "manifest.json").read_text())["graphs"][0]["inputs"][0]["batched"] is True


def test_failed_export_leaves_nothing_behind(tiny_models, tmp_path, monkeypatch):
    cfg, weights = load_dit(ModelPaths.find(tiny_models).dit)
    calls = []
    real_export = export_module.export_branch

    def failing(module, inputs, path):
        calls.append(path.name)
        if len(calls) == 4:
            raise RuntimeError("disk full")
        real_export(module, inputs, path)

    monkeypatch.setattr(export_module, "export_branch", failing)
    with pytest.raises(RuntimeError, match="disk full"):
        export_graphs(ModelPaths.find(tiny_models).dit, cfg, weights, 64, 64, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_export_replaces_an_old_folder_whole(tiny_models, tmp_path):
    cfg, weights = load_dit(ModelPaths.find(tiny_models).dit)
    out = tmp_path / "64x64"
    out.mkdir()
    (out / "stale.onnx").write_bytes(b"old")
    export_graphs(ModelPaths.find(tiny_models), cfg, weights, 64, 64, out)
    assert not (out / "stale.onnx").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["64x64"]
    assert len(Manifest.read(out).graphs) == 3 * cfg.num_blocks


def test_bad_size_is_a_user_error(tiny_models, tmp_path):
    cfg, weights = load_dit(ModelPaths.find(tiny_models).dit)
    with pytest.raises(UserError, match="multiples of 16"):
        export_graphs(ModelPaths.find(tiny_models).dit, cfg, weights, 100, 64, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []
