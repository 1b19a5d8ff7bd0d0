"""`anima-ui prepare --models DIR [--width W --height H] [--target rk3588] [--jobs N] [--mirror URL] [--no-decoder]
[--ffn w8a8-lowrank]`."""

from anima_ui.convert.prepare import PREPARE_FFNS, prepare


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

    parser.add_argument("--no-decoder", action="store_true",
                        help="leave out the NPU decoder's graphs (sd.cpp decodes); at 512x512 their simulator checks peak at "
                             "6 GB (untiled) and 10.5 GB (the batch of tiles), more than a board has")


def run(args) -> int:
    prepare(args.models, args.width, args.height, args.target, args.mirror, jobs=args.jobs, decoder=not args.no_decoder,
            ffn=args.ffn)
    return 0
