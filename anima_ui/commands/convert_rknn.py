"""`anima-ui convert-rknn --onnx DIR --out DIR [--target rk3588] [--jobs N]`: FP16 RKNN graphs, simulator-verified."""

import sys
import time

from anima_ui.convert.convert_rknn import convert_rknn


def add_arguments(parser):
    parser.add_argument("--onnx", required=True, help="an `anima-ui export` folder (fp32 graphs recommended)")
    parser.add_argument("--out", required=True, help="output folder (the board reads MODELS/rknn/WxH)")
    parser.add_argument("--target", default="rk3588")
    parser.add_argument("--jobs", type=int, default=1, help="conversions in parallel (each needs up to ~2 GB at full size)")


def run(args) -> int:
    started = time.perf_counter()

    def progress(done, total, file, seconds, reused, result):
        state = "kept (finished earlier)" if reused else f"built and checked in {seconds:.1f} s, simulator cosine {result['sim_cosine']:.7f}"
        print(f"[{done}/{total}] {file}: {state}", file=sys.stderr, flush=True)

    manifest = convert_rknn(args.onnx, args.out, args.target, progress=progress, jobs=args.jobs)
    worst = min(g.extra["sim_cosine"] for g in manifest.graphs)
    print(f"{len(manifest.graphs)} graphs converted with rknn-toolkit2 {manifest.tools['rknn-toolkit2']} for {args.target} "
          f"in {time.perf_counter() - started:.1f} s; lowest simulator cosine {worst:.7f}; in {args.out}")
    return 0
