"""`anima-ui convert-rknn`: exported ONNX graphs -> FP16 .rknn graphs for the RK3588, each verified on
the toolkit's simulator against onnxruntime right after its build.

rknn-toolkit2 pins numpy 1.26, onnx <= 1.18 and protobuf 4, so it cannot live in the main environment:
the conversion runs as subprocesses, `.venv-rknn/bin/python anima_ui/convert/rknn_worker.py`
(scripts/make_rknn_venv.sh makes the venv). Resumable like the export: each .rknn is renamed into place
when complete and gets a record (`<graph>.rknn.json`: its sha256, the ONNX graph's sha256, the toolkit
version and target, the simulator check); a graph whose record still matches is kept, and the manifest
is written last.

(This module must not be called rknn.py: the worker runs from this folder and imports `rknn.api`.)"""

import json
import queue
import subprocess
import threading
from pathlib import Path

from anima_ui.convert.export import finish_folder, finished_graph, folder_lock, read_record, start_folder, write_record
from anima_ui.errors import UserError
from anima_ui.runtime.manifest import GraphEntry, Manifest, sha256_file

REPO_ROOT = Path(__file__).resolve().parents[2]
VENV_PYTHON = REPO_ROOT / ".venv-rknn" / "bin" / "python"
WORKER = Path(__file__).with_name("rknn_worker.py")
MIN_SIM_COSINE = 0.9999
TARGETS = ("rk3588",)
LOG = "convert.log"  # the toolkit's own output, kept next to the graphs
CHECK_KEYS = ("sim_cosine", "sim_max_abs_error", "sim_nonfinite", "sim_shape_ok")


def toolkit_info(python=VENV_PYTHON) -> dict:
    """{"rknn-toolkit2": version, "torch": version or None, "python": version} of the conversion environment."""
    python = Path(python)
    if not python.exists():
        raise UserError(f"no RKNN conversion environment at {python}: run scripts/make_rknn_venv.sh first")
    done = subprocess.run([str(python), str(WORKER), "--version"], capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"the RKNN conversion environment {python} is broken ({tail[:200]}); run scripts/make_rknn_venv.sh again")
    return json.loads(lines[-1])


def convert_rknn(onnx_dir, out_dir, target: str = "rk3588", python=VENV_PYTHON, progress=None, jobs: int = 1) -> Manifest:
    """Convert every graph of the exported folder `onnx_dir` that `out_dir` does not already hold, with `jobs`
    worker processes. progress(done, total, file, seconds, reused, result) is called after each graph."""
    if target not in TARGETS:
        raise UserError(f"--target {target!r}: only {', '.join(TARGETS)} is supported")
    source = Manifest.read(onnx_dir)
    if source.format != "onnx":
        raise UserError(f"{onnx_dir} holds {source.format} graphs; point --onnx at an `anima-ui export` folder")
    info = toolkit_info(python)
    toolkit = info["rknn-toolkit2"]
    onnx_dir, out_dir = Path(onnx_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with folder_lock(out_dir):
        start_folder(out_dir)
        wanted = {g.file: {"onnx_sha256": g.sha256, "toolkit": toolkit, "target": target} for g in source.graphs}
        todo = [g.file for g in source.graphs if finished_graph(out_dir, rknn_name(g.file), wanted[g.file]) is None]
        done = 0
        for g in source.graphs:
            if g.file not in todo:
                done += 1
                if progress:
                    progress(done, len(source.graphs), rknn_name(g.file), 0.0, True, read_record(out_dir, rknn_name(g.file)))
        for result in _run_workers(python, onnx_dir, out_dir, target, todo, jobs):
            _check_simulation(result, out_dir)
            write_record(out_dir, result["file"], {**wanted[result["onnx_file"]], **result})
            done += 1
            if progress:
                progress(done, len(source.graphs), result["file"], result["build_seconds"] + result["check_seconds"], False, result)
        graphs = []
        for g in source.graphs:
            record = read_record(out_dir, rknn_name(g.file))
            extra = {"toolkit": toolkit, "target": target, "onnx_file": g.file, "onnx_sha256": g.sha256,
                     **{key: record[key] for key in CHECK_KEYS}}
            graphs.append(GraphEntry(rknn_name(g.file), g.block, g.kind, g.inputs, g.outputs, record["sha256"], extra))
        manifest = Manifest(
            format="rknn", width=source.width, height=source.height, batch=source.batch, dtype="fp16", graphs=graphs,
            source={"onnx_manifest_sha256": sha256_file(onnx_dir / "manifest.json"), "checkpoint": source.source},
            tools={"rknn-toolkit2": toolkit, "target": target, "python": info["python"], "torch": info["torch"]},
        )
        finish_folder(out_dir, manifest)
    return manifest


def rknn_name(onnx_file: str) -> str:
    return str(Path(onnx_file).with_suffix(".rknn"))


def _run_workers(python, onnx_dir: Path, out_dir: Path, target: str, files: list[str], jobs: int):
    """Yield each worker's per-graph result as it arrives; `jobs` workers share the list round-robin."""
    if not files:
        return
    shares = [files[i::jobs] for i in range(max(1, min(jobs, len(files))))]
    with open(out_dir / LOG, "a") as log:
        processes = [
            subprocess.Popen([str(python), str(WORKER), "--onnx", str(onnx_dir.resolve()), "--out", str(out_dir.resolve()),
                              "--target", target, *share], stdout=subprocess.PIPE, stderr=log, text=True)
            for share in shares
        ]
        try:
            yield from _merged_lines(processes)
            codes = [p.wait() for p in processes]
        finally:
            for p in processes:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    if any(codes):
        tail = (out_dir / LOG).read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise UserError(f"RKNN conversion failed (exit {max(codes)}): {tail[0][:300]}; the toolkit's output is in {out_dir / LOG}")


def _merged_lines(processes):
    """JSON result lines of several workers, in the order they are printed (one reader thread per worker)."""
    lines = queue.Queue()

    def read(stream):
        for line in stream:
            if line.startswith("{"):
                lines.put(json.loads(line))
        lines.put(None)

    for p in processes:
        threading.Thread(target=read, args=(p.stdout,), daemon=True).start()
    running = len(processes)
    while running:
        item = lines.get()
        if item is None:
            running -= 1
        else:
            yield item


def _check_simulation(result: dict, folder: Path) -> None:
    if result["sim_nonfinite"] or not result["sim_shape_ok"] or not result["sim_cosine"] >= MIN_SIM_COSINE:
        raise UserError(
            f"{result['file']} failed the simulator check (cosine {result['sim_cosine']:.6f}, {result['sim_nonfinite']} NaN/Inf, "
            f"shape ok {result['sim_shape_ok']}); see {folder / LOG} and report the toolkit version {result['toolkit']}"
        )
