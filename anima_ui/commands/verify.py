"""`anima-ui verify --models DIR --backend onnx|sim|rknn [--width W --height H]`: the correctness gate.

Runs one CFG forward (batch 2: two different contexts) through the split runtime and through the
reference, and compares the residual stream after every block and the final prediction: cosine, MAE,
max abs error, NaN/Inf count. Exit 0 when every cosine reaches the threshold (0.99999 for fp32 graphs,
0.9999 for FP16/RKNN graphs) and nothing is NaN/Inf, else 1. The last line is one JSON object.

The reference is the torch forward on this machine; on a board, `--reference onnx` compares against the
exported fp32 ONNX graphs run by onnxruntime instead (as the blog's 28-block check did).

`--decoder npu` checks the NPU decoder graphs instead: it decodes the test latent stored at conversion with
every layout on the backend and compares with the project's fp32 decoder image of the same tile plan stored
beside it. Exit 0 only when every layout reaches 50 dB with no NaN/Inf.

The forward runs the FP16 FFN graphs. A converted folder with W8A8 + low-rank FFNs (`prepare --ffn w8a8-lowrank`)
also gets the board-vs-simulator check: each quantized graph on the inputs saved when it was built, against
the toolkit simulator's outputs on them (their quality against FP16 was gated when they were made); it needs
the rknn backend (the NPU), and is part of the verdict."""

import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from anima_ui.commands.pipeline_flags import add_runtime_arguments, open_options, runtime_plan
from anima_ui.convert.model_graphs import export_model_graphs
from anima_ui.errors import UserError
from anima_ui.model.checkpoint import load_dit
from anima_ui.model.forward import dit_forward, prepare_kv, prepare_rope
from anima_ui.modelfiles import ModelPaths
from anima_ui.runtime import open_runtime, quantized_ffn
from anima_ui.runtime.executor import make_backend
from anima_ui.runtime.graphs import graphs_dir, graphs_ready
from anima_ui.runtime.host_weights import load_host_weights
from anima_ui.vae.npu_decoder import MIN_BOARD_PSNR, check_npu_decoder, graphs_folder
from anima_ui.vae.npu_graphs import MANIFEST, build_vae_graphs

FP32_MIN_COSINE = 0.99999
FP16_MIN_COSINE = 0.9999


def add_arguments(parser):
    parser.add_argument("--models", required=True, help="model folder in the official layout")
    parser.add_argument("--backend", choices=("onnx", "sim", "rknn"), required=True)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--height", type=int, default=512)
    parser.add_argument("--reference", choices=("torch", "onnx"), default="torch",
                        help="torch: the float32 torch forward; onnx: the exported fp32 graphs (for a board)")
    parser.add_argument("--seed", type=int, default=0)
    add_runtime_arguments(parser, profile=False)
    # one forward: a resident onnxruntime session would never be reused, only held (the board's fp32 reference must stay small)
    parser.set_defaults(time_scale=0.001, resident_sessions="none")
    parser.add_argument("--decoder", choices=("npu",),
                        help="npu: check the NPU decoder graphs instead of the DiT branches (every layout against the "
                             f"fp32 decoder on the stored test latent; passes at >= {MIN_BOARD_PSNR:.0f} dB, no NaN/Inf)")


def compare(split: np.ndarray, reference: np.ndarray) -> dict:
    a, b = split.astype(np.float64).ravel(), reference.astype(np.float64).ravel()
    finite = np.isfinite(a)
    a = np.where(finite, a, 0.0)
    return {
        "cosine": float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-300)),
        "mae": float(np.abs(a - b).mean()),
        "max_abs": float(np.abs(a - b).max()),
        "nonfinite": int((~finite).sum()),
    }


def graphs_for(paths, backend: str, width: int, height: int, batch: int = 1):
    """The graphs folder the backend runs; missing ONNX graphs are exported first (before the reference weights
    load, so the two never share the memory), missing RKNN ones are an error naming the commands."""
    folder = graphs_dir(paths, backend, width, height, batch)
    if not graphs_ready(folder):
        print(f"exporting the ONNX graphs for {width}x{height} (batch {batch}) into {folder} ...", file=sys.stderr, flush=True)
        export_model_graphs(paths, width, height, folder, batch=batch)
    return folder


def run(args) -> int:
    if args.decoder == "npu":
        return verify_decoder(args)
    plan = runtime_plan(args)
    paths = ModelPaths.find(args.models)
    graphs = [graphs_for(paths, args.backend, args.width, args.height, batch) for batch in sorted(plan.graph_batches())]
    reference_graphs = graphs_for(paths, "onnx", args.width, args.height) if args.reference == "onnx" else None
    # the split runs need only the host's tensors (a board cannot hold the 8.4 GB float32 DiT)
    config, weights = load_host_weights(paths.dit)

    rng = np.random.default_rng(args.seed)
    x = rng.standard_normal((2, config.latent_channels, args.height // 8, args.width // 8)).astype(np.float32)
    sigma = np.array([0.6, 0.6], np.float32)
    context = rng.standard_normal((2, config.context_len, config.context_dim)).astype(np.float32)
    kv, rope = prepare_kv(weights, context), prepare_rope(config, args.height // 8, args.width // 8)

    rows = []
    # The split run's residual stream after each block waits in a file (0.47 GB at 512x512 would otherwise
    # sit in memory until the reference run reaches that block), and is compared as the reference reaches it.
    with tempfile.TemporaryDirectory(prefix="verify_") as stash:
        stash = Path(stash)

        def compare_with_split(i, residual):
            rows.append((f"block {i}", compare(np.load(stash / f"block{i}.npy"), residual)))

        with open_runtime(args.backend, graphs, plan, **open_options(args), ffn="fp16") as runtime:
            split = runtime.forward(weights, x, sigma, kv, rope, on_block=lambda i, residual: np.save(stash / f"block{i}.npy", residual))
            manifest = runtime.manifest
        if args.reference == "torch":
            from anima_ui.model.reference import reference_forward  # torch (optional): the board has none

            reference = reference_forward(load_dit(paths.dit)[1], x, sigma, context, on_block=compare_with_split)
        else:
            gate_options = {k: v for k, v in open_options(args).items() if k in ("mem_floor_gib", "swap_policy", "gate_wait_seconds")}
            with open_runtime("onnx", reference_graphs, resident="none", **gate_options) as onnx_runtime:
                reference = dit_forward(weights, onnx_runtime, x, sigma, kv, rope, on_block=compare_with_split)

    rows.append(("final prediction", compare(split, reference)))
    threshold = FP32_MIN_COSINE if manifest.format == "onnx" and manifest.dtype == "fp32" else FP16_MIN_COSINE
    print(f"split {args.backend} ({manifest.format} {manifest.dtype}, {plan.describe()}) vs {args.reference} reference, "
          f"{args.width}x{args.height}, CFG batch 2")
    print(f"{'':>17} {'cosine':>12} {'MAE':>11} {'max abs err':>12} {'NaN/Inf':>8}")
    for name, m in rows:
        print(f"{name:>17} {m['cosine']:12.9f} {m['mae']:11.3e} {m['max_abs']:12.3e} {m['nonfinite']:8d}")
    min_cosine = min(m["cosine"] for _, m in rows)
    nonfinite = sum(m["nonfinite"] for _, m in rows)
    passed = min_cosine >= threshold and nonfinite == 0
    quantized = quantized_check(args, runtime.graphs_dir, manifest)
    passed = passed and all(row["passed"] for row in quantized or [])
    print(json.dumps({"backend": args.backend, "min_cosine": min_cosine, "final_cosine": rows[-1][1]["cosine"],
                      "threshold": threshold, "nonfinite": nonfinite, "quantized_ffns": quantized, "passed": passed}))
    return 0 if passed else 1


def verify_decoder(args) -> int:
    """The NPU decoder's gate on the backend; the last line is one JSON object."""
    paths = ModelPaths.find(args.models)
    backend = make_backend(args.backend, time_scale=args.time_scale)
    folder = graphs_folder(paths.vae, backend.graph_format, args.width, args.height)
    if not (folder / MANIFEST).is_file():
        if backend.graph_format != "onnx":
            raise UserError(f"no converted NPU decoder graphs for {args.width}x{args.height} in {folder}: run "
                            f"`anima-ui prepare --models {args.models} --width {args.width} --height {args.height}` "
                            "(until then the app decodes with --decoder sdcpp)")
        print(f"building the NPU decoder graphs for {args.width}x{args.height} into {folder} ...", file=sys.stderr, flush=True)
        build_vae_graphs(paths.vae, args.width, args.height, folder)
    results = check_npu_decoder(folder, backend, vae_path=paths.vae, core_mask=args.core_mask)
    print(f"NPU decoder graphs ({folder}) on {args.backend} vs the fp32 decoder, same tile plan, {args.width}x{args.height}")
    print(f"{'layout':<12} {'PSNR dB':>8} {'NaN/Inf':>8} {'seconds':>8} {'gate':>5}")
    for layout, r in results.items():
        print(f"{layout:<12} {r['psnr']:>8.1f} {r['nonfinite']:>8d} {r['seconds']:>8.2f} {'ok' if r['ok'] else 'FAIL':>5}")
    failed = [layout for layout, r in results.items() if not r["ok"]]
    if failed:
        print(f"the NPU decoder failed the gate ({', '.join(failed)}: needs >= {MIN_BOARD_PSNR:.0f} dB and no NaN/Inf): "
              f"keep --decoder sdcpp; convert again with `anima-ui prepare --models {args.models}`, and if it fails again "
              "report the toolkit and runtime versions `anima-ui doctor` prints", file=sys.stderr)
    print(json.dumps({"backend": args.backend, "decoder": "npu", "threshold": MIN_BOARD_PSNR, "layouts": results,
                      "passed": not failed}))
    return 0 if not failed else 1


def quantized_check(args, graphs, manifest) -> list[dict] | None:
    """The quantized FFN graphs on the NPU against the simulator's saved outputs (None: the folder has none)."""
    if not quantized_ffn.quantized_blocks(manifest):
        return None
    if args.backend != "rknn":
        print("quantized FFNs: their board-vs-simulator check needs --backend rknn (the NPU)")
        return None
    rows = quantized_ffn.board_check(graphs, manifest, make_backend("rknn"), args.core_mask)
    print_quantized_rows(rows)
    return rows


def print_quantized_rows(rows: list[dict]) -> None:
    print(f"quantized FFNs on this NPU vs the toolkit's simulator on saved inputs (gate: cosine >= {quantized_ffn.MIN_BOARD_COSINE}):")
    for row in rows:
        print(f"{'block ' + str(row['block']):>17} {row['cosine']:12.9f} rel err {row['rel_error']:.3e} NaN/Inf {row['nonfinite']} "
              f"{'ok' if row['passed'] else 'FAILED'}")
