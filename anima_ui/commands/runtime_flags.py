"""The branch-runtime flags that `generate` and `serve` share, and the options they become for `open_runtime`."""


def add_runtime_arguments(parser):
    parser.add_argument("--no-prefetch", action="store_true", help="serial branch lifecycle, as the blog ran it")
    parser.add_argument("--max-contexts", type=int, default=2, help="graph contexts alive at once with prefetch")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="sim backend: scale the board's latencies (0.01 runs a 20-step job in seconds)")
    parser.add_argument("--core-mask", default="auto", help="rknn backend: NPU cores (auto, 0, 1, 2, 0_1, 0_1_2, all)")


def runtime_options(args) -> dict:
    return {
        "prefetch": not args.no_prefetch,
        "max_contexts": args.max_contexts,
        "time_scale": args.time_scale,
        "core_mask": args.core_mask,
    }
