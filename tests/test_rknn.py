"""The RKNN tier (`python -m pytest -m rknn`, needs .venv-rknn from scripts/make_rknn_venv.sh): export the
tiny model, convert it with rknn-toolkit2 and check every graph on the toolkit's simulator."""

import json
import subprocess
import sys

import pytest

from anima_ui.convert.convert_rknn import MIN_SIM_COSINE, VENV_PYTHON, WORKER
from anima_ui.convert.export import export_graphs
from anima_ui.convert.rknn_worker import parse_op_table, placement
from anima_ui.runtime.manifest import Manifest

pytestmark = pytest.mark.rknn


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_state, write_dit_file):
    if not VENV_PYTHON.exists():
        pytest.fail(f"{VENV_PYTHON} is missing: run scripts/make_rknn_venv.sh before `pytest -m rknn`")
    root = tmp_path_factory.mktemp("tiny-rknn")
    checkpoint = root / "anima-tiny.safetensors"
    write_dit_file(tiny_state, checkpoint)
    export_graphs(checkpoint, 64, 64, root / "onnx")
    return root


def test_convert_rknn_builds_and_verifies_every_graph(exported):
    out = exported / "rknn"
    result = subprocess.run(
        [sys.executable, "-m", "anima_ui", "convert-rknn", "--onnx", str(exported / "onnx"), "--out", str(out), "--target", "rk3588"],
        capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    manifest = Manifest.read(out)
    source = Manifest.read(exported / "onnx")
    assert manifest.format == "rknn" and manifest.dtype == "fp16"
    assert manifest.tools["rknn-toolkit2"] == "2.5.0"
    assert [(g.block, g.kind) for g in manifest.graphs] == [(g.block, g.kind) for g in source.graphs]
    for graph, onnx_graph in zip(manifest.graphs, source.graphs):
        assert (out / graph.file).stat().st_size > 0 and graph.file.endswith(".rknn")
        assert graph.extra["toolkit"] == "2.5.0" and graph.extra["onnx_sha256"] == onnx_graph.sha256
        assert graph.extra["sim_cosine"] >= MIN_SIM_COSINE
        assert graph.extra["sim_nonfinite"] == 0 and graph.extra["sim_shape_ok"]
        assert graph.inputs == onnx_graph.inputs
    assert sorted(p.name for p in exported.iterdir()) == ["anima-tiny.safetensors", "onnx", "rknn"]  # no temp folders


def test_convert_rknn_refuses_a_non_onnx_folder(exported, tmp_path):
    manifest = Manifest.read(exported / "onnx")
    manifest.format = "rknn"
    for g in manifest.graphs:
        (tmp_path / g.file).write_bytes(b"")
    manifest.write(tmp_path)
    result = subprocess.run(
        [sys.executable, "-m", "anima_ui", "convert-rknn", "--onnx", str(tmp_path), "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert "point --onnx at an `anima-ui export` folder" in result.stderr
    assert json.loads((tmp_path / "manifest.json").read_text())["format"] == "rknn"


# Compiles one graph with the toolkit's verbose log (its op table).
OP_TABLE = r"""
import sys
sys.path.insert(0, sys.argv[1])
from rknn_worker import import_rknn
RKNN = import_rknn()
rknn = RKNN(verbose=True)
rknn.config(target_platform="rk3588", float_dtype="float16")
assert rknn.load_onnx(model=sys.argv[2]) == 0 and rknn.build(do_quantization=False) == 0
rknn.release()
"""


@pytest.mark.parametrize("kind,fused", [("self_attn", {"exSDPAttention", "exNorm"}), ("cross_attn", {"exSDPAttention", "exNorm"}),
                                        ("mlp", {"ConvExGelu"})])
def test_built_graphs_compile_to_fused_npu_ops(exported, kind, fused):
    """The patterns the graph builder emits are the ones the RKNN compiler fuses: attention -> exSDPAttention,
    the q/k RMSNorm -> exNorm, erf GELU -> ConvExGelu, MatMul by a constant -> Conv; every op on the NPU."""
    result = subprocess.run([str(VENV_PYTHON), "-c", OP_TABLE, str(WORKER.parent), str(exported / "onnx" / f"block00_{kind}.onnx")],
                            capture_output=True, text=True, timeout=300, cwd=exported)
    assert result.returncode == 0, result.stderr[-2000:]
    table = parse_op_table(result.stdout + result.stderr)
    ops = {op.type for op in table}
    assert fused <= ops and "Conv" in ops and {op.dtype for op in table} == {"FLOAT16"}
    assert placement(result.stdout + result.stderr)[0] == []  # only the input and output on the CPU
    assert not ops & {"MatMul", "Softmax", "Erf", "ReduceMean", "Pow"}  # nothing left unfused
