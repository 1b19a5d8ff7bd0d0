"""`anima-ui serve` (and `python app.py`): start the Gradio app on the LAN."""

import os
from pathlib import Path

from anima_ui.commands.pipeline_flags import add_pipeline_arguments, pipeline_options
from anima_ui.jobs import PIXEL_STEP_BUDGETS, QueueLimits
from anima_ui.runtime import BACKENDS
from anima_ui.runtime.auto import resolve as resolve_backend
from anima_ui.runtime.profile import find_profiles
from anima_ui.ui.app import App, AppConfig
from anima_ui.ui.guards import CALLS_BURST, CALLS_PER_SECOND
from anima_ui.ui.system import public_url


def add_arguments(parser):
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0: every interface, so phones on the LAN reach it)")
    parser.add_argument("--port", type=int, default=7860)
    parser.add_argument("--models", default="models", help="model folder in the official layout (models/README.md)")
    parser.add_argument("--backend", default="auto", choices=("auto", *BACKENDS),
                        help="how the DiT branches run; auto (default): rknn where the NPU runtime and converted graphs are, "
                             "else torch where it fits in memory, else onnx (it prints what it chose and why)")
    parser.add_argument("--outputs", default="outputs", help="where finished PNGs and their JSON sidecars go")
    parser.add_argument("--presets", default="presets", help="folder of preset JSON files (read-only: users cannot change them)")
    parser.add_argument("--user-presets", default=None, help="where presets users save go (default: OUTPUTS/presets)")
    parser.add_argument("--password", default=None, help="require this password (default: $ANIMA_UI_PASSWORD, else none)")
    parser.add_argument("--demo", action="store_true", help="use a random-weight tiny model made under ~/.cache/anima-ui")
    limits = parser.add_argument_group("limits (0: none)")
    limits.add_argument("--max-queue", type=int, default=QueueLimits.max_jobs,
                        help=f"jobs in line at most, the running one included (default {QueueLimits.max_jobs})")
    limits.add_argument("--max-jobs-per-device", type=int, default=QueueLimits.max_jobs_per_client,
                        help=f"jobs in line from one device (client address) (default {QueueLimits.max_jobs_per_client})")
    budgets = ", ".join(f"{b} {v / 2**20:g}" for b, v in PIXEL_STEP_BUDGETS.items())
    limits.add_argument("--max-megapixel-steps", type=float, default=None,
                        help=f"the largest job, width x height x steps in 2^20 pixels (1024x1024 at 30 steps is 30); "
                             f"default by backend: {budgets}")
    limits.add_argument("--max-calls-per-second", type=float, default=CALLS_PER_SECOND,
                        help=f"calls (queue joins, uploads) one device may make per second, after a burst of "
                             f"{CALLS_BURST} (default {CALLS_PER_SECOND:g})")
    limits.add_argument("--max-upload-mb", type=int, default=32, help="largest PNG the restore box takes (default 32)")
    add_pipeline_arguments(parser)


def run(args) -> int:
    models = Path(args.models)
    if args.demo:
        from anima_ui.fixtures.model import demo_model_dir  # its VAE shape tables import torch (optional)

        models = demo_model_dir()
        print(f"demo mode: random-weight tiny model in {models}")
    backend, why = resolve_backend(args.backend, models)
    if why:
        print(why)
    config = AppConfig(
        models_dir=models,
        backend=backend,
        outputs_dir=Path(args.outputs),
        presets_dir=Path(args.presets),
        host=args.host,
        port=args.port,
        password=args.password or os.environ.get("ANIMA_UI_PASSWORD") or None,
        demo=args.demo,
        pipeline_options=pipeline_options(args),
        user_presets_dir=Path(args.user_presets) if args.user_presets else None,
        queue_limits=queue_limits(backend, args),
        max_upload_mb=args.max_upload_mb or None,
        calls_per_second=args.max_calls_per_second or None,
    )
    if args.backend != "torch" and not args.no_tune_profile:
        for profile in find_profiles(models, args.backend):
            print(f"using the tune profile for {profile.summary()}")
    app = App(config)
    if app.missing:
        print(f"model not ready: {app.missing} (the page offers the download)")
    print(f"open {public_url(args.host, args.port)} on a phone on the same network"
          + (" (password required)" if config.password else ""))
    app.launch()
    return 0


def queue_limits(backend: str, args) -> QueueLimits:
    overrides = {"max_jobs": args.max_queue or None, "max_jobs_per_client": args.max_jobs_per_device or None}
    if args.max_megapixel_steps is not None:
        overrides["max_pixel_steps"] = int(args.max_megapixel_steps * 2**20) or None
    return QueueLimits.for_backend(backend, **overrides)
