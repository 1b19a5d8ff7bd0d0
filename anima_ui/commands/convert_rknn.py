"""`anima-ui convert-rknn --onnx DIR --out DIR [--target rk3588]`: FP16 RKNN graphs, simulator-verified."""

import sys
import time


def add_arguments(parser):
    parser.add_argument("--onnx", required=True, help="an `anima-ui export` folder (fp32 graphs recommended)")
    parser.add_argument("--out", required=True, help="output folder (the board reads MODELS/rknn/WxH)")
    parser.add_argument("--target", default="rk3588")


def run(args) -> int:
    # convert_rknn imports the ONNX exporter's folder helper, and the exporter needs torch (optional), `--help` not
    from anima_ui.convert.convert_rknn import convert_rknn

    started = time.perf_counter()
    progress = lambda line: print(line, file=sys.stderr, flush=True)
    manifest = convert_rknn(args.onnx, args.out, args.target, progress=progress)
    worst = min(g.extra["sim_cosine"] for g in manifest.graphs)
    print(f"{len(manifest.graphs)} graphs converted with rknn-toolkit2 {manifest.tools['rknn-toolkit2']} for {args.target} "
          f"in {time.perf_counter() - started:.1f} s; lowest simulator cosine {worst:.7f}; in {args.out}")
    return 0
