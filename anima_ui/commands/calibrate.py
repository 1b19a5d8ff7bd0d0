"""`anima-ui calibrate --models DIR [--backend onnx] [--width W --height H]`: record the FFN inputs of every block
from real generations, for the W8A8 + low-rank FFNs (anima_ui/quant/capture.py says what is stored).

Run it where the real weights are, on a PC or on the board: with a graph backend (onnx, sim, rknn) only the
host tensors are loaded, never the fp32 DiT. Every prompt is a full sampling run (20 steps, CFG), so this
takes as long as generating one image per prompt; --calib-prompts / --heldout-prompts take fewer or other
prompts (one per line; an empty line is the empty prompt)."""

import sys
import time
from pathlib import Path

from anima_ui.errors import UserError
from anima_ui.runtime import BACKENDS


def add_arguments(parser):
    parser.add_argument("--models", required=True, help="model folder in the official layout")
    parser.add_argument("--backend", default="onnx", choices=BACKENDS, help="where the branches run while capturing (default onnx)")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--height", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--cfg", type=float, default=4.0)
    parser.add_argument("--negative", default="", help="the negative prompt of the uncond pass (default: empty)")
    parser.add_argument("--capture-steps", type=int, nargs="+", help="0-based steps to record (default: 8 across the schedule, first and last included)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens kept per block, step, prompt and CFG half (default 64)")
    parser.add_argument("--calib-prompts", type=Path, help="UTF-8 file, one prompt per line (default: 8 built-in, the empty one included)")
    parser.add_argument("--heldout-prompts", type=Path, help="UTF-8 file of other prompts, kept for the gate (default: 4 built-in)")
    parser.add_argument("--out", help="output folder (default: MODELS/calibration/WxH)")


def _prompts(path: Path | None, default: tuple[str, ...]) -> tuple[str, ...]:
    if path is None:
        return default
    if not path.is_file():
        raise UserError(f"prompt file {path} does not exist")
    prompts = tuple(line.strip() for line in path.read_text(encoding="utf-8").splitlines())
    if not prompts:
        raise UserError(f"prompt file {path} is empty: put one prompt per line")
    return prompts


def run(args) -> int:
    from anima_ui.modelfiles import ModelPaths
    from anima_ui.pipeline import Pipeline
    from anima_ui.quant.capture import CALIB_PROMPTS, HELDOUT_PROMPTS, CaptureSettings, capture, checkpoint_layer1

    if args.tokens < 1:
        raise UserError(f"--tokens must be at least 1, got {args.tokens}")
    settings = CaptureSettings(
        width=args.width, height=args.height, steps=args.steps, cfg=args.cfg, negative=args.negative,
        capture_steps=tuple(args.capture_steps or ()), tokens_per_capture=args.tokens,
        calib_prompts=_prompts(args.calib_prompts, CALIB_PROMPTS), heldout_prompts=_prompts(args.heldout_prompts, HELDOUT_PROMPTS),
        extra={"backend": args.backend},
    )
    paths = ModelPaths.find(args.models)
    graphs = paths.rknn_dir(args.width, args.height) if args.backend == "rknn" else paths.exported_dir(args.width, args.height)
    if args.backend != "torch" and not (graphs / "manifest.json").is_file():
        raise UserError(f"no graphs for {args.width}x{args.height} in {graphs}: run `anima-ui export` (and `convert-rknn` for rknn) first")
    pipeline = Pipeline.load(args.models, backend=args.backend)
    out = Path(args.out) if args.out else paths.root / "calibration" / f"{args.width}x{args.height}"
    started = time.perf_counter()
    runtime = None
    if args.backend == "torch":
        from anima_ui.model.reference import TorchBranches

        run_branch = TorchBranches(pipeline.weights, pipeline.config)
    else:
        from anima_ui.runtime import open_runtime

        run_branch = runtime = open_runtime(args.backend, graphs)
    try:
        progress = lambda line: print(line, file=sys.stderr, flush=True)
        folder = capture(pipeline.weights, pipeline.config, run_branch, lambda prompt: pipeline.contexts([prompt])[0],
                         checkpoint_layer1(pipeline.paths.dit), settings, out, progress=progress)
    finally:
        if runtime is not None:
            runtime.close()
    prompts = len(settings.calib_prompts) + len(settings.heldout_prompts)
    print(f"calibration of {pipeline.config.num_blocks} blocks from {prompts} prompts at steps {list(settings.steps_to_capture())} "
          f"written to {folder} in {time.perf_counter() - started:.0f} s")
    return 0
