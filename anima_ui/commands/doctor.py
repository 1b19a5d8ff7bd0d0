"""`anima-ui doctor`: the first command on a board. Checks the NPU stack bottom up (driver and device node, the
user's access, rknn-toolkit-lite2, librknnrt.so and its version against the toolkit that converted the graphs),
memory and swap, the model files and the hashes the manifests record, then runs one converted graph on the NPU
and compares it with its ONNX twin on onnxruntime. Prints a table (a fix under each failed row), then a
one-line verdict. Exit 0 when the NPU path works end to end, else 1."""

import sys

from anima_ui.checkup import collect, verdict
from anima_ui.runtime.backends import CORE_MASKS

MARKS = {"ok": "ok", "warn": "WARN", "fail": "FAIL", "absent": "--", "skip": "skip"}


def add_arguments(parser):
    parser.add_argument("--models", default="models", help="model folder in the official layout (default: models)")
    parser.add_argument("--width", type=int, default=None, help="the converted size to run (default: the first converted one)")
    parser.add_argument("--height", type=int, default=None)
    parser.add_argument("--core-mask", default="auto", choices=CORE_MASKS, help="NPU cores for the graph run")
    parser.add_argument("--quick", action="store_true",
                        help="leave out the file hashes and the NPU run (seconds instead of minutes; what scripts/setup.sh runs)")


def run(args) -> int:
    report = collect(args.models, args.width, args.height, quick=args.quick, core_mask=args.core_mask,
                     progress=lambda line: print(line, file=sys.stderr, flush=True))
    width = max(len(r.check) for r in report.rows)
    for row in report.rows:
        print(f"{row.check:<{width}}  {MARKS[row.status]:<4}  {row.value}")
        if row.fix:
            print(f"{'':<{width}}        fix: {row.fix}")
    ready, line = verdict(report)
    print(line)
    return 0 if ready else 1
