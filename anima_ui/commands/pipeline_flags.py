"""The pipeline flags that `generate` and `serve` share (VAE decoder, branch runtime), and the keyword
arguments they become for `Pipeline.load`."""


def add_pipeline_arguments(parser):
    parser.add_argument("--decoder", default="sdcpp",
                        help="final VAE decode: sdcpp (stable-diffusion.cpp, tiled; the board's choice), onnx (the "
                             "project's decoder graphs on onnxruntime, tiled like sd.cpp; faster than sdcpp on x86 PCs) "
                             "or npu (the decoder graphs on the --backend runtime: the NPU, or the simulated board); "
                             "anima-ui bench vae compares them")
    parser.add_argument("--no-prefetch", action="store_true", help="serial branch lifecycle, as the blog ran it")
    parser.add_argument("--max-contexts", type=int, default=2, help="graph contexts alive at once with prefetch")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="sim backend: scale the board's latencies (0.01 runs a 20-step job in seconds)")
    parser.add_argument("--core-mask", default="auto", help="rknn backend: NPU cores (auto, 0, 1, 2, 0_1, 0_1_2, all)")


def pipeline_options(args) -> dict:
    return {
        "decoder": args.decoder,
        "prefetch": not args.no_prefetch,
        "max_contexts": args.max_contexts,
        "time_scale": args.time_scale,
        "core_mask": args.core_mask,
    }
