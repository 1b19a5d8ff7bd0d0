"""`anima-ui quantize-ffn --models DIR [--width W --height H] [--convert]`: W8A8 + FP16 low-rank FFN graphs from a
calibration folder (`anima-ui calibrate`), gated per block on held-out activations and end to end.

Per block: the transform (smoothing with α searched per layer, a rank-32 SVD branch, int8 residual weights),
the per-block gate (rank 32, higher α, rank 64, else FP16), the ONNX graph, and with --convert the hybrid RKNN
build in .venv-rknn with its op-table and simulator checks. Then the end-to-end gate: prompts × 2 seeds, the
whole schedule with CFG, emulated FFNs against the FP16 pipeline. Writes MODELS/quant/WxH (report.json says
what passed). The end-to-end gate samples 3 pipelines per prompt and seed: at full size on a PC that is hours."""

import sys
import time

from anima_ui.errors import UserError
from anima_ui.quant.build import quantize_models_folder
from anima_ui.quant.e2e import PROMPTS


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
    if not 1 <= args.prompts <= len(PROMPTS):
        raise UserError(f"--prompts must be from 1 to {len(PROMPTS)}, got {args.prompts}")
    if any(r < 1 for r in args.ranks):
        raise UserError(f"--ranks must be positive, got {args.ranks}")
    started = time.perf_counter()
    report, out = quantize_models_folder(
        args.models, args.width, args.height, convert=args.convert, ranks=tuple(args.ranks), backend=args.backend,
        prompts=args.prompts, steps=args.steps, cfg=args.cfg, end_to_end=not args.no_end_to_end,
        calibration=args.calibration, out=args.out, progress=lambda line: print(line, file=sys.stderr, flush=True))
    _print_report(report)
    print(f"{len(report['quantized_blocks'])} of {len(report['blocks'])} FFNs quantized; "
          f"{'PASSED' if report['passed'] else 'NOT passed'}; {out} in {time.perf_counter() - started:.0f} s")
    return 0 if report["passed"] else 1


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
