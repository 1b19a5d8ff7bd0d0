"""`anima-ui bench quant`: the W8A8 + low-rank FFNs on the synthetic outlier model, and one full-size FFN
through the toolkit.

Part 1 writes the synthetic outlier model (random weights in the official layout, 20-50x FFN input channels and
weight columns; anima_ui/fixtures/outliers.py), captures its calibration with `calibrate`'s code on the torch
backend, and prints per block, on the held-out prompts against the float32 FFN: FP16, plain W8A8 (the toolkit's
own build, emulated), smoothing alone, and smoothing + low-rank at each rank (α searched per layer), each with the
FFN's cosine and relative error and the error it adds to the residual stream. Then the end-to-end gate against the
FP16 pipeline with every FFN plain W8A8, and with every FFN at each rank (ungated, to show each alone).

Part 2 (--fullsize MODELS): one block's FFN of a full-size model (2048 -> 8192 -> 2048, 1024 tokens = 512x512)
with synthetic outlier inputs (a random model has none), transformed at rank 32 and built four ways with
rknn-toolkit2: FP16, the toolkit's W8A8, and hybrid W8A8 + low-rank twice: with layer 2's residual GEMM whole
(K = 8192, which the compiler tiles into INT8 Convs chained by INT8 ConvAdds) and split into K pieces
(quant/ffn.py k_pieces, what quantize-ffn builds). Per build: build time, .rknn size, the compiler's modelled
cycles and memory traffic, the simulator's error against float32 with the per-block FFN gate, and the emulator
against the simulator. It needs about 2 GB and some minutes."""

import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np

from anima_ui.errors import UserError
from anima_ui.model.checkpoint import load_dit
from anima_ui.model.onnx_graph import write_model
from anima_ui.model.reference import TorchBranches
from anima_ui.modelfiles import ModelPaths
from anima_ui.quant.build import MAX_EMULATOR_GAP, ffn_weights
from anima_ui.quant.convert import convert_ffn, hybrid_op_problems
from anima_ui.quant.capture import CaptureSettings, capture, checkpoint_layer1, read_calibration
from anima_ui.quant.e2e import PROMPTS, EndToEnd, emulators_of, end_to_end
from anima_ui.quant.ffn import MAX_INT8_K, emulate, emulate_plain, quantize_ffn
from anima_ui.quant.gate import MAX_FFN_REL_ERROR, MIN_FFN_COSINE, cosine, measure, onnx_reference, passes, rel_error
from anima_ui.quant.graph import float_ffn_model, quantized_ffn_model
from anima_ui.quant.numerics import ffn_fp16, ffn_fp32
from anima_ui.text.encoder import TextEncoder
from anima_ui.vae.decode import decode_latent
from anima_ui.fixtures.outliers import write_outlier_model


def add_arguments(parser):
    parser.add_argument("--width", type=int, default=64, help="DiT width of the synthetic model (64: the tiny model's; 256: the study's FFN)")
    parser.add_argument("--mlp", type=int, help="FFN hidden width (default 4 x width)")
    parser.add_argument("--image", type=int, default=64, help="square image size of the calibration and end-to-end runs")
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--prompts", type=int, default=4, help="end-to-end prompts (2 seeds each)")
    parser.add_argument("--tokens", type=int, default=64, help="calibration tokens per capture")
    parser.add_argument("--fullsize", type=Path, help="a full-size model folder: also run part 2 on its block 0 FFN")
    parser.add_argument("--skip-synthetic", action="store_true", help="only part 2")


def run(args) -> int:
    if not args.skip_synthetic:
        with tempfile.TemporaryDirectory(prefix="bench_quant_") as tmp:
            _synthetic(args, Path(tmp))
    if args.fullsize:
        _fullsize(args.fullsize)
    return 0


# -- part 1 -----------------------------------------------------------------------------------------------------------
def _synthetic(args, tmp: Path) -> None:
    started = time.perf_counter()
    folder, chosen = write_outlier_model(tmp / "outliers", seed=0, width=args.width, mlp_dim=args.mlp or 4 * args.width)
    paths = ModelPaths.find(folder)
    config, state = load_dit(paths.dit)
    encoder = TextEncoder.load(paths)
    encode = lambda prompt: encoder.encode([prompt])[0]
    branches = TorchBranches(state, config)
    settings = CaptureSettings(width=args.image, height=args.image, tokens_per_capture=args.tokens)
    capture(state, config, branches, encode, checkpoint_layer1(paths.dit), settings, tmp / "calibration")
    _, blocks = read_calibration(tmp / "calibration")
    print(f"synthetic outlier model: width {config.width}, FFN {config.width}->{config.mlp_dim}, {config.num_blocks} blocks, "
          f"outlier input channels {[c['activation'] for c in chosen.values()]}, weight columns {[c['weight'] for c in chosen.values()]}; "
          f"calibration {len(blocks[0].calib_x)} tokens, held out {len(blocks[0].heldout_x)} ({time.perf_counter() - started:.0f} s)")
    print(f"{'block':>5} {'FFN':<24} {'α1/α2':>9} {'cosine':>10} {'rel err':>8} {'resid err':>10} {'× FP16':>7} {'gate':>5}")
    weights = {b: ffn_weights(paths.dit, b) for b in range(config.num_blocks)}
    by_rank = {rank: {} for rank in args.ranks}
    for block, calib in enumerate(blocks):
        w1, w2 = weights[block]
        x = calib.heldout_x
        reference = onnx_reference(w1, w2, x)
        fp16 = measure(ffn_fp16(x, w1, w2), reference, calib)
        rows = [("FP16", "", fp16), ("plain W8A8 (toolkit)", "", measure(emulate_plain(w1, w2, calib.calib_x, x), reference, calib))]
        for rank in [0, *args.ranks]:
            q = quantize_ffn(w1, w2, calib.calib_x, rank, calib.amax_x, calib.amax_hidden)
            name = "smoothing alone" if rank == 0 else f"smoothing + rank {rank}"
            rows.append((name, f"{q.alpha1:.1f}/{q.alpha2:.1f}", measure(emulate(q, x / q.smooth_in), reference, calib)))
            if rank:
                by_rank[rank][block] = q
        for name, alphas, m in rows:
            print(f"{block:>5} {name:<24} {alphas:>9} {m['cosine']:>10.6f} {m['rel_error']:>8.2%} {m['residual_error']:>10.2e} "
                  f"{m['residual_error'] / fp16['residual_error']:>7.1f} {'pass' if passes(m) else 'fail':>5}")

    decode = lambda latent: np.asarray(decode_latent(latent, paths.vae, prefer="onnx")[0])
    run_e2e = partial(end_to_end, state, config, branches, encode, decode, weights, prompts=PROMPTS[:args.prompts],
                      width=args.image, height=args.image)
    plain = {b: partial(emulate_plain, *weights[b], calib.calib_x) for b, calib in enumerate(blocks)}
    results = {"plain W8A8 (toolkit)": run_e2e((plain, {}))}
    results.update({f"smoothing + rank {rank}": run_e2e(emulators_of(by_rank[rank])) for rank in args.ranks})
    _print_e2e(results, args)


def _print_e2e(results: dict[str, EndToEnd], args) -> None:
    any_result = next(iter(results.values()))
    t = any_result.thresholds()
    spread = any_result.seed_spread
    fp32 = [r["fp16_vs_fp32"] for r in any_result.rows]
    print(f"\nend to end, {args.prompts} prompts x 2 seeds, 20 steps, CFG 4, {args.image}x{args.image}, against the FP16 pipeline "
          f"(worst row; thresholds: latent cosine >= {t['min_latent_cosine']:.5f}, PSNR >= {t['min_psnr_db']:.1f} dB, SSIM >= {t['min_ssim']:.4f})")
    print(f"{'FFNs':<24} {'latent cos':>11} {'PSNR dB':>8} {'SSIM':>7} {'gate':>5}")
    for name, result in results.items():
        rows = [r["quant_vs_fp16"] for r in result.rows]
        print(f"{name:<24} {min(r['latent_cosine'] for r in rows):>11.6f} {min(r['psnr_db'] for r in rows):>8.2f} "
              f"{min(r['ssim'] for r in rows):>7.4f} {'pass' if result.passed else 'fail':>5}")
    print(f"{'(FP16 vs fp32)':<24} {min(r['latent_cosine'] for r in fp32):>11.6f} {min(r['psnr_db'] for r in fp32):>8.2f} {min(r['ssim'] for r in fp32):>7.4f}")
    print(f"{'(two seeds, FP16)':<24} {max(r['latent_cosine'] for r in spread):>11.6f} {max(r['psnr_db'] for r in spread):>8.2f} {max(r['ssim'] for r in spread):>7.4f}")


# -- part 2 -----------------------------------------------------------------------------------------------------------
def _outlier_tokens(width: int, count: int, seed: int) -> np.ndarray:
    """Unit-scale tokens with 4 channels 20-50x larger and of one sign (what DiT FFN inputs look like)."""
    rng = np.random.default_rng(0)
    channels = rng.choice(width, 4, replace=False)
    scales = np.array([20.0, 30.0, 40.0, 50.0], np.float32)
    r = np.random.default_rng(seed)
    x = r.standard_normal((count, width), dtype=np.float32) * (1 + 0.3 * r.uniform(-1, 1, (count, 1))).astype(np.float32)
    x[:, channels] = np.abs(x[:, channels]) * scales + 0.5 * scales
    return x


def _fullsize(models: Path) -> None:
    started = time.perf_counter()
    paths = ModelPaths.find(models)
    w1, w2 = ffn_weights(paths.dit, 0)
    width = w1.shape[0]
    if width < 1024:
        raise UserError(f"{models} is not a full-size model (width {width}); pass one made by `anima-ui random-model --config full`")
    shape = (1, 1024, width)
    calib = _outlier_tokens(width, 4 * 1024, seed=1)
    hybrids = {}
    for name, max_k in (("hybrid, K-tiled", None), ("hybrid, K pieces", MAX_INT8_K)):
        searched = time.perf_counter()
        hybrids[name] = q = quantize_ffn(w1, w2, calib, 32, max_k=max_k)
        print(f"\nfull size: block 0 FFN {width}->{w1.shape[1]}, {shape[1]} tokens, rank 32; {name}: layer 2's residual GEMM "
              f"in {len(q.pieces2)} piece(s) {q.pieces2}, α {q.alpha1}/{q.alpha2} (search {time.perf_counter() - searched:.0f} s)")
    checks = [_outlier_tokens(width, shape[1], seed=2).reshape(shape)]
    dataset = [calib[i * shape[1]:(i + 1) * shape[1]].reshape(shape) for i in range(4)]
    reference = ffn_fp32(checks[0][0], w1, w2)
    emulated = {"FP16": ffn_fp16(checks[0][0], w1, w2), "W8A8 (toolkit)": emulate_plain(w1, w2, calib, checks[0][0]),
                **{name: emulate(q, checks[0][0] / q.smooth_in) for name, q in hybrids.items()}}
    with tempfile.TemporaryDirectory(prefix="bench_quant_full_") as tmp:
        tmp = Path(tmp)
        write_model(float_ffn_model(w1, w2, shape), tmp / "ffn.onnx")
        builds = {
            "FP16": convert_ffn(tmp / "ffn.onnx", tmp / "fp16.rknn", "fp16", dataset, checks),
            "W8A8 (toolkit)": convert_ffn(tmp / "ffn.onnx", tmp / "int8.rknn", "int8", dataset, checks),
        }
        for index, (name, q) in enumerate(hybrids.items()):
            write_model(quantized_ffn_model(q, shape), tmp / f"hybrid{index}.onnx")
            builds[name] = convert_ffn(tmp / f"hybrid{index}.onnx", tmp / f"hybrid{index}.rknn", "hybrid",
                                       [d / q.smooth_in for d in dataset], [c / q.smooth_in for c in checks], q=q)
        fp16_cycles = sum(op.cycles_npu for op in builds["FP16"].ops)
        print("rel err / cosine: the simulator's output against float32; gate: the per-block FFN thresholds (cosine >= "
              f"{MIN_FFN_COSINE}, rel err <= {MAX_FFN_REL_ERROR:.0%}); emu vs sim: the emulator against the simulator, "
              f"relative, and as a share of the rel err (at most {MAX_EMULATOR_GAP:.0%}); RW MB: the op table's memory traffic")
        print(f"{'graph':<18} {'build s':>8} {'MB':>6} {'NPU cycles':>11} {'× FP16':>7} {'RW MB':>7} {'rel err':>8} {'cosine':>9} "
              f"{'gate':>5} {'emu vs sim':>10} {'share':>6}")
        for name, c in builds.items():
            npu = sum(op.cycles_npu for op in c.ops)
            error = rel_error(c.sim_outputs[0][0], reference)
            cos = cosine(c.sim_outputs[0][0], reference)
            gap = rel_error(emulated[name], c.sim_outputs[0][0])
            ok = cos >= MIN_FFN_COSINE and error <= MAX_FFN_REL_ERROR
            print(f"{name:<18} {c.build_seconds:>8.1f} {c.rknn_file.stat().st_size / 1e6:>6.1f} {npu / 1e6:>10.1f}M {fp16_cycles / npu:>7.2f} "
                  f"{sum(op.rw_kb for op in c.ops) / 1e3:>7.0f} {error:>8.2%} {cos:>9.6f} {'pass' if ok else 'fail':>5} {gap:>10.2e} {gap / error:>6.1%}")
        for name in hybrids:
            problems = hybrid_op_problems(builds[name].ops)
            print(f"{name} op table: " + ("residual Convs INT8 and untiled, everything else FLOAT16, output FLOAT16"
                                          if not problems else "; ".join(problems)))
            for op in builds[name].ops:
                if op.name.startswith("Conv:res") or op.type == "Add":
                    print(f"  {op.type:<9} {op.dtype:<8} {op.cycles_npu:>10} {op.rw_kb:>8} KB {op.name}")
    print(f"(part 2: {time.perf_counter() - started:.0f} s)")
