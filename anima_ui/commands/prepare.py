"""`anima-ui prepare --models DIR [--width W --height H] [--target rk3588] [--jobs N] [--mirror URL] [--no-decoder]
[--ffn w8a8-lowrank] [--decoder-layouts L,...]`."""

from anima_ui.convert.prepare import PREPARE_FFNS, prepare
from anima_ui.vae.npu_graphs import CONVERT_FLOOR_GIB, CONVERT_PEAK_GIB_512, LAYOUTS


def add_arguments(parser):
    parser.add_argument("--models", required=True, help="model folder (created if missing; files already there are kept)")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--height", type=int, default=512)
    parser.add_argument("--target", default="rk3588")
    parser.add_argument("--jobs", type=int, default=1, help="RKNN conversions in parallel (each needs up to ~2 GB at full size)")
    parser.add_argument("--mirror", help="download every file from MIRROR/<its path in the model folder> instead of the "
                                         "official sources (a folder as file:///path, or a LAN server)")
    parser.add_argument("--ffn", choices=PREPARE_FFNS, default="fp16",
                        help="w8a8-lowrank: also the W8A8 + FP16 low-rank FFN graphs from MODELS/quant/WxH (made from "
                             "`anima-ui calibrate`'s MODELS/calibration/WxH if missing); installed only if they passed every gate")

    parser.add_argument("--no-decoder", action="store_true", help="leave out the NPU decoder's graphs (sd.cpp decodes)")
    peaks = ", ".join(f"{peak:g} GiB {layout}" for layout, peak in CONVERT_PEAK_GIB_512.items())
    parser.add_argument("--decoder-layouts", metavar="L,...",
                        type=lambda text: [part.strip() for part in text.split(",") if part.strip()],
                        help=f"NPU decoder layouts to convert, comma-separated ({','.join(LAYOUTS)}); default: those whose "
                             f"conversion fits in MemAvailable minus {CONVERT_FLOOR_GIB:g} GiB (at 512x512 it peaks at "
                             f"{peaks}, in proportion to the pixels at other sizes; an 8 GB board keeps halo)")


def run(args) -> int:
    prepare(args.models, args.width, args.height, args.target, args.mirror, jobs=args.jobs, decoder=not args.no_decoder,
            ffn=args.ffn, decoder_layouts=args.decoder_layouts)
    return 0
