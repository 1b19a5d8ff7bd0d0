"""`anima-ui generate`: text → image end to end. Progress goes to stderr; the last line on stdout is one JSON object."""

import json
import sys
from pathlib import Path

import numpy as np

from anima_ui.commands.pipeline_flags import add_pipeline_arguments, pipeline_options
from anima_ui.commands.spectrum_flags import add_spectrum_arguments, spectrum_config
from anima_ui.errors import UserError
from anima_ui.files import write_atomically
from anima_ui.history import save_png
from anima_ui.infotext import format_infotext
from anima_ui.modelfiles import ModelPaths
from anima_ui.pipeline import Pipeline, PhaseEvent, ResultEvent, StepEvent
from anima_ui.request import GenerationRequest
from anima_ui.runtime import BACKENDS
from anima_ui.runtime.auto import resolve as resolve_backend
from anima_ui.sampling.spectrum import SETTINGS
from anima_ui.text.prompt_file import read_prompt_file


def add_arguments(parser):
    parser.add_argument("--models", required=True, help="model folder in the official layout (models/README.md)")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the prompt text")
    prompt.add_argument("--prompt-file", help="read the prompt from a UTF-8 text file")
    parser.add_argument("--negative", default="", help="negative prompt (default: empty)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--cfg", type=float, default=4.0)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--height", type=int, default=512)
    parser.add_argument("--backend", default="auto", choices=("auto", *BACKENDS),
                        help="how the DiT branches run; auto (default): rknn where the NPU runtime and converted graphs are, "
                             "else torch where it fits in memory, else onnx (it prints what it chose and why)")
    add_pipeline_arguments(parser)
    parser.add_argument("--spectrum", nargs="?", const="on", default="off", choices=["off", *SETTINGS],
                        help="forecast steps instead of computing them: on (about half the model evaluations) or fast "
                             "(about half of on's again, at a larger error: docs/spectrum_quality.md); "
                             "--spectrum alone means on")
    add_spectrum_arguments(parser)
    parser.add_argument("--out", required=True, help="output PNG path")
    parser.add_argument("--save-latent", help="also save the final latent as float32 .npy, shape (1, 16, H/8, W/8)")


def run(args) -> int:
    out = Path(args.out)
    if out.suffix.lower() != ".png":
        raise UserError(f"--out must end in .png, got {args.out!r}")
    if not out.parent.is_dir():
        raise UserError(f"the output folder {out.parent} does not exist")
    request = GenerationRequest(  # checked here, before seconds are spent on loading the model
        prompt=args.prompt if args.prompt is not None else read_prompt_file(args.prompt_file),
        negative=args.negative,
        seed=args.seed,
        steps=args.steps,
        cfg=args.cfg,
        width=args.width,
        height=args.height,
        spectrum=args.spectrum != "off",
        spectrum_params=spectrum_config(args, args.spectrum),
    )
    ModelPaths.find(args.models)  # a broken model folder is the one error line, before any choice is printed
    backend, why = resolve_backend(args.backend, args.models, request.width, request.height)
    if why:
        print(why, file=sys.stderr, flush=True)
    pipeline = Pipeline.load(args.models, backend=backend, **pipeline_options(args))

    for event in pipeline.generate(request):
        if isinstance(event, PhaseEvent):
            print(f"[{event.phase}]", file=sys.stderr, flush=True)
            if event.phase == "denoise" and pipeline.choice is not None:
                print(pipeline.choice.describe(), file=sys.stderr, flush=True)  # how the graphs run, and why
        elif isinstance(event, StepEvent):
            kind = "computed" if event.info.computed else "forecast"
            print(f"step {event.step}/{event.info.total} {kind} {event.seconds:.2f}s", file=sys.stderr, flush=True)
        elif isinstance(event, ResultEvent):
            result = event
    if result.summary.get("warning"):
        print(f"warning: {result.summary['warning']}", file=sys.stderr)
    save_png(result.image, out, format_infotext(request, result.summary))
    if args.save_latent:
        write_atomically(Path(args.save_latent), lambda f: np.save(f, result.latent.astype(np.float32)))
    print(json.dumps(result.summary))
    return 0
