"""Runs inside .venv-rknn (rknn-toolkit2 2.5.0, numpy 1.26, onnx 1.18, onnxruntime < 1.23), started by
`anima-ui convert-rknn`; it imports nothing from anima_ui, whose environment it cannot share.

For every graph of an exported ONNX folder: build an FP16 .rknn for the target, then, in the same RKNN
session (the simulator cannot run a model loaded from a .rknn file), run it on the
toolkit's simulator and compare with onnxruntime on the same random inputs. Writes the .rknn files and
manifest.json into --out and prints one JSON line per graph on stdout."""

import argparse
import hashlib
import importlib.metadata
import json
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime
from rknn.api import RKNN


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_inputs(graph: dict, seed: int) -> list:
    """Inputs at the scale the graphs see: AdaLN outputs and k/v about unit RMS, RoPE as cos/sin of
    real rotations (the two halves of a head share an angle)."""
    rng = np.random.default_rng(seed)
    arrays = []
    for spec in graph["inputs"]:
        shape = tuple(spec["shape"])
        if spec["name"] in ("rope_cos", "rope_sin"):
            angles = rng.uniform(0, 2 * np.pi, (shape[0], shape[1] // 2))
            angles = np.concatenate([angles, angles], axis=1)
            values = np.cos(angles) if spec["name"] == "rope_cos" else np.sin(angles)
        else:
            values = rng.standard_normal(shape)
        arrays.append(values.astype(spec["dtype"]))
    return arrays


def convert_one(onnx_path: Path, rknn_path: Path, graph: dict, target: str, seed: int) -> dict:
    rknn = RKNN(verbose=False)
    try:
        started = time.perf_counter()
        rknn.config(target_platform=target, float_dtype="float16")
        if rknn.load_onnx(model=str(onnx_path)) != 0:
            raise RuntimeError(f"load_onnx failed for {onnx_path.name}")
        if rknn.build(do_quantization=False) != 0:
            raise RuntimeError(f"build failed for {onnx_path.name}")
        if rknn.export_rknn(str(rknn_path)) != 0:
            raise RuntimeError(f"export_rknn failed for {onnx_path.name}")
        build_seconds = time.perf_counter() - started
        if rknn.init_runtime() != 0:  # target=None: the simulator
            raise RuntimeError(f"simulator init_runtime failed for {onnx_path.name}")
        inputs = check_inputs(graph, seed)
        simulated = np.asarray(rknn.inference(inputs=inputs)[0], dtype=np.float64)
    finally:
        rknn.release()
    session = onnxruntime.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    feeds = {spec["name"]: array for spec, array in zip(graph["inputs"], inputs)}
    expected = np.asarray(session.run(None, feeds)[0], dtype=np.float64)
    finite = np.isfinite(simulated)
    a, b = np.where(finite, simulated, 0).ravel(), expected.ravel()
    cosine = float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))
    return {
        "build_seconds": round(build_seconds, 3),
        "sim_cosine": cosine,
        "sim_max_abs_error": float(np.abs(np.where(finite, simulated, 0) - expected).max()),
        "sim_nonfinite": int((~finite).sum()),
        "sim_shape_ok": list(simulated.shape) == list(graph["outputs"][0]["shape"]),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--onnx", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--target", default="rk3588")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    onnx_dir, out_dir = Path(args.onnx), Path(args.out)
    source = json.loads((onnx_dir / "manifest.json").read_text())
    toolkit = importlib.metadata.version("rknn-toolkit2")
    graphs = []
    for graph in source["graphs"]:
        rknn_file = Path(graph["file"]).with_suffix(".rknn").name
        check = convert_one(onnx_dir / graph["file"], out_dir / rknn_file, graph, args.target, args.seed)
        extra = {"toolkit": toolkit, "target": args.target, "onnx_file": graph["file"], "onnx_sha256": graph["sha256"], **check}
        graphs.append({**graph, "file": rknn_file, "sha256": sha256_file(out_dir / rknn_file), "extra": extra})
        print(json.dumps({"file": rknn_file, **check}), flush=True)
    manifest = {
        "format": "rknn", "width": source["width"], "height": source["height"], "batch": source["batch"],
        "dtype": "fp16", "graphs": graphs,
        "source": {"onnx_manifest_sha256": sha256_file(onnx_dir / "manifest.json"), "checkpoint": source["source"]},
        "tools": {"rknn-toolkit2": toolkit, "target": args.target, "onnxruntime": onnxruntime.__version__,
                  "numpy": np.__version__, "python": sys.version.split()[0]},
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
