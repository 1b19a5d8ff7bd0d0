"""Put the quantized FFN graphs of a passing `quantize-ffn` folder into a graphs folder's manifest (what
`anima-ui prepare --ffn w8a8-lowrank` does last; anima_ui/runtime/quantized_ffn.py says what the entries hold).

Only a quant folder whose report passed every gate (per block, the conversion's op table and simulator checks,
end to end) and that was made from the same checkpoint at the same size is installed; the FP16 graphs stay
listed beside the quantized ones (`--ffn fp16` runs them). Each file is written atomically and the manifest last."""

import json
import shutil
from pathlib import Path

import numpy as np

from anima_ui.errors import UserError
from anima_ui.files import write_atomically
from anima_ui.runtime.manifest import Manifest, sha256_file
from anima_ui.runtime.quantized_ffn import KEY

REPORT = "report.json"


def read_report(quant_dir) -> dict:
    path = Path(quant_dir, REPORT)
    if not path.is_file():
        raise UserError(f"no quantized FFNs in {quant_dir}: run `anima-ui calibrate` and `anima-ui quantize-ffn --convert` "
                        "for this size (where the real weights are), or prepare without --ffn")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{path} is damaged ({exc}); run `anima-ui quantize-ffn --convert` again") from None


def checkpoint_sha256(manifest: Manifest) -> str | None:
    """The checkpoint a graphs folder was made from (an exported folder records it, a converted one its source's)."""
    return manifest.source.get("sha256") or manifest.source.get("checkpoint", {}).get("sha256")


def install_quantized_ffns(graphs_dir, quant_dir) -> Manifest:
    """Copy every quantized block's graph (.rknn into an rknn folder, .onnx into an exported one), its λ1 and its
    simulator check into `graphs_dir` and list them in its manifest; returns the new manifest."""
    graphs_dir, quant_dir = Path(graphs_dir), Path(quant_dir)
    report = read_report(quant_dir)
    manifest = Manifest.read(graphs_dir)
    rknn = manifest.format == "rknn"
    problem = None
    if not report.get("passed"):
        problem = "did not pass its gates (report.json lists every try)"
    elif rknn and not report.get("converted"):
        problem = "has no RKNN builds: run `anima-ui quantize-ffn --convert`"
    elif report.get("checkpoint_sha256") != checkpoint_sha256(manifest):
        problem = f"was made from another checkpoint than the graphs in {graphs_dir}"
    elif list(report["shape"]) != list(manifest.graph(0, "mlp").inputs[0].shape):
        problem = f"was made for FFN inputs {report['shape']}, the graphs take {list(manifest.graph(0, 'mlp').inputs[0].shape)}"
    if problem:
        raise UserError(f"the quantized FFN folder {quant_dir} {problem}; nothing was installed")
    blocks = {entry["block"]: entry for entry in report["blocks"] if entry["quantized"]}
    graphs = []
    for g in manifest.graphs:
        extra = {k: v for k, v in g.extra.items() if k != KEY}
        if g.kind == "mlp" and g.block in blocks:
            extra[KEY] = _install_block(graphs_dir, quant_dir, blocks[g.block], rknn)
        graphs.append(type(g)(g.file, g.block, g.kind, g.inputs, g.outputs, g.sha256, extra))
    manifest.graphs = graphs
    manifest.write(graphs_dir)
    return manifest


def _install_block(graphs_dir: Path, quant_dir: Path, entry: dict, rknn: bool) -> dict:
    stem = f"block{entry['block']:02d}_mlp_w8a8"
    graph = f"{stem}.rknn" if rknn else f"{stem}.onnx"
    _copy(quant_dir / graph, graphs_dir / graph)
    with np.load(quant_dir / f"{stem}.npz") as transform:
        smooth_in = np.asarray(transform["smooth_in"], np.float32)
    write_atomically(graphs_dir / f"{stem}.smooth_in.npy", lambda f: np.save(f, smooth_in))
    installed = {"file": graph, "sha256": sha256_file(graphs_dir / graph), "smooth_in": f"{stem}.smooth_in.npy",
                 "rank": entry["rank"], "alpha1": entry["alpha1"], "alpha2": entry["alpha2"]}
    if rknn:
        _copy(quant_dir / f"{stem}.check.npz", graphs_dir / f"{stem}.check.npz")
        installed["check"] = f"{stem}.check.npz"
    return installed


def _copy(source: Path, target: Path) -> None:
    if not source.is_file():
        raise UserError(f"{source} is missing: run `anima-ui quantize-ffn --convert` again")
    with open(source, "rb") as f:
        write_atomically(target, lambda out: shutil.copyfileobj(f, out, 1 << 22))
