"""`anima-ui quantize-ffn --models DIR [--width W --height H] [--convert]`: W8A8 + FP16 low-rank FFN graphs from a
calibration folder (`anima-ui calibrate`), gated per block on held-out activations and end to end.

Per block: the transform (smoothing with α searched per layer, a rank-32 SVD branch, int8 residual weights),
the per-block gate (rank 32, higher α, rank 64, else FP16), the ONNX graph, and with --convert the hybrid RKNN
build in .venv-rknn with its op-table and simulator checks. Then the end-to-end gate: prompts × 2 seeds, the
whole schedule with CFG, emulated FFNs against the FP16 pipeline. Writes MODELS/quant/WxH (report.json says
what passed). The end-to-end gate samples 3 pipelines per prompt and seed: at full size on a PC that is hours."""

import sys
import time
from pathlib import Path

import numpy as np

from anima_ui.errors import UserError


def add_arguments(parser):
    parser.add_argument("--models", required=True, help="model folder in the official layout")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--height", type=int, default=512)
    parser.add_argument("--calibration", help="calibration folder (default: MODELS/calibration/WxH)")
    parser.add_argument("--convert", action="store_true", help="also build each passing block as hybrid RKNN and check it on the simulator")
    parser.add_argument("--ranks", type=int, nargs="+", default=[32, 64], help="low-rank branch ranks to try, in order (default 32 64)")
    parser.add_argument("--backend", choices=("torch", "onnx"), default="onnx",
                        help="attention branches of the end-to-end gate: torch (fp32 DiT in memory) or the exported fp32 ONNX graphs")
    parser.add_argument("--prompts", type=int, default=4, help="end-to-end prompts (2 seeds each; default 4)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--cfg", type=float, default=4.0)
    parser.add_argument("--no-end-to-end", action="store_true", help="skip the end-to-end gate (the result then does not pass)")
    parser.add_argument("--out", help="output folder (default: MODELS/quant/WxH)")


def run(args) -> int:
    from anima_ui.modelfiles import ModelPaths
    from anima_ui.pipeline import Pipeline
    from anima_ui.quant.build import ffn_weights, quantize_model
    from anima_ui.quant.capture import read_calibration
    from anima_ui.quant.e2e import PROMPTS, end_to_end

    if not 1 <= args.prompts <= len(PROMPTS):
        raise UserError(f"--prompts must be from 1 to {len(PROMPTS)}, got {args.prompts}")
    if any(r < 1 for r in args.ranks):
        raise UserError(f"--ranks must be positive, got {args.ranks}")
    size = f"{args.width}x{args.height}"
    paths = ModelPaths.find(args.models)
    calibration = Path(args.calibration) if args.calibration else paths.root / "calibration" / size
    meta, blocks = read_calibration(calibration)  # before loading anything: a missing calibration fails at once
    if (meta["width"], meta["height"]) != (args.width, args.height):
        raise UserError(f"{calibration} was captured at {meta['width']}x{meta['height']}, not {size}: pass --width/--height to match")
    pipeline = Pipeline.load(args.models, backend=args.backend)
    config = pipeline.config
    if len(blocks) != config.num_blocks:
        raise UserError(f"{calibration} has {len(blocks)} blocks, the model {config.num_blocks}: calibrate this model again")
    shape = (1, (args.height // 16) * (args.width // 16), config.width)
    out = Path(args.out) if args.out else pipeline.paths.root / "quant" / size
    progress = lambda line: print(line, file=sys.stderr, flush=True)

    def e2e(emulators):
        from anima_ui.vae.decode import decode_latent

        weights = {b: ffn_weights(pipeline.paths.dit, b) for b in range(config.num_blocks)}
        run_branch, runtime = _attention_branches(pipeline, args)
        decode = lambda latent: np.asarray(decode_latent(latent, pipeline.paths.vae, prefer=pipeline.decoder)[0])
        try:
            return end_to_end(pipeline.weights, config, run_branch, lambda prompt: pipeline.contexts([prompt])[0], decode, weights, emulators,
                              prompts=PROMPTS[:args.prompts], steps=args.steps, cfg=args.cfg, width=args.width,
                              height=args.height, negative=meta["negative"], progress=progress)
        finally:
            if runtime is not None:
                runtime.close()

    started = time.perf_counter()
    report = quantize_model(pipeline.paths.dit, blocks, shape, out, convert=args.convert, ranks=tuple(args.ranks),
                            end_to_end=None if args.no_end_to_end else e2e, progress=progress)
    _print_report(report)
    print(f"{len(report['quantized_blocks'])} of {config.num_blocks} FFNs quantized; "
          f"{'PASSED' if report['passed'] else 'NOT passed'}; {out} in {time.perf_counter() - started:.0f} s")
    return 0 if report["passed"] else 1


def _attention_branches(pipeline, args):
    if args.backend == "torch":
        from anima_ui.model.reference import TorchBranches

        return TorchBranches(pipeline.weights, pipeline.config), None
    from anima_ui.runtime import open_runtime

    graphs = pipeline.paths.exported_dir(args.width, args.height)
    if not (graphs / "manifest.json").is_file():
        raise UserError(f"no exported graphs in {graphs}: run `anima-ui export --width {args.width} --height {args.height}` first")
    runtime = open_runtime("onnx", graphs)
    return runtime, runtime


def _print_report(report: dict) -> None:
    print(f"{'block':>5} {'result':>10} {'rank':>5} {'α1/α2':>9} {'FFN cos':>10} {'rel err':>8} {'resid err':>10} {'× FP16':>7}")
    for entry in report["blocks"]:
        best = entry["tries"][-1]
        result = "int8" if entry["quantized"] else "FP16"
        print(f"{entry['block']:>5} {result:>10} {best['rank']:>5} {best['alpha1']:.1f}/{best['alpha2']:.1f} {best['cosine']:>10.6f} "
              f"{best['rel_error']:>8.2%} {best['residual_error']:>10.2e} {best['residual_vs_fp16']:>7.1f}")
        if not entry["quantized"]:
            print(f"      {entry.get('reason', '')}")
    e2e = report.get("end_to_end")
    if e2e:
        t = e2e["thresholds"]
        print(f"end to end vs the FP16 pipeline (thresholds: latent cosine ≥ {t['min_latent_cosine']:.5f}, "
              f"PSNR ≥ {t['min_psnr_db']:.1f} dB, SSIM ≥ {t['min_ssim']:.4f}):")
        for row in e2e["rows"]:
            m, f = row["quant_vs_fp16"], row["fp16_vs_fp32"]
            print(f"  seed {row['seed']:>9} cos {m['latent_cosine']:.6f} PSNR {m['psnr_db']:6.2f} dB SSIM {m['ssim']:.5f}"
                  f"   (FP16 vs fp32: {f['psnr_db']:6.2f} dB)  {row['prompt'][:40]!r}")
        for s in e2e["seed_spread"]:
            print(f"  two seeds' FP16 images: cos {s['latent_cosine']:.4f} PSNR {s['psnr_db']:.2f} dB SSIM {s['ssim']:.4f}  {s['prompt'][:40]!r}")
        for failure in e2e["failures"]:
            print(f"  failed: {failure}")
