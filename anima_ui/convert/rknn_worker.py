"""Runs inside .venv-rknn (rknn-toolkit2, numpy 1.26, onnx 1.18, onnxruntime < 1.23), started by
`anima-ui convert-rknn` / `anima-ui prepare` for the DiT branch graphs and by vae/npu_graphs.py for the NPU
decoder's; it imports nothing from anima_ui, whose environment it cannot share.

For each graph named on the command line: build an FP16 .rknn for the target, then, in the same RKNN
session (the toolkit's simulator cannot run a model loaded back from a .rknn file), run it on the
simulator. Without --feeds it compares with onnxruntime on random inputs at the graph's scale; with
--feeds DIR it runs once per DIR/<graph stem>/in_<i>.npy and writes out_<i>.npy beside it for the parent
to judge (the decoder's checks are in pixel space, through graphs of the main environment). Each .rknn
is written to a temp name and renamed when complete; one JSON line per graph on stdout tells the parent,
which keeps the records and writes the manifest. The compiler's op table (where each op runs) goes to
stderr with the rest of the toolkit's log, and the ops it left on the CPU into the JSON line. The op table's
parser (`parse_op_table`) lives here for every reader of a build log, in this environment and in the app's
(anima_ui/quant/convert.py imports it; this module imports nothing the app's environment lacks).

torch: rknn-toolkit2 2.5.0 imports it when `rknn.api` is imported, for one reason only: its GDQ
quantizer (`rknn/api/gdq_quant`) decorates a function with `@torch.no_grad()` and subclasses
`torch.nn.Module` at import time, and `rknn/api/rknn_utils` does `import torch`. The FP16 build, export
and simulator never touch torch (checked by recording every attribute access on a stand-in). So when
torch is not installed, a stand-in with exactly those two names is put in its place, and anything else
asked of it fails with a message that says to install torch (the quantizers need the real one)."""

import argparse
import ctypes
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import resource
import signal
import sys
import tempfile
import time
import types
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime

# a row of the compiler's op table (RKNN_LOG_LEVEL=5 or a verbose RKNN):
# "D RKNN: [time] ID OpType DataType Target InputShape OutputShape Cycles(DDR/NPU/Total) RW(KB) FullName"
OP_ROW = re.compile(r"RKNN: \[[^\]]*\]\s+(\d+)\s+(\S+)\s+(\w+)\s+(NPU|CPU)\s+.*?\s(\d+)/(\d+)/(\d+)\s+(\S+)\s+(\S+)\s*$")
NEEDS_TORCH = "rknn-toolkit2 needs the real torch for this (its quantizers): run scripts/make_rknn_venv.sh --with-torch"


def torch_stand_in() -> dict[str, types.ModuleType]:
    """`torch` and `torch.nn` with the two names the toolkit uses at import time; everything else raises."""

    def missing(module_name):
        def getattr_(name):
            raise AttributeError(f"{module_name}.{name}: {NEEDS_TORCH}")
        return getattr_

    class Module:
        def __init__(self, *args, **kwargs):
            raise RuntimeError(f"torch.nn.Module: {NEEDS_TORCH}")

    torch = types.ModuleType("torch")
    nn = types.ModuleType("torch.nn")
    torch.__path__, nn.__path__ = [], []
    torch.no_grad = lambda: (lambda function: function)  # a decorator that leaves the function as it is
    nn.Module = Module
    torch.nn = nn
    torch.__getattr__, nn.__getattr__ = missing("torch"), missing("torch.nn")
    return {"torch": torch, "torch.nn": nn}


def import_rknn():
    try:
        import torch  # noqa: F401  (optional: only the toolkit's quantizers need it)
    except ImportError:
        sys.modules.update(torch_stand_in())
    from rknn.api import RKNN  # here, not at the top: only once the stand-in (if needed) is in place

    return RKNN


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


def convert_one(RKNN, onnx_path: Path, rknn_path: Path, graph: dict, target: str, seed: int, feeds: Path | None) -> dict:
    temp = rknn_path.with_name(f".{rknn_path.name}.partial-{os.getpid()}")
    rknn = RKNN(verbose=True)  # the op table (where each op runs) is printed only when verbose
    cpu_started = cpu_seconds()
    files = sorted(feeds.glob("in_*.npy"), key=lambda path: int(path.stem[3:])) if feeds else []
    runs = [[np.load(path)] for path in files] if feeds else [check_inputs(graph, seed)]
    outputs = []
    try:
        started = time.perf_counter()
        rknn.config(target_platform=target, float_dtype="float16")
        if rknn.load_onnx(model=str(onnx_path)) != 0:
            raise RuntimeError(f"load_onnx failed for {onnx_path.name}")
        if rknn.build(do_quantization=False) != 0:
            raise RuntimeError(f"build failed for {onnx_path.name}")
        if rknn.export_rknn(str(temp)) != 0:
            raise RuntimeError(f"export_rknn failed for {onnx_path.name}")
        build_seconds, build_peak = time.perf_counter() - started, peak_rss_mib()
        if rknn.init_runtime() != 0:  # target=None: the simulator
            raise RuntimeError(f"simulator init_runtime failed for {onnx_path.name}")
        for inputs in runs:
            # 4-D inputs (the decoder's) are NCHW; the toolkit takes them as NHWC unless told
            layout = ["nchw"] * len(inputs) if all(x.ndim == 4 for x in inputs) else None
            outputs.append(np.asarray(rknn.inference(inputs=inputs, data_format=layout)[0], dtype=np.float32))
        check_seconds = time.perf_counter() - started - build_seconds
        os.replace(temp, rknn_path)
    finally:
        rknn.release()
        temp.unlink(missing_ok=True)
    result = {
        "cpu_seconds": round(cpu_seconds() - cpu_started, 3),  # less disturbed by a busy machine than wall time
        "build_seconds": round(build_seconds, 3),
        "check_seconds": round(check_seconds, 3),
        "build_peak_rss_mib": round(build_peak, 1),
        "sim_nonfinite": int(sum((~np.isfinite(out)).sum() for out in outputs)),
        "sim_shape_ok": all(list(out.shape) == list(graph["outputs"][0]["shape"]) for out in outputs),
    }
    if feeds:
        for i, out in enumerate(outputs):
            np.save(feeds / f"out_{i}.npy", out)
        return result
    session = onnxruntime.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    named = {spec["name"]: array for spec, array in zip(graph["inputs"], runs[0])}
    expected = np.asarray(session.run(None, named)[0], dtype=np.float64)
    simulated = outputs[0].astype(np.float64)
    finite = np.isfinite(simulated)
    a, b = np.where(finite, simulated, 0).ravel(), expected.ravel()
    return {**result, "sim_cosine": float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30)),
            "sim_max_abs_error": float(np.abs(np.where(finite, simulated, 0) - expected).max())}


@dataclass(frozen=True)
class Op:
    """One row of the compiler's op table."""

    index: int
    type: str
    dtype: str
    target: str
    cycles_npu: int
    cycles_total: int  # the compiler's modelled cycles (elementwise ops and fused attention report 0)
    rw_kb: int  # its modelled memory traffic
    name: str


def parse_op_table(log_text: str) -> list[Op]:
    """The last "Network Layer Information Table" of a verbose build log (one per build)."""
    start = log_text.rfind("Network Layer Information Table")
    if start < 0:
        return []
    ops = []
    for line in log_text[start:].splitlines()[3:]:
        m = OP_ROW.search(line)
        if m:
            ops.append(Op(int(m[1]), m[2], m[3], m[4], int(m[6]), int(m[7]), int(m[8]) if m[8].isdigit() else 0, m[9]))
        elif ops and "-----" in line:
            break
    return ops


def placement(log: str) -> tuple[list[str], int]:
    """(op types the compiler placed on the CPU besides the input and output themselves, number of NPU ops)."""
    ops = parse_op_table(log)
    cpu = [op.type for op in ops if op.target == "CPU" and op.type not in ("InputOperator", "OutputOperator")]
    return cpu, sum(op.target == "NPU" for op in ops)


@contextmanager
def toolkit_log(into: list):
    """The toolkit's native log (with the op table) goes to file descriptor 1, where the parent reads result
    lines: catch it, append its text to `into`, and hand it on to stderr (the conversion log)."""
    with tempfile.TemporaryFile("w+", errors="replace") as captured:
        sys.stdout.flush()
        stdout = os.dup(1)
        os.dup2(captured.fileno(), 1)
        try:
            yield
        finally:
            sys.stdout.flush()
            os.dup2(stdout, 1)
            os.close(stdout)
            captured.seek(0)
            into.append(captured.read())
            sys.stderr.write(into[-1])
            sys.stderr.flush()


def cpu_seconds() -> float:
    """CPU time of this process's threads and of the child processes it waited for."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def reset_peak_rss() -> None:
    """Start a new peak (VmHWM) for this process, so each graph's conversion is measured on its own (Linux)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def die_with_parent() -> None:
    """A killed parent takes this worker with it (Linux), so no orphan keeps writing into the folder."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--version", action="store_true", help="print the toolkit, torch and Python versions")
    parser.add_argument("--check", action="store_true", help="the same, after importing the toolkit")
    parser.add_argument("--onnx")
    parser.add_argument("--out")
    parser.add_argument("--target", default="rk3588")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--feeds", help="run the simulator on DIR/<graph stem>/in_<i>.npy (one input each) and write "
                                        "out_<i>.npy there, instead of comparing with onnxruntime on random inputs")
    parser.add_argument("graphs", nargs="*", help="ONNX file names of --onnx's manifest to convert, in order")
    args = parser.parse_args()
    toolkit = importlib.metadata.version("rknn-toolkit2")
    torch = importlib.util.find_spec("torch") and importlib.metadata.version("torch")
    info = {"rknn-toolkit2": toolkit, "torch": torch or None, "python": sys.version.split()[0]}
    if args.version:  # from the package metadata: importing the toolkit takes seconds
        print(json.dumps(info))
        return 0
    RKNN = import_rknn()
    if args.check:
        print(json.dumps(info))
        return 0
    die_with_parent()
    onnx_dir, out_dir = Path(args.onnx).resolve(), Path(args.out).resolve()
    feeds_dir = Path(args.feeds).resolve() if args.feeds else None
    graphs = {g["file"]: g for g in json.loads((onnx_dir / "manifest.json").read_text())["graphs"]}
    with tempfile.TemporaryDirectory(prefix="rknn-worker-") as work:
        os.chdir(work)  # the verbose toolkit writes its intermediate check*.onnx files into the working directory
        for file in args.graphs:
            rknn_file = Path(file).with_suffix(".rknn").name
            reset_peak_rss()
            log = []
            with toolkit_log(log):
                check = convert_one(RKNN, onnx_dir / file, out_dir / rknn_file, graphs[file], args.target, args.seed,
                                    feeds_dir / Path(file).stem if feeds_dir else None)
            cpu_ops, npu_ops = placement(log[0])
            print(json.dumps({"file": rknn_file, "onnx_file": file, "sha256": sha256_file(out_dir / rknn_file),
                              "size": (out_dir / rknn_file).stat().st_size, "toolkit": toolkit, "peak_rss_mib": peak_rss_mib(),
                              "cpu_ops": cpu_ops, "npu_ops": npu_ops, **check}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
