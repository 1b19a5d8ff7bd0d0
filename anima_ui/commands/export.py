"""`anima-ui export --models DIR --width W --height H [--out DIR] [--dtype fp16|fp32] [--batch 1|2]`."""

import sys
from pathlib import Path

from anima_ui.convert.model_graphs import export_model_graphs
from anima_ui.modelfiles import ModelPaths


def add_arguments(parser):
    parser.add_argument("--models", required=True, help="model folder in the official layout")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--height", type=int, default=512)
    parser.add_argument("--out", help="output folder (default: MODELS/exported/WxH, or WxH-b2 for --batch 2, where generate looks)")
    parser.add_argument("--dtype", choices=("fp32", "fp16"), default="fp32",
                        help="graph precision (fp32 for onnxruntime and as RKNN input; the RKNN build makes FP16 itself)")
    parser.add_argument("--batch", type=int, choices=(1, 2), default=1, help="2: cond and uncond in one call")


def run(args) -> int:
    paths = ModelPaths.find(args.models)
    out = Path(args.out) if args.out else paths.exported_dir(args.width, args.height, args.batch)

    def progress(done, total, file, seconds, reused):
        print(f"[{done}/{total}] {file}: {'kept (finished earlier)' if reused else f'built in {seconds:.1f} s'}", file=sys.stderr, flush=True)

    manifest = export_model_graphs(paths, args.width, args.height, out, args.dtype, args.batch, progress)
    print(f"{len(manifest.graphs)} graphs ({args.dtype}, batch {args.batch}, {args.width}x{args.height}) in {out}")
    return 0
