"""`anima-ui tune --models DIR [--width W --height H] [--backend rknn|sim|onnx]`: find, on this machine (on the
board: its NPU), the variant that runs each branch kind fastest while matching the serial result, and the faster
correct final decoder at this size; write them as the profile `tune.json` in the graphs folder, which `serve` and
`generate` then use (unless `--no-tune-profile`).

Branches: every variant runs a sample of blocks a few times (anima_ui/runtime/tune.py); one that fails or
disagrees with serial is dropped, saying why. Batch-2 variants need batch-2 graphs: the full set is used when it is
there (MODELS/exported|rknn/WxH-b2); otherwise the sample's blocks alone are exported at batch 2 (and converted, for
rknn) into a temporary folder next to the graphs, measured, and deleted. The profile then says which graph set
its choice needs and the commands that make it.

Decoders: every final decoder (sd.cpp tiled, the onnx decoder graphs, and the NPU decoder on this backend) decodes
the same latent at this size; one that is unavailable, fails, gives a wrong size, a flat image or an image that
disagrees with the first working one (PSNR under 40 dB) is dropped, and so is an NPU decoder whose converted graphs
fail their gate (the stored check latent against the fp32 image, >= 50 dB). The faster correct one is recorded;
sd.cpp stays the default when there is no profile. On the sim backend the NPU decoder's time is simulated board
time, which this PC's decoders cannot be compared with: it is measured and shown, not chosen."""

import importlib.metadata
import math
import shutil
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import numpy as np

from anima_ui.commands.pipeline_flags import add_runtime_arguments, open_options, runtime_options
from anima_ui.convert.convert_rknn import convert_rknn
from anima_ui.convert.export import export_graphs
from anima_ui.convert.model_graphs import export_model_graphs
from anima_ui.errors import UserError
from anima_ui.metrics import psnr
from anima_ui.model.config import BRANCH_KINDS
from anima_ui.modelfiles import ModelPaths
from anima_ui.runtime import tune
from anima_ui.runtime.executor import make_backend as make_runtime_backend
from anima_ui.runtime.manifest import Manifest
from anima_ui.runtime.profile import write_profile
from anima_ui.runtime.variants import VARIANTS
from anima_ui.vae.decode import DECODERS, decode_latent
from anima_ui.vae.npu_decoder import check_npu_decoder, estimated_board_seconds, graphs_folder, pick_layout
from anima_ui.vae.npu_graphs import VaeGraphs

DECODER_MIN_PSNR = 40.0  # sd.cpp tiled and the own tiled decoder agree to >= 45 dB (same tile plan and blending)


def add_arguments(parser):
    parser.add_argument("--models", required=True, help="model folder in the official layout")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--height", type=int, default=512)
    parser.add_argument("--backend", choices=("rknn", "sim", "onnx"), default="rknn", help="rknn on the board; sim or onnx anywhere")
    parser.add_argument("--blocks", type=int, default=4,
                        help="sample: the first N blocks (each variant runs their 3N graphs; more than K, or a kind's "
                             "graphs would all stay open and its lifecycle would not show)")
    parser.add_argument("--rounds", type=int, default=3, help="times each variant runs the sample (the first is not timed)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma list of the variants to try (serial always runs)")
    parser.add_argument("--no-decoders", action="store_true", help="do not time the final decoders")
    add_runtime_arguments(parser, profile=False, variants=False)


def run(args) -> int:
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise UserError(f"--variants: unknown {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    if args.rounds < 1:
        raise UserError(f"--rounds {args.rounds}: give 1 or more")
    progress = lambda line: print(line, file=sys.stderr, flush=True)
    paths = ModelPaths.find(args.models)
    graphs = {1: _graphs(paths, args, 1, progress)}
    blocks = min(args.blocks, len({g.block for g in Manifest.read(graphs[1]).graphs}))
    options = runtime_options(args)
    plan_options = {"contexts": options["contexts"] or 2, "core_mask": options["core_mask"],
                    "wait_for_inference": options["wait_for_inference"]}
    full_batch2 = _folder(paths, args, 2)
    sample_dir, batch2_source = None, None
    if any(VARIANTS[v].graph_batch == 2 for v in variants):
        if (full_batch2 / "manifest.json").is_file():
            graphs[2], batch2_source = full_batch2, f"the full batch-2 set in {full_batch2}"
        else:
            sample_dir = Path(tempfile.mkdtemp(prefix=".tune-batch2-", dir=graphs[1].parent))
            try:
                graphs[2], batch2_source = build_batch2_sample(paths, args, blocks, sample_dir, progress)
            except Exception as exc:  # the batch-2 variants are dropped for this reason, the others still measured
                batch2_source = f"not built: {type(exc).__name__}: {exc}"
                progress(f"batch-2 graphs for the sample could not be built ({exc}); the batch-2 variants are dropped")
    twins = onnx_twins(variants) if args.backend == "onnx" else {}
    try:
        make_backend = lambda: args.backend
        progress(f"tuning the {args.backend} backend on blocks 0..{blocks - 1} at {args.width}x{args.height}, {args.rounds} rounds per variant")
        reference, outcomes = tune.measure(make_backend, graphs, [v for v in variants if v not in twins], blocks, args.rounds,
                                           options=open_options(args), progress=progress, **plan_options)
        choice, check = choose_and_check(make_backend, graphs, outcomes, blocks, args.rounds, reference, plan_options, open_options(args))
        ffn = tune.measure_quantized_ffn(make_backend, graphs, choice, outcomes, blocks, args.rounds, reference,
                                         board_backend=make_runtime_backend("rknn") if args.backend == "rknn" else None,
                                         options=open_options(args), **plan_options)
        if ffn is not None:
            progress(f"FFN: fp16 {ffn.fp16_seconds:.4f} s per visit ({ffn.fp16_variant}); quantized " + (
                f"dropped: {ffn.dropped}" if ffn.dropped else f"{ffn.median:.4f} s ({ffn.variant})"))
            if ffn.chosen == "w8a8-lowrank":
                choice = {**choice, "mlp": ffn.variant}
    finally:
        if sample_dir is not None:
            shutil.rmtree(sample_dir, ignore_errors=True)
    for name, twin in twins.items():
        outcomes[name] = tune.Outcome(name, dropped=f"the same as {twin} on the onnx backend (core masks are the NPU's)")
    for outcome in outcomes.values():
        if outcome.variant != "serial" and VARIANTS[outcome.variant].graph_batch == 2 and outcome.dropped == "no batch-2 graphs":
            outcome.dropped = f"no batch-2 graphs ({batch2_source})"
    npu = {"backend": args.backend, "time_scale": args.time_scale, "core_mask": args.core_mask}
    decoders = time_decoders(paths.vae, args.width, args.height, progress, npu) if not args.no_decoders else None
    data = profile_data(args, blocks, plan_options, choice, check, outcomes, graphs, full_batch2, batch2_source, decoders)
    data["ffn"] = ffn_data(ffn)
    path = write_profile(graphs[1], data)
    print_report(data, path)
    return 0


def onnx_twins(variants: list[str]) -> dict[str, str]:
    """On onnxruntime a variant is its graph set, chains and prefetch; core masks do nothing. Each variant that only
    differs from an earlier one by its cores -> that one (it is not measured: it would differ by noise alone)."""
    twins, seen = {}, {}
    for name in ["serial", *variants]:
        v = VARIANTS[name]
        key = (v.graph_batch, v.chains, v.prefetch)
        if key in seen and seen[key] != name:
            twins[name] = seen[key]
        seen.setdefault(key, name)
    return twins


def _folder(paths, args, batch: int) -> Path:
    return paths.rknn_dir(args.width, args.height, batch) if args.backend == "rknn" else paths.exported_dir(args.width, args.height, batch)


def _graphs(paths, args, batch: int, progress) -> Path:
    """The batch-1 graphs the backend runs; ONNX graphs are exported on first use (as generate does)."""
    folder = _folder(paths, args, batch)
    if (folder / "manifest.json").is_file():
        return folder
    if args.backend == "rknn":
        raise UserError(f"no RKNN graphs in {folder}: run `anima-ui prepare --models {args.models} --width {args.width} "
                        f"--height {args.height}` first")
    progress(f"exporting the ONNX graphs for {args.width}x{args.height} into {folder} ...")
    export_model_graphs(paths, args.width, args.height, folder)
    return folder


def build_batch2_sample(paths, args, blocks: int, out: Path, progress) -> tuple[Path, str]:
    """Export the sample's blocks at batch 2 into `out` (only their tensors are read), and convert them for rknn:
    (the folder the backend runs, how it was made)."""
    started = time.perf_counter()
    progress(f"exporting batch-2 graphs of blocks 0..{blocks - 1} for the sample ...")
    export_graphs(paths, args.width, args.height, out / "onnx", batch=2, blocks=blocks)
    how = f"the sample's {3 * blocks} graphs exported at batch 2 by `anima-ui export`'s exporter"
    folder = out / "onnx"
    if args.backend == "rknn":
        folder = out / "rknn"
        convert_rknn(out / "onnx", folder, progress=lambda done, total, file, seconds, reused, result:
                     progress(f"converted {file} ({done}/{total}, {seconds:.0f} s)"))
        how += " and converted by `anima-ui convert-rknn`'s converter"
    return folder, how + f" ({time.perf_counter() - started:.0f} s), then deleted"


def choose_and_check(make_backend, graphs, outcomes, blocks, rounds, reference, plan_options, options):
    """Each kind's fastest kept variant, run once more as a mix and checked; if the mix disagreed (it should not:
    every part agreed alone), the fastest kept variant over all kinds together."""
    choice = tune.choose(outcomes)
    check = tune.check_choice(make_backend, graphs, choice, blocks, rounds, reference, options=options, **plan_options)
    if check.dropped:
        kept = [o for o in outcomes.values() if o.dropped is None]
        best = min(kept, key=lambda o: sum(o.median(kind) for kind in BRANCH_KINDS))
        choice = dict.fromkeys(BRANCH_KINDS, best.variant)
    return choice, check


def time_decoders(vae_path, width: int, height: int, progress, npu: dict) -> dict:
    """Decode one latent with every final decoder: {"chosen": the fastest correct one or None, "measured": {name:
    {"seconds", "psnr_vs_<first>"} or {"dropped": why}}, "size"}. npu: the NPU decoder's backend options."""
    latent = np.random.default_rng(0).standard_normal((1, 16, height // 8, width // 8)).astype(np.float32)
    measured, reference, not_comparable = {}, None, set()
    for name in DECODERS:
        try:
            if name == "npu":
                npu_gate(vae_path, width, height, npu)
            started = time.perf_counter()
            image, used, warning = decode_latent(latent, vae_path, prefer=name, npu=npu)
            seconds = time.perf_counter() - started
            pixels = np.asarray(image, np.float64) / 255.0
            if used != name:
                raise RuntimeError(f"unavailable ({warning})")
            if pixels.shape != (height, width, 3) or not pixels.std() > 0:
                raise RuntimeError(f"gave a {pixels.shape} image with spread {pixels.std():.3g}")
            entry = {"seconds": round(seconds, 3)}
            if name == "npu" and npu["backend"] == "sim":
                graphs = VaeGraphs.read(graphs_folder(vae_path, "onnx", width, height))  # built by the decode above
                entry = {"board_seconds": round(estimated_board_seconds(graphs, pick_layout(graphs)), 3),
                         "not_chosen": "the simulated board's estimate; this PC's decoders are timed for real (tune on "
                                       "the board compares them)"}
                not_comparable.add(name)
            if reference is None:
                reference = (name, pixels)
            else:
                quality = psnr(pixels, reference[1])
                if quality < DECODER_MIN_PSNR:
                    raise RuntimeError(f"disagrees with {reference[0]}: PSNR {quality:.2f} dB < {DECODER_MIN_PSNR}")
                # identical images give an infinite PSNR, which strict JSON cannot hold
                entry[f"psnr_vs_{reference[0]}"] = round(quality, 2) if math.isfinite(quality) else "identical"
            measured[name] = entry
        except Exception as exc:
            measured[name] = {"dropped": f"{type(exc).__name__}: {exc}"}
        progress(f"decoder {name}: {measured[name]}")
    kept = {name: m for name, m in measured.items() if "seconds" in m and name not in not_comparable}
    return {"chosen": min(kept, key=lambda name: kept[name]["seconds"]) if kept else None, "measured": measured,
            "size": f"{width}x{height}"}


def npu_gate(vae_path, width: int, height: int, npu: dict) -> None:
    """The NPU decoder's converted graphs (rknn) must pass their gate before it is timed: the stored check latent
    against the fp32 image stored at conversion. The onnx and sim backends run fp32 graphs built from the
    safetensors, which the PSNR check against the first decoder covers."""
    if npu["backend"] != "rknn":
        return
    folder = graphs_folder(vae_path, "rknn", width, height)
    if not (folder / "manifest.json").is_file():
        raise RuntimeError(f"no converted NPU decoder graphs in {folder}")
    layout = pick_layout(VaeGraphs.read(folder))
    result = check_npu_decoder(folder, "rknn", layouts=[layout], core_mask=npu["core_mask"])[layout]
    if not result["ok"]:
        raise RuntimeError(f"failed its gate: {layout} layout {result['psnr']} dB against the fp32 image, "
                           f"{result['nonfinite']} NaN/Inf")


def profile_data(args, blocks, plan_options, choice, check, outcomes, graphs, full_batch2, batch2_source, decoders) -> dict:
    needs = sorted({VARIANTS[name].graph_batch for name in choice.values()})
    needs_batch2 = 2 in needs and not (full_batch2 / "manifest.json").is_file()
    make = None
    if needs_batch2:
        make = f"anima-ui export --models {args.models} --width {args.width} --height {args.height} --batch 2"
        if args.backend == "rknn":
            make += (f" && anima-ui convert-rknn --onnx {Path(args.models) / 'exported' / f'{args.width}x{args.height}-b2'} "
                     f"--out {full_batch2}")
    measured = {kind: {name: ({"dropped": o.dropped} if o.dropped else {"median_seconds": round(o.median(kind), 6)})
                       for name, o in outcomes.items()} for kind in BRANCH_KINDS}
    return {
        "backend": args.backend,
        "created": datetime.now().isoformat(timespec="seconds"),
        "width": args.width,
        "height": args.height,
        "sample_blocks": blocks,
        "rounds": args.rounds,
        **plan_options,
        **({"time_scale": args.time_scale, "contention": args.contention} if args.backend == "sim" else {}),
        "choice": choice,
        "chosen_mix": {"dropped": check.dropped} if check.dropped else {kind: round(check.median(kind), 6) for kind in BRANCH_KINDS},
        "measured": measured,
        "graph_sets": {str(batch): str(_folder_for(graphs, batch, full_batch2)) for batch in needs},
        "batch2_sample": batch2_source,
        "needs": make,
        "decoder": decoders,
        "versions": _versions(args, graphs[1]),
        "seconds_are": "wall seconds per branch visit on this machine" + (f" (sim: board seconds x {args.time_scale:g})" if args.backend == "sim" else ""),
    }


def ffn_data(ffn) -> dict | None:
    """The FFN verdict: "fp16" or "w8a8-lowrank", what each measured (median wall seconds per FFN visit), the
    board check's rows. None when the graphs have no quantized FFNs (`generate` then runs FP16 ones)."""
    if ffn is None:
        return None
    quantized = {"variant": ffn.variant}
    if ffn.dropped:
        quantized["dropped"] = ffn.dropped
    else:
        quantized["median_seconds"] = round(ffn.median, 6)
    return {"chosen": ffn.chosen, "blocks": ffn.blocks,
            "measured": {"fp16": {"variant": ffn.fp16_variant, "median_seconds": round(ffn.fp16_seconds, 6)},
                         "w8a8-lowrank": quantized},
            **({"board_check": ffn.board_check} if ffn.board_check else {})}


def _folder_for(graphs, batch, full_batch2):
    return graphs[1] if batch == 1 else full_batch2


def _versions(args, folder) -> dict:
    versions = {}
    for name in ("anima-ui", "onnxruntime", "rknn-toolkit-lite2", "numpy"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    versions["graphs"] = Manifest.read(folder).tools
    return versions


def print_report(data: dict, path: Path) -> None:
    print(f"{'variant':<14} " + " ".join(f"{kind + ' s/visit':>20}" for kind in BRANCH_KINDS))
    names = list(next(iter(data["measured"].values())))
    for name in names:
        cells = [data["measured"][kind][name] for kind in BRANCH_KINDS]
        if "dropped" in cells[0]:
            print(f"{name:<14} dropped: {cells[0]['dropped']}")
        else:
            print(f"{name:<14} " + " ".join(f"{c['median_seconds']:20.4f}" for c in cells))
    print("chosen: " + ", ".join(f"{kind} {data['choice'][kind]}" for kind in BRANCH_KINDS)
          + (f"; the chosen mix: " + ("dropped, " + data["chosen_mix"]["dropped"] if "dropped" in data["chosen_mix"] else
                                      " ".join(f"{kind} {s:.4f} s" for kind, s in data["chosen_mix"].items()))))
    if data["needs"]:
        later = ("until then generate runs the fastest variant measured with the graphs present" if data["backend"] == "rknn"
                 else "generate exports them on first use")
        print(f"the choice needs batch-2 graphs for the whole model: {data['needs']} ({later})")
    if data["ffn"]:
        fp16, quantized = data["ffn"]["measured"]["fp16"], data["ffn"]["measured"]["w8a8-lowrank"]
        print(f"FFN: {data['ffn']['chosen']}; fp16 {fp16['median_seconds']:.4f} s per visit ({fp16['variant']}), W8A8 + "
              f"low-rank in blocks {','.join(map(str, data['ffn']['blocks']))} " + (
                  f"dropped: {quantized['dropped']}" if "dropped" in quantized else
                  f"{quantized['median_seconds']:.4f} s ({quantized['variant']})"))
    if data["decoder"]:
        print(f"final decoder at {data['decoder']['size']}: {data['decoder']['chosen']} "
              + "; ".join(f"{n} {_decoder_cell(m)}" for n, m in data["decoder"]["measured"].items()))
    print(f"wrote {path}")


def _decoder_cell(measured: dict) -> str:
    if "dropped" in measured:
        return f"dropped: {measured['dropped']}"
    if "board_seconds" in measured:
        return f"{measured['board_seconds']} board s (simulated; {measured['not_chosen']})"
    return f"{measured['seconds']} s"
