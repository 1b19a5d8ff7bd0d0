"""`anima-ui bench memory --models DIR`: the app process's peak RSS per phase of one generation, against the
board's budget, and the peak of `verify --reference onnx`.

The generation runs in a fresh process (the app's own code path: Pipeline.load, then generate with the given
backend). At every phase change it reads the process's high-water mark (VmHWM) and resets it (writing 5 to
/proc/self/clear_refs), so each row is that phase's own peak of the whole process, and the job's peak is the
largest row. `verify` runs as `anima-ui verify` in its own process; its peak comes from wait4.

The graph contexts' share: the sim holds each open context as a float32 onnxruntime session; the board holds
the same graphs as FP16 RKNN contexts in the same RAM. The table gives the largest set of graphs open at once
(the executor's `max_contexts` consecutive graphs of the visiting cycle) in both precisions, and what the
denoise phase added to the process beyond its RSS when it started (contexts, their activations, and the
file read ahead)."""

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from anima_ui.runtime import auto
from anima_ui.runtime.manifest import Manifest

GB = 1e9
BUDGET_GB = {"denoise": 2.0, "job": 3.0, "verify": 2.5}


def add_arguments(parser):
    parser.add_argument("--models", required=True, help="model folder with exported/<W>x<H> graphs (full size for the budget)")
    parser.add_argument("--backend", default="sim", choices=("onnx", "sim", "torch"),
                        help="torch: checks --backend auto's estimate of what the torch backend needs (no verify row)")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--height", type=int, default=512)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--time-scale", type=float, default=0.001, help="sim: fraction of the board's latencies")
    parser.add_argument("--max-contexts", type=int, default=2)
    parser.add_argument("--decoder", default="sdcpp")
    parser.add_argument("--no-verify", action="store_true", help="skip the verify --reference onnx row")
    parser.add_argument("--json", help="also write the measurements to this file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # the measured generation process


def run(args) -> int:
    if args.worker:
        print(json.dumps(_generate_and_measure(args)))
        return 0
    generation = _run_child([sys.executable, "-m", "anima_ui", "bench", "memory", *_worker_flags(args)])
    measured = json.loads(generation["stdout"].splitlines()[-1])
    measured["process_peak_gb"] = generation["peak_gb"]
    if not args.no_verify and args.backend != "torch":
        verify = _run_child([sys.executable, "-m", "anima_ui", "verify", "--models", str(args.models), "--backend", args.backend,
                             "--reference", "onnx", "--width", str(args.width), "--height", str(args.height),
                             "--time-scale", str(args.time_scale)])
        measured["verify_peak_gb"] = verify["peak_gb"]
        measured["verify_passed"] = verify["returncode"] == 0
    if args.backend == "torch":
        measured["auto_torch_estimate_gb"] = auto.torch_bytes(auto.dit_parameters(Path(args.models))) / GB
    else:
        measured["contexts"] = _context_share(Path(args.models) / "exported" / f"{args.width}x{args.height}", args.max_contexts)
    _print_table(args, measured)
    if args.json:
        Path(args.json).write_text(json.dumps(measured, indent=1))
    return 0


def _worker_flags(args) -> list[str]:
    return ["--worker", "--models", str(args.models), "--backend", args.backend, "--width", str(args.width),
            "--height", str(args.height), "--steps", str(args.steps), "--time-scale", str(args.time_scale),
            "--max-contexts", str(args.max_contexts), "--decoder", args.decoder]


def _run_child(command: list[str]) -> dict:
    """Runs a command to its end; its own peak RSS from wait4 (not the largest of all children so far)."""
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = {}
    readers = [threading.Thread(target=lambda name, stream: out.__setitem__(name, stream.read()), args=(name, stream))
               for name, stream in (("stdout", child.stdout), ("stderr", child.stderr))]
    for reader in readers:
        reader.start()
    _, status, usage = os.wait4(child.pid, 0)
    for reader in readers:
        reader.join()
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode not in (0, 1):  # verify exits 1 when a cosine misses its threshold; still a measurement
        raise RuntimeError(f"{' '.join(command[2:5])} failed: {out['stderr'].strip().splitlines()[-3:]}")
    return {"stdout": out["stdout"], "returncode": child.returncode, "peak_gb": usage.ru_maxrss * 1024 / GB}


def _generate_and_measure(args) -> dict:
    from anima_ui.pipeline import GenerationRequest, Pipeline, PhaseEvent, ResultEvent
    from anima_ui.runtime.memory import peak_rss_bytes, reset_peak_rss, rss_bytes

    phases, rss_at_start, seconds = {}, {}, {}
    reset_peak_rss()
    started = time.perf_counter()
    pipeline = Pipeline.load(args.models, backend=args.backend, decoder=args.decoder, time_scale=args.time_scale,
                             max_contexts=args.max_contexts)
    phases["load"], seconds["load"] = peak_rss_bytes(), time.perf_counter() - started
    request = GenerationRequest(prompt="a lighthouse on a cliff at dusk, waves, gulls", negative="blurry",
                                seed=1, steps=args.steps, width=args.width, height=args.height)
    phase = None
    for event in pipeline.generate(request):
        if isinstance(event, (PhaseEvent, ResultEvent)):
            if phase is not None:
                phases[phase], seconds[phase] = peak_rss_bytes(), time.perf_counter() - started
            if isinstance(event, PhaseEvent):
                phase = event.phase
                reset_peak_rss()
                rss_at_start[phase], started = rss_bytes(), time.perf_counter()
    return {"phases_gb": {k: v / GB for k, v in phases.items()}, "rss_at_start_gb": {k: v / GB for k, v in rss_at_start.items()},
            "seconds": seconds, "host_weights_gb": _resident_bytes(pipeline.weights) / GB,
            "peak_open_contexts": getattr(pipeline.runtime, "peak_open_contexts", 0)}


def _resident_bytes(weights) -> int:
    """The graph backends' HostWeights say; the torch backend holds a dict of float32 arrays."""
    return weights.resident_bytes if hasattr(weights, "resident_bytes") else sum(v.nbytes for v in weights.values())


def _context_share(graphs_dir: Path, max_contexts: int) -> dict:
    """The largest bytes of `max_contexts` consecutive graphs in the visiting cycle (fp32 files, batch as exported)."""
    manifest = Manifest.read(graphs_dir)
    sizes = [(graphs_dir / g.file).stat().st_size for g in manifest.graphs]
    window = max(sum(sizes[(i + j) % len(sizes)] for j in range(max_contexts)) for i in range(len(sizes)))
    return {"fp32_gb": window / GB, "fp16_gb": window / 2 / GB, "max_contexts": max_contexts}


def _print_table(args, m: dict) -> None:
    phases = m["phases_gb"]
    print(f"peak RSS of the whole app process, generate --backend {args.backend} {args.width}x{args.height}, "
          f"{args.steps} steps, CFG batch 2, {args.models}")
    print(f"{'phase':>10} {'peak GB':>8} {'RSS at start':>13} {'seconds':>8} {'budget GB':>10}")
    for name, peak in phases.items():
        budget = BUDGET_GB.get(name, "") if args.backend != "torch" else ""  # the board's budget; a board has no torch
        start = m["rss_at_start_gb"].get(name)
        print(f"{name:>10} {peak:8.2f} {'' if start is None else f'{start:.2f}':>13} {m['seconds'][name]:8.1f} {budget:>10}")
    job = max(phases.values())
    job_budget = BUDGET_GB["job"] if args.backend != "torch" else ""
    print(f"{'whole job':>10} {job:8.2f} {'':>13} {'':>8} {job_budget:>10}   (wait4 of the process: {m['process_peak_gb']:.2f})")
    if "verify_peak_gb" in m:
        print(f"{'verify':>10} {m['verify_peak_gb']:8.2f} {'':>13} {'':>8} {BUDGET_GB['verify']:>10}   "
              f"(verify --backend {args.backend} --reference onnx; {'passed' if m['verify_passed'] else 'FAILED'})")
    added = phases["denoise"] - m["rss_at_start_gb"]["denoise"]
    if "auto_torch_estimate_gb" in m:
        print(f"--backend auto's estimate for the torch backend: {m['auto_torch_estimate_gb']:.2f} GB "
              f"(measured whole job {max(job, m['process_peak_gb']):.2f} GB); the denoise phase added {added:.2f} GB")
        return
    c = m["contexts"]
    print(f"host tensors resident (bf16 as stored): {m['host_weights_gb']:.2f} GB")
    print(f"graph contexts, the largest {c['max_contexts']} open at once: {c['fp32_gb']:.2f} GB as float32 onnxruntime "
          f"sessions (sim), {c['fp16_gb']:.2f} GB as FP16 RKNN contexts (board); peak contexts open: {m['peak_open_contexts']}; "
          f"the denoise phase added {added:.2f} GB to the process")
