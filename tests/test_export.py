"""`anima-ui export`: 3 graphs per block with the manifest the runtime reads; streamed one graph's tensors at
a time, without torch, and resumable graph by graph."""

import json
import shutil
import subprocess

import onnx
import pytest

from anima_ui.convert import export as export_module
from anima_ui.convert.export import export_graphs, record_path
from anima_ui.errors import UserError
from anima_ui.model.checkpoint import load_dit
from anima_ui.model.tensor_file import TensorFile
from anima_ui.modelfiles import ModelPaths
from anima_ui.runtime.manifest import Manifest, sha256_file

@pytest.fixture(scope="module")
def tiny_models(tiny_model, tmp_path_factory):
    return shutil.copytree(tiny_model, tmp_path_factory.mktemp("export") / "tiny")  # the export writes into it


def test_export_command_writes_graphs_and_manifest_without_torch(tiny_models, anima_ui_without_torch):
    result = subprocess.run(
        [*anima_ui_without_torch, "export", "--models", str(tiny_models), "--width", "96", "--height", "64", "--batch", "2"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "[6/6] block01_mlp.onnx: built in" in result.stderr
    paths = ModelPaths.find(tiny_models)
    folder = paths.exported_dir(96, 64, batch=2)  # batch-2 graphs go to exported/WxH-b2, beside the batch-1 set
    assert folder.name == "96x64-b2"
    manifest = Manifest.read(folder)
    cfg, _ = load_dit(paths.dit)
    assert (manifest.format, manifest.width, manifest.height, manifest.batch, manifest.dtype) == ("onnx", 96, 64, 2, "fp32")
    assert manifest.source == {"file": paths.dit.name, "sha256": sha256_file(paths.dit)}
    assert set(manifest.tools) >= {"opset", "graphs", "onnx"}
    assert manifest.cycle() == [(b, k) for b in range(cfg.num_blocks) for k in ("self_attn", "cross_attn", "mlp")]
    tokens = (64 // 16) * (96 // 16)
    for g in manifest.graphs:
        model = onnx.load(str(folder / g.file))
        onnx.checker.check_model(model)
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
        record = json.loads(record_path(folder, g.file).read_text())
        assert record["sha256"] == g.sha256 and record["source"] == manifest.source
    assert json.loads((folder / "manifest.json").read_text())["graphs"][0]["inputs"][0]["batched"] is True


def test_export_reads_one_graphs_tensors_at_a_time(tiny_models, tmp_path, monkeypatch):
    """Between two graph builds the export reads only the next graph's tensors, each once."""
    reads, groups = [], []
    real_read, real_build = TensorFile.read, export_module.branch_graph

    def recording_read(self, name, *args):
        reads.append(name)
        return real_read(self, name, *args)

    def recording_build(kind, *args):
        groups.append((kind, reads.copy()))
        reads.clear()
        return real_build(kind, *args)

    monkeypatch.setattr(TensorFile, "read", recording_read)
    monkeypatch.setattr(export_module, "branch_graph", recording_build)
    export_graphs(ModelPaths.find(tiny_models), 64, 64, tmp_path / "out")
    assert len(groups) == 6 and reads == []
    for block, (kind, names) in zip([0, 0, 0, 1, 1, 1], groups):
        # one branch of one block: at most the 6 self-attention tensors, none read twice
        assert 2 <= len(names) == len(set(names)) <= 6
        assert all(name.startswith(f"blocks.{block}.{kind}.") for name in names), names


def test_killed_export_resumes_with_only_the_unfinished_graphs(tiny_models, tmp_path, monkeypatch):
    paths = ModelPaths.find(tiny_models)
    whole = export_graphs(paths, 64, 64, tmp_path / "whole")

    built = []
    real_build = export_module.branch_graph

    def dying(kind, *args):
        if len(built) == 4:
            raise KeyboardInterrupt  # a kill between two graphs
        built.append(kind)
        return real_build(kind, *args)

    monkeypatch.setattr(export_module, "branch_graph", dying)
    out = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        export_graphs(paths, 64, 64, out)
    assert not (out / "manifest.json").exists()
    # a graph half-written by a kill mid-write, and a finished graph damaged afterwards
    (out / ".block01_cross_attn.onnx.partial-123").write_bytes(b"half")
    (out / "block00_cross_attn.onnx").write_bytes((out / "block00_cross_attn.onnx").read_bytes()[:-10])

    monkeypatch.setattr(export_module, "branch_graph", real_build)
    events = []
    resumed = export_graphs(paths, 64, 64, out, progress=lambda done, total, file, seconds, reused: events.append((file, reused)))
    assert events == [("block00_self_attn.onnx", True), ("block00_cross_attn.onnx", False), ("block00_mlp.onnx", True),
                      ("block01_self_attn.onnx", True), ("block01_cross_attn.onnx", False), ("block01_mlp.onnx", False)]
    assert [g.sha256 for g in resumed.graphs] == [g.sha256 for g in whole.graphs]
    assert (out / "manifest.json").read_text() == (tmp_path / "whole" / "manifest.json").read_text()
    assert not list(out.glob(".*partial*"))


def test_export_replaces_other_graphs_in_the_folder(tiny_models, tmp_path):
    out = tmp_path / "64x64"
    first = export_graphs(ModelPaths.find(tiny_models), 64, 64, out, batch=2)
    (out / "stale.onnx").write_bytes(b"old")
    second = export_graphs(ModelPaths.find(tiny_models), 64, 64, out, batch=1)
    assert not (out / "stale.onnx").exists()
    assert {g.sha256 for g in first.graphs}.isdisjoint(g.sha256 for g in second.graphs)
    assert Manifest.read(out).batch == 1 and len(Manifest.read(out).graphs) == 6


def test_bad_size_is_a_user_error(tiny_models, tmp_path):
    with pytest.raises(UserError, match="multiples of 16"):
        export_graphs(ModelPaths.find(tiny_models).dit, 100, 64, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []
