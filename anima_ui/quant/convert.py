"""Conversion of one FFN graph to RKNN in .venv-rknn (anima_ui/convert/rknn_quant_worker.py), its simulator outputs, and the
compiler's op table read from the build log.

For a W8A8 + low-rank graph the op table must show exactly what was asked for: the two residual GEMMs as
INT8 Convs (or their pieces), none of them tiled along K by the compiler (it would round the partial sums to int8
between tiles, which the emulator does not model), every other Conv (the low-rank branch, fused with the add into
a ConvAdd) in FLOAT16, the output FLOAT16, and nothing on the CPU but the input and output operators."""

import json
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from anima_ui.convert.convert_rknn import VENV_PYTHON, WORKER as FP16_WORKER
from anima_ui.convert.rknn_worker import Op, parse_op_table
from anima_ui.errors import UserError
from anima_ui.quant.ffn import QuantizedFfn
from anima_ui.quant.graph import INT8_PREFIXES

WORKER = FP16_WORKER.with_name("rknn_quant_worker.py")
MODES = ("hybrid", "int8", "fp16")
CONV_TYPES = ("Conv", "ConvAdd", "ConvExGelu")
RESIDUAL = re.compile(r"Conv:(res[12])(?![0-9])")  # the residual GEMMs' Convs (the graph names them res1…, res2…)


@dataclass
class Conversion:
    rknn_file: Path
    toolkit: str
    build_seconds: float
    ops: list[Op]
    sim_outputs: list[np.ndarray]
    log: Path | None  # the kept build log
    info: dict

    @property
    def cycles(self) -> int:
        """The compiler's modelled NPU cycles summed over the ops (exSDPAttention and other fused ops report 0)."""
        return sum(op.cycles_total for op in self.ops)


def hybrid_op_problems(ops: list[Op]) -> list[str]:
    """Why an op table is not the intended W8A8 + low-rank graph (empty when it is)."""
    if not ops:
        return ["the build log has no op table"]
    problems = []
    residual = [op for op in ops if op.type in CONV_TYPES and RESIDUAL.match(op.name)]
    if {RESIDUAL.match(op.name)[1] for op in residual} != {"res1", "res2"}:
        problems.append(f"expected INT8 Convs for res1 and res2, found {[op.name for op in residual]}")
    for op in ops:
        if op.type in CONV_TYPES:
            wanted = "INT8" if op in residual else "FLOAT16"
            if op.dtype != wanted:
                problems.append(f"{op.name} is {op.dtype}, expected {wanted}")
            if op in residual and "_tile" in op.name:
                problems.append(f"the compiler tiled {op.name} along K (partial sums rounded to int8 between tiles)")
        if op.target == "CPU" and op.type not in ("InputOperator", "OutputOperator"):
            problems.append(f"{op.name} runs on the CPU")
    output = [op for op in ops if op.type == "OutputOperator"]
    if not output or output[-1].dtype != "FLOAT16":
        problems.append(f"the output is {output[-1].dtype if output else 'missing'}, expected FLOAT16")
    return problems


def convert_ffn(onnx_path, rknn_path, mode: str, dataset: list[np.ndarray], check_inputs: list[np.ndarray],
                q: QuantizedFfn | None = None, target: str = "rk3588", python=VENV_PYTHON, keep_log=None) -> Conversion:
    """Build `onnx_path` into `rknn_path` in .venv-rknn and run `check_inputs` ([B, N, D] each, the graph's own
    input, i.e. already divided by λ1) on the simulator. dataset: inputs for the toolkit's calibration (its
    ranges are replaced by q's in hybrid mode). keep_log: a path to keep the build log at."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: one of {MODES}")
    python = Path(python)
    if not python.exists():
        raise UserError(f"no RKNN conversion environment at {python}: run scripts/make_rknn_venv.sh first")
    with tempfile.TemporaryDirectory(prefix="quant_rknn_") as tmp:
        tmp = Path(tmp)
        job = {
            "mode": mode, "onnx": str(Path(onnx_path).resolve()), "rknn": str(Path(rknn_path).resolve()), "target": target,
            "work": str(tmp), "result": str(tmp / "result.json"), "check_outputs_dir": str(tmp),
            "dataset": _save_arrays(dataset, tmp, "calib"), "check_inputs": _save_arrays(check_inputs, tmp, "check"),
            "int8_prefixes": list(INT8_PREFIXES),
            "ranges": {name: list(bounds) for name, bounds in q.ranges.items()} if q is not None else {},
        }
        (tmp / "job.json").write_text(json.dumps(job))
        log = Path(keep_log) if keep_log else tmp / "build.log"
        with open(log, "w") as out:
            code = subprocess.run([str(python), str(WORKER), str(tmp / "job.json")], stdout=out, stderr=subprocess.STDOUT,
                                  env={**os.environ, "RKNN_LOG_LEVEL": "5"}).returncode
        text = log.read_text(errors="replace")
        if code != 0:
            lines = [line for line in text.strip().splitlines() if line.strip()]
            errors = [line for line in lines if "Error:" in line or "failed" in line]
            reason = (errors or lines or ["no output"])[-1]
            raise UserError(f"RKNN conversion of {Path(onnx_path).name} failed (exit {code}): {reason[:300]}")
        result = json.loads((tmp / "result.json").read_text())
        outputs = [np.load(p) for p in result.pop("sim_outputs")]
    return Conversion(Path(rknn_path), result.pop("toolkit"), result.pop("build_seconds"), parse_op_table(text), outputs,
                      Path(keep_log) if keep_log else None, result)


def _save_arrays(arrays: list[np.ndarray], folder: Path, stem: str) -> list[str]:
    paths = []
    for index, array in enumerate(arrays):
        path = folder / f"{stem}_{index:02d}.npy"
        np.save(path, np.ascontiguousarray(array, np.float32))
        paths.append(str(path))
    return paths
