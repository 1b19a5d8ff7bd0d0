"""The flags of the commands that open a branch runtime (generate, serve, verify, bench runtime, tune), and the
keyword arguments they become."""

from anima_ui.errors import UserError
from anima_ui.model.config import BRANCH_KINDS
from anima_ui.runtime.backends import CORE_MASKS
from anima_ui.runtime.board_latency import CONTENTION
from anima_ui.runtime.memory import SWAP_POLICIES
from anima_ui.runtime.quantized_ffn import FFN_CHOICES
from anima_ui.runtime.variants import VARIANTS, Plan, parse_variants


def add_gate_arguments(parser):
    parser.add_argument("--mem-floor-gib", type=float, default=1.5,
                        help="memory gate: open no graph context while MemAvailable is under this many GiB (default 1.5)")
    parser.add_argument("--swap-policy", choices=SWAP_POLICIES, default="wait",
                        help="memory gate: wait (hold contexts back while pages are being swapped in; refuse after 30 s) "
                             "or ignore (swap is only shown); swap that grew once and stays is never a reason to refuse")
    parser.add_argument("--mem-wait-seconds", type=float, default=30.0,
                        help="memory gate: how long a context waits for memory before the run stops (default 30)")


def gate_options(args) -> dict:
    return {"mem_floor_gib": args.mem_floor_gib, "swap_policy": args.swap_policy, "gate_wait_seconds": args.mem_wait_seconds}


def add_runtime_arguments(parser, profile: bool = True, variants: bool = True):
    if variants:
        parser.add_argument("--variant", default=None,
                            help="how the branch graphs run: one variant for every kind, or per kind "
                                 "(self_attn=NAME,cross_attn=NAME,mlp=NAME); " + "; ".join(f"{v.name}: {v.about}" for v in VARIANTS.values()))
        parser.add_argument("--no-prefetch", action="store_true", help="serial branch lifecycle, as the blog ran it (= --variant serial)")
    parser.add_argument("--max-contexts", type=int, default=None, help="K: graph contexts each prefetching chain keeps open (default 2)")
    parser.add_argument("--core-mask", default="auto", choices=CORE_MASKS,
                        help="rknn backend: NPU cores of the serial and prefetch variants (the others name their own)")
    parser.add_argument("--wait-for-inference", action="store_true",
                        help="first-run safety: init and release of a context wait until no inference runs on the NPU")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="sim backend: scale the board's latencies (0.01 runs a 20-step job in seconds)")
    parser.add_argument("--contention", default="none", choices=CONTENTION,
                        help="sim backend: how two NPU cores working at once slow each other (none, or 1.78x: two UNets)")
    parser.add_argument("--resident-sessions", default=None, choices=("auto", "all", "none"),
                        help="onnx/sim: keep onnxruntime sessions open between visits (onnx default auto: as many as "
                             "MemAvailable allows; sim default none: it holds what the board holds)")
    if profile:
        parser.add_argument("--no-tune-profile", action="store_true",
                            help="ignore the profile `anima-ui tune` wrote into the graphs folder")
    add_gate_arguments(parser)


def runtime_options(args) -> dict:
    variant, no_prefetch = getattr(args, "variant", None), getattr(args, "no_prefetch", False)
    if variant and no_prefetch:
        raise UserError("--variant and --no-prefetch both choose how the graphs run: give one")
    variants = parse_variants(variant) if variant else dict.fromkeys(BRANCH_KINDS, "serial") if no_prefetch else None
    return {
        "variants": variants,
        "contexts": args.max_contexts,
        "core_mask": args.core_mask,
        "wait_for_inference": args.wait_for_inference,
        "use_profile": not getattr(args, "no_tune_profile", False),
        "time_scale": args.time_scale,
        "contention": args.contention,
        "resident": args.resident_sessions,
        **gate_options(args),
    }


def add_pipeline_arguments(parser):
    parser.add_argument("--decoder", default=None,
                        help="final VAE decode: sdcpp (stable-diffusion.cpp, tiled; the board's choice), onnx (the "
                             "project's decoder graphs on onnxruntime, tiled like sd.cpp; faster than sdcpp on x86 PCs) "
                             "or npu (the decoder graphs on the --backend runtime: the NPU, or the simulated board); "
                             "anima-ui bench vae compares them; default: the tune profile's choice, else sdcpp")
    parser.add_argument("--ffn", choices=FFN_CHOICES, default="auto",
                        help="FFN graphs: w8a8-lowrank (installed by `prepare --ffn w8a8-lowrank`), fp16, or auto (the "
                             "quantized ones where the tune profile timed them faster than FP16 and they passed its "
                             "checks, else FP16)")
    add_runtime_arguments(parser)


def pipeline_options(args) -> dict:
    return {"decoder": args.decoder, "ffn": args.ffn, **runtime_options(args)}


def runtime_plan(args):
    """The plan the flags ask for, for commands that read no tune profile (verify, bench): prefetch by default."""
    options = runtime_options(args)
    return Plan(options["variants"] or dict.fromkeys(BRANCH_KINDS, "prefetch"), contexts=options["contexts"] or 2,
                core_mask=options["core_mask"], wait_for_inference=options["wait_for_inference"])


def open_options(args) -> dict:
    """open_runtime's keyword arguments from the flags (besides the plan)."""
    options = runtime_options(args)
    return {name: options[name] for name in ("time_scale", "contention", "resident", "mem_floor_gib", "swap_policy", "gate_wait_seconds")}
