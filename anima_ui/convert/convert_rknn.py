"""`anima-ui convert-rknn`: exported ONNX graphs -> FP16 .rknn graphs for the RK3588, each verified on
the toolkit's simulator against onnxruntime right after its build.

rknn-toolkit2 2.5.0 cannot live in the main environment (it pins numpy <= 1.26.4, onnx <= 1.18 and
protobuf <= 4.25.4, and imports torch <= 2.4 at import time), so the conversion runs as a
subprocess: `.venv-rknn/bin/python anima_ui/convert/rknn_worker.py` (scripts/make_rknn_venv.sh makes
the venv). The output folder appears whole or not at all.

(This module must not be called rknn.py: the worker runs from this folder and imports `rknn.api`.)"""

import json
import shutil
import subprocess
import tempfile
from pathlib import Path

from anima_ui.errors import UserError
from anima_ui.convert.export import _move_into_place
from anima_ui.runtime.manifest import Manifest

REPO_ROOT = Path(__file__).resolve().parents[2]
VENV_PYTHON = REPO_ROOT / ".venv-rknn" / "bin" / "python"
WORKER = Path(__file__).with_name("rknn_worker.py")
MIN_SIM_COSINE = 0.9999
TARGETS = ("rk3588",)
LOG = "convert.log"  # the toolkit's own output, kept next to the graphs


def convert_rknn(onnx_dir, out_dir, target: str = "rk3588", python=VENV_PYTHON, progress=None) -> Manifest:
    if target not in TARGETS:
        raise UserError(f"--target {target!r}: only {', '.join(TARGETS)} is supported")
    python = Path(python)
    if not python.exists():
        raise UserError(f"no RKNN conversion environment at {python}: run scripts/make_rknn_venv.sh first")
    source = Manifest.read(onnx_dir)
    if source.format != "onnx":
        raise UserError(f"{onnx_dir} holds {source.format} graphs; point --onnx at an `anima-ui export` folder")
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    temp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.convert-", dir=out_dir.parent))
    try:
        _run_worker(python, Path(onnx_dir), temp, target, progress)
        manifest = Manifest.read(temp)
        _check_simulation(manifest, temp)
        _move_into_place(temp, out_dir)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return manifest


def _run_worker(python: Path, onnx_dir: Path, out: Path, target: str, progress) -> None:
    command = [str(python), str(WORKER), "--onnx", str(onnx_dir.resolve()), "--out", str(out), "--target", target]
    with open(out / LOG, "w") as log:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True)
        for line in process.stdout:
            if progress and line.startswith("{"):
                result = json.loads(line)
                progress(f"{result['file']}: built in {result['build_seconds']:.1f} s, simulator cosine {result['sim_cosine']:.7f}")
        code = process.wait()
    if code != 0:
        tail = (out / LOG).read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise UserError(f"RKNN conversion failed (exit {code}): {tail[0][:300]}")


def _check_simulation(manifest: Manifest, folder: Path) -> None:
    for g in manifest.graphs:
        x = g.extra
        if x["sim_nonfinite"] or not x["sim_shape_ok"] or not x["sim_cosine"] >= MIN_SIM_COSINE:
            raise UserError(
                f"{g.file} failed the simulator check (cosine {x['sim_cosine']:.6f}, {x['sim_nonfinite']} NaN/Inf, "
                f"shape ok {x['sim_shape_ok']}); see {folder / LOG} and report the toolkit version {x['toolkit']}"
            )
