"""`anima-ui bench <name>`: each benchmark lives in `anima_ui/bench/<name>.py` with
`add_arguments(parser)` and `run(args) -> int`, and prints a table."""

import importlib

BENCHMARKS = {
    "runtime": "split runtime: simulated board serial vs prefetch; onnxruntime vs torch on this machine",
    "spectrum": "Spectrum quality vs full computation and vs fewer Euler steps",
    "vae": "decode seconds and peak RSS of every decoder; preview cost per step",
}


def add_arguments(parser):
    sub = parser.add_subparsers(dest="benchmark", required=True)
    for name, help_text in BENCHMARKS.items():
        bench_parser = sub.add_parser(name, help=help_text)
        importlib.import_module(f"anima_ui.bench.{name}").add_arguments(bench_parser)


def run(args) -> int:
    return importlib.import_module(f"anima_ui.bench.{args.benchmark}").run(args)
