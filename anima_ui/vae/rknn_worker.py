"""Runs inside .venv-rknn (rknn-toolkit2 2.5.0, numpy 1.26, onnx 1.18), started by npu_graphs.py for one
decoder graph; it imports nothing from anima_ui, whose environment it cannot share.

Builds an FP16 .rknn from one ONNX graph and, in the same RKNN session (the simulator cannot run a model
loaded from a .rknn file), runs it on the simulator once per input file. The graphs' 4-D inputs are NCHW
(the toolkit assumes NHWC unless told). Writes out_<i>.npy into --outputs and prints one JSON line: build
and simulator seconds, the process's peak RSS after the build and at the end, and the ops the compiler left on the CPU."""

import argparse
import importlib.metadata
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from rknn.api import RKNN

# a row of the compiler's op table: "ID  OpType  DataType  Target  ..."
OP_ROW = re.compile(r"^\S+ RKNN: \[[^\]]+\]\s+\d+\s+(\w+)\s+\w+\s+(CPU|NPU)\s")


def peak_rss_gb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def placement(log: str) -> tuple[list[str], int]:
    """(op types the compiler placed on the CPU besides the input and output themselves, number of NPU ops)."""
    cpu, npu = [], 0
    for line in log.splitlines():
        row = OP_ROW.match(line)
        if row and row.group(2) == "NPU":
            npu += 1
        elif row and row.group(1) not in ("InputOperator", "OutputOperator"):
            cpu.append(row.group(1))
    return cpu, npu


def convert(args) -> dict:
    rknn = RKNN(verbose=True)  # the op table (where each op runs) is printed only when verbose
    try:
        started = time.perf_counter()
        rknn.config(target_platform=args.target, float_dtype="float16")
        if rknn.load_onnx(model=args.onnx) != 0:
            raise RuntimeError(f"load_onnx failed for {args.onnx}")
        if rknn.build(do_quantization=False) != 0:
            raise RuntimeError(f"build failed for {args.onnx}")
        if rknn.export_rknn(args.rknn) != 0:
            raise RuntimeError(f"export_rknn failed for {args.onnx}")
        build_seconds, build_peak = time.perf_counter() - started, peak_rss_gb()
        started = time.perf_counter()
        if args.inputs and rknn.init_runtime() != 0:  # target=None: the simulator
            raise RuntimeError(f"simulator init_runtime failed for {args.onnx}")
        for i, path in enumerate(args.inputs):
            x = np.load(path)
            out = rknn.inference(inputs=[x], data_format=["nchw"] if x.ndim == 4 else None)
            np.save(Path(args.outputs, f"out_{i}.npy"), np.asarray(out[0], dtype=np.float32))
        sim_seconds = time.perf_counter() - started
    finally:
        rknn.release()
    return {"build_seconds": round(build_seconds, 2), "sim_seconds": round(sim_seconds, 2),
            "build_peak_rss_gb": round(build_peak, 2), "peak_rss_gb": round(peak_rss_gb(), 2)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--onnx", required=True)
    parser.add_argument("--rknn", required=True)
    parser.add_argument("--target", default="rk3588")
    parser.add_argument("--inputs", nargs="*", default=[], help=".npy files, one simulator run each")
    parser.add_argument("--outputs", required=True, help="folder for out_<i>.npy")
    args = parser.parse_args()
    # The toolkit's native log (with the op table) goes to file descriptor 1: capture it, then hand it on
    # to stderr (the conversion log) and keep stdout for the result line.
    with tempfile.TemporaryFile("w+", errors="replace") as captured:
        sys.stdout.flush()
        stdout = os.dup(1)
        os.dup2(captured.fileno(), 1)
        try:
            result = convert(args)
        finally:
            sys.stdout.flush()
            os.dup2(stdout, 1)
            os.close(stdout)
            captured.seek(0)
            log = captured.read()
            sys.stderr.write(log)
    cpu_ops, npu_ops = placement(log)
    print(json.dumps({**result, "cpu_ops": cpu_ops, "npu_ops": npu_ops,
                      "toolkit": importlib.metadata.version("rknn-toolkit2")}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
