"""`anima-ui bench <name> [options]`: each benchmark lives in `anima_ui/bench/<name>.py` with
`add_arguments(parser)` and `run(args) -> int`, and prints a table. Only the chosen benchmark is imported."""

import argparse
import importlib

from anima_ui.cli import OneLineErrorParser

BENCHMARKS = {
    "crowd": "the served app under a hostile crowd: another user's job and status latency, refusal times",
    "memory": "peak RSS of the app process per generation phase and of verify, against the board's budget",
    "runtime": "split runtime: simulated board serial vs prefetch; onnxruntime vs torch on this machine",
    "spectrum": "Spectrum quality vs full computation and vs fewer Euler steps",
    "text": "Qwen3 text encoder per prompt: NumPy (the app's), onnxruntime, torch; seconds and peak RSS",
    "vae": "decode seconds and peak RSS of every decoder; preview cost per step",
    "prepare": "export and RKNN conversion per graph kind: seconds, peak RSS, parallel workers, projected board total",
    "quant": "W8A8 + low-rank FFNs: per-block errors and the end-to-end gate on the synthetic outlier model; one full-size FFN built three ways",
}


def add_arguments(parser):
    parser.add_argument("benchmark", choices=BENCHMARKS, help="; ".join(f"{k}: {v}" for k, v in BENCHMARKS.items()))
    parser.add_argument("options", nargs=argparse.REMAINDER, help="the benchmark's own options (see --help after its name)")


def run(args) -> int:
    module = importlib.import_module(f"anima_ui.bench.{args.benchmark}")
    parser = OneLineErrorParser(prog=f"anima-ui bench {args.benchmark}", description=BENCHMARKS[args.benchmark])
    module.add_arguments(parser)
    return module.run(parser.parse_args(args.options))
