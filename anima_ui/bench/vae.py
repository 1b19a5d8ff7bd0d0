"""`anima-ui bench vae`: every VAE decoder side by side on full-size random weights, the NPU decoder's
layouts on the simulated board's latency model, and the preview cost per step.

Each (decoder, size) runs in its own subprocess, so its peak RSS is its own (weights + activations +
the interpreter and libraries it imports). Decode seconds exclude loading (for the onnx decoder, they
include building the graph and its onnxruntime session). The PSNR column compares each image with the
own untiled decoder's (so it shows what tiling and the sd.cpp weight types cost); with random weights
it says nothing about image quality. The npu-* rows run the NPU decoder's graphs on onnxruntime here.

--simulator converts the NPU decoder's graphs with .venv-rknn and prints each graph's simulator accuracy,
build time and peak RSS; --board DIR times a converted folder's layouts on the board's NPU.
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

from anima_ui.metrics import psnr
from anima_ui.runtime.memory import process_memory

# Every decoder row runs this module in a process of its own, and that process's peak RSS is what the table
# reports: torch, the decoders and the fixtures that write their weights are imported inside the functions that use
# them, so a row carries only what its decoder needs.

DECODERS = {  # in run order: the own untiled decode first, as the PSNR reference
    "torch-untiled": "own torch, untiled",
    "torch-tiled": "own torch, tiled 32 / 0.5",
    "onnx-untiled": "own graphs on onnxruntime, untiled",
    "onnx-tiled": "own graphs on onnxruntime, tiled 32 / 0.5",
    "npu-untiled": "NPU decoder graphs on onnxruntime, untiled",
    "npu-halo": "NPU decoder graphs on onnxruntime, trunk + halo tiles",
    "npu-halo-batch": "NPU decoder graphs on onnxruntime, trunk + one batch of halo tiles",
    "sdcpp-untiled": "sd.cpp, untiled",
    "sdcpp-tiled": "sd.cpp, tiled 32 / 0.5",
    "diffusers": "diffusers fp32, untiled",
}


def add_arguments(parser):
    from anima_ui.vae.npu_graphs import DEFAULT_GRID  # here, not at the top: a worker row imports only its decoder

    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 1024], help="square image sizes (px)")
    parser.add_argument("--decoders", nargs="*", default=list(DECODERS), choices=list(DECODERS),
                        help="none: only the preview table")
    parser.add_argument("--sdcpp-weight-types", nargs="+", default=["auto"], choices=["auto", "bf16", "f16", "f32"],
                        help="run the sd.cpp decoders once per weight type")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--vae", type=Path, help="a VAE file to use instead of writing random full-size weights")
    parser.add_argument("--preview-repeats", type=int, default=3, help="runs of the taew2_1 preview per size")
    parser.add_argument("--grid", type=int, nargs=2, default=list(DEFAULT_GRID), metavar=("ROWS", "COLUMNS"),
                        help="halo tiles of the NPU decoder's halo layouts")
    parser.add_argument("--simulator", action="store_true",
                        help="convert the NPU decoder graphs (.venv-rknn) and print their simulator accuracy; "
                             "minutes and up to ~6 GB per graph at full size")
    parser.add_argument("--board", type=Path, metavar="RKNN_DIR",
                        help="on the board: time the layouts of a converted NPU decoder folder on the NPU")
    parser.add_argument("--core-mask", default="auto", help="with --board: NPU cores (auto, 0, 0_1_2, ...)")
    parser.add_argument("--repeats", type=int, default=3, help="with --board: timed runs per layout (after a warm-up)")


def run(args) -> int:
    with tempfile.TemporaryDirectory(prefix="bench_vae_") as tmp:
        tmp = Path(tmp)
        if args.board:
            _print_board_table(args.board, args.core_mask, args.repeats)
        vae_path = None
        if args.decoders or args.simulator or not args.board:
            vae_path = args.vae or _random_vae(tmp / "qwen_image_vae.safetensors")
            npu = {size: _build_npu_graphs(vae_path, size, tuple(args.grid), tmp) for size in args.sizes}
        if args.decoders:
            _run_decoders(args, vae_path, npu, tmp)
        if vae_path is not None:
            _print_estimate_table(npu)
        if args.simulator:
            _print_simulator_table(npu, tmp)
        if not args.board:
            _print_preview_table(args.sizes, tmp, args.preview_repeats, args.threads)
    return 0


def _run_decoders(args, vae_path: Path, npu: dict, tmp: Path) -> None:
    _print_decode_header(args.threads)
    for size in args.sizes:
        reference = None  # the own untiled decode of this size (torch's or onnx's, whichever runs first)
        for decoder in sorted(args.decoders, key=list(DECODERS).index):
            for weight_type in (args.sdcpp_weight_types if decoder.startswith("sdcpp") else [None]):
                row = _run_worker(decoder, weight_type, size, vae_path, args.threads, tmp, npu[size])
                if "error" not in row:
                    image = np.load(row["image"]) / 255.0
                    if decoder in ("torch-untiled", "onnx-untiled") and reference is None:
                        row["reference"], reference = True, image
                    row["psnr"] = None if reference is None else psnr(image, reference)
                _print_decode_row(row)  # as soon as it is measured: a long run can be stopped


# ---------------------------------------------------------------- decoders, one subprocess each

def _random_vae(path: Path) -> Path:
    from anima_ui.fixtures.weights import write_random_vae

    write_random_vae(path, 96, seed=0)
    return path


def bench_latent(size: int) -> np.ndarray:
    return np.random.default_rng(size).standard_normal((1, 16, size // 8, size // 8)).astype(np.float32)


# Peak RSS (GB) at 512x512 measured on this machine; untiled decoders grow with the pixel count, tiled
# ones do not. A row whose estimate (+2 GB margin) exceeds the available memory is skipped, not run
# into the OOM killer on a shared machine.
PEAK_GB_AT_512 = {"sdcpp-tiled": 0.7, "sdcpp-untiled": 2.1, "torch-tiled": 1.0, "torch-untiled": 1.0,
                  "onnx-tiled": 1.0, "onnx-untiled": 1.5, "npu-untiled": 1.5, "npu-halo": 1.5, "npu-halo-batch": 2.5,
                  "diffusers": 3.2}


def _estimated_peak_gb(decoder: str, size: int) -> float:
    growth = 1.0 if decoder.endswith("-tiled") else max((size / 512) ** 2, 1.0)
    return PEAK_GB_AT_512[decoder] * growth


def _run_worker(decoder, weight_type, size, vae_path, threads, tmp: Path, npu_graphs: Path) -> dict:
    label = decoder if weight_type is None else f"{decoder} ({weight_type})"
    available = psutil.virtual_memory().available / 2**30
    if _estimated_peak_gb(decoder, size) + 2.0 > available:
        return {"label": label, "size": size, "error": f"skipped: needs ~{_estimated_peak_gb(decoder, size):.0f} GB, "
                                                         f"{available:.1f} GB available"}
    image_path = tmp / f"{label.replace(' ', '_')}_{size}.npy"
    job = {"decoder": decoder, "weight_type": weight_type, "size": size, "vae": str(vae_path),
           "threads": threads, "image": str(image_path), "npu_graphs": str(npu_graphs)}
    print(f"  {label} {size}x{size} ...", file=sys.stderr, flush=True)
    done = subprocess.run([sys.executable, "-m", "anima_ui.bench.vae", "--worker", json.dumps(job)],
                          capture_output=True, text=True)
    row = {"label": label, "size": size, "image": image_path, "load": round(os.getloadavg()[0], 1)}
    if done.returncode != 0:
        row["error"] = (done.stderr.strip().splitlines() or ["exit code %d" % done.returncode])[-1]
        return row
    row |= json.loads(done.stdout.strip().splitlines()[-1])
    return row


def _worker(job: dict) -> None:
    latent = bench_latent(job["size"])
    decoder, threads = job["decoder"], job["threads"]
    start = _clock()
    if decoder.startswith("sdcpp"):
        from anima_ui.vae.sdcpp import SdcppDecoder

        with SdcppDecoder(job["vae"], threads=threads, weight_type=job["weight_type"]) as vae:
            loaded = _clock()
            image = vae.decode(latent, tiled=decoder == "sdcpp-tiled")
            weight_type = vae.weight_type
    elif decoder.startswith("onnx"):
        from anima_ui.vae.onnx_decoder import OnnxDecoder

        vae, weight_type = OnnxDecoder(job["vae"], threads=threads), "fp32"
        loaded = _clock()
        image = vae.decode(latent, tiled=decoder == "onnx-tiled")
    elif decoder.startswith("npu"):
        from anima_ui.runtime.backends import OnnxBackend
        from anima_ui.vae.npu_decoder import decode_npu

        loaded, weight_type = _clock(), "fp32"
        image, _ = decode_npu(latent, job["npu_graphs"], OnnxBackend(threads), decoder.removeprefix("npu-"))
    else:
        import torch

        torch.set_num_threads(threads)
        if decoder == "diffusers":
            decode, weight_type = _diffusers_decoder(job["vae"]), "fp32"
        else:
            from anima_ui.vae.wan_decoder import load_vae_decoder

            vae, weight_type = load_vae_decoder(job["vae"]), "fp32"
            decode = lambda x: vae.decode(x, tiled=decoder == "torch-tiled")
        loaded = _clock()
        image = decode(latent)
    decoded = _clock()
    np.save(job["image"], image)
    # VmHWM, not getrusage's ru_maxrss: that survives exec, so every row would report the parent's peak
    peak_gb = process_memory()["peak_rss"] / 2**30
    print(json.dumps({"load_s": round(loaded[0] - start[0], 2), "decode_s": round(decoded[0] - loaded[0], 2),
                      "decode_cpu_s": round(decoded[1] - loaded[1], 2), "peak_rss_gb": round(peak_gb, 2),
                      "weights": weight_type}))


def _clock() -> tuple[float, float]:
    """(wall seconds, CPU seconds of every thread of this process): on a shared machine the wall time grows
    with the load, the CPU time much less, so the CPU column compares decoders run at different loads."""
    return time.perf_counter(), time.process_time()


def _diffusers_decoder(vae_path):
    import torch
    from diffusers import AutoencoderKLQwenImage  # diffusers: a test and benchmark requirement (requirements-dev.txt)
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers
    from safetensors.torch import load_file

    from anima_ui.vae.latent import model_to_vae_space, to_uint8

    model = AutoencoderKLQwenImage().eval()
    state = {k: v.float() for k, v in load_file(vae_path).items()}
    model.load_state_dict(convert_wan_vae_to_diffusers(state), strict=True)

    def decode(latent):
        with torch.inference_mode():
            out = model.decode(torch.from_numpy(model_to_vae_space(latent))[:, :, None]).sample[0, :, 0]
        return to_uint8((out.permute(1, 2, 0).numpy() + 1.0) / 2.0)

    return decode


# ---------------------------------------------------------------- tables

def _print_decode_header(threads: int) -> None:
    print(f"VAE decode, {threads} threads, one process per row (CPU s: the decode's CPU time over all its threads)")
    print(f"{'decoder':<24} {'size':>9} {'weights':>7} {'load s':>7} {'decode s':>9} {'CPU s':>7} {'peak RSS GB':>11} "
          f"{'PSNR vs own untiled':>19} {'load avg':>8}", flush=True)


def _print_decode_row(r: dict) -> None:
    size = f"{r['size']}x{r['size']}"
    if "error" in r:
        print(f"{r['label']:<24} {size:>9}  failed: {r['error']}", flush=True)
        return
    if r.get("reference"):
        quality = "reference"
    elif r["psnr"] is None:
        quality = "-"
    else:
        quality = "identical" if r["psnr"] == float("inf") else f"{r['psnr']:.1f} dB"
    print(f"{r['label']:<24} {size:>9} {r['weights']:>7} {r['load_s']:>7.2f} {r['decode_s']:>9.2f} "
          f"{r['decode_cpu_s']:>7.1f} {r['peak_rss_gb']:>11.2f} {quality:>19} {r['load']:>8.1f}", flush=True)


# ---------------------------------------------------------------- the NPU decoder

SDCPP_BOARD_SECONDS_512 = 155.04  # the source blog: sd.cpp tiled (32, 0.5) on the board's 4 A76 cores, 512x512


def _build_npu_graphs(vae_path: Path, size: int, grid: tuple[int, int], tmp: Path) -> Path:
    from anima_ui.vae.npu_graphs import build_vae_graphs

    folder = tmp / f"npu_onnx_{size}"
    build_vae_graphs(vae_path, size, size, folder, grid=grid)
    return folder


def _print_estimate_table(npu: dict) -> None:
    from anima_ui.runtime import board_latency
    from anima_ui.sampling.spectrum import plan
    from anima_ui.vae.npu_decoder import estimated_board_seconds, runs_per_decode
    from anima_ui.vae.npu_graphs import VaeGraphs

    print(f"\nNPU decoder on the simulated board (an estimate: no board has run it): GFLOP at "
          f"{board_latency.VAE_TFLOPS_PER_CORE} TFLOPS per core, the middle of what SD VAE decoders reach on one RK3588 "
          f"core; a batch of tiles over {board_latency.VAE_CORES} cores at {board_latency.VAE_CORES_SPEEDUP}x; "
          "load/init/release as a DiT FFN graph's")
    print(f"{'layout':<16} {'size':>9} {'graphs':<38} {'GFLOP':>7} {'board s':>8} {'vs sd.cpp':>9}")
    computed = len(plan(20)[0])
    denoise = computed * board_latency.serial_seconds_per_step()
    for size, folder in npu.items():
        graphs = VaeGraphs.read(folder)
        for layout, files in graphs.layouts.items():
            gflop = sum(graphs.entry(f).extra["gflop"] * runs_per_decode(graphs, f) for f in files)
            seconds = estimated_board_seconds(graphs, layout)
            speedup = f"{SDCPP_BOARD_SECONDS_512 / seconds:.0f}x" if size == 512 else "-"
            names = " + ".join(Path(f).stem.removeprefix("vae_") + (f" x{runs_per_decode(graphs, f)}" if runs_per_decode(graphs, f) > 1 else "")
                               for f in files)
            print(f"{layout:<16} {f'{size}x{size}':>9} {names:<38} {gflop:>7.0f} {seconds:>8.1f} {speedup:>9}")
            if size == 512 and layout == "untiled":
                print(f"{'  a 20-step Spectrum image':<26}: {computed} computed steps x {board_latency.serial_seconds_per_step():.1f} s "
                      f"(the serial loop's model) = {denoise:.0f} s, + decode: sd.cpp {SDCPP_BOARD_SECONDS_512:.0f} s "
                      f"(total {denoise + SDCPP_BOARD_SECONDS_512:.0f} s) or NPU untiled {seconds:.1f} s "
                      f"(total {denoise + seconds:.0f} s)")
    print(f"    sd.cpp tiled on the board's CPU: {SDCPP_BOARD_SECONDS_512:.0f} s at 512x512 (the source blog's measurement)")


def _print_simulator_table(npu: dict, tmp: Path) -> None:
    from anima_ui.vae.npu_graphs import convert_vae_graphs

    print("\nNPU decoder graphs converted with rknn-toolkit2 (FP16) and run on its simulator against onnxruntime fp32 "
          "(PSNR in [0,1] pixels, along each layout's chain; peak RSS of the conversion process)")
    print(f"{'graph':<26} {'size':>9} {'GFLOP':>7} {'build s':>8} {'sim s':>7} {'RSS build':>9} {'RSS +sim':>8} "
          f"{'CPU ops':>7} {'PSNR dB':>8}")
    for size, folder in npu.items():
        started = time.perf_counter()

        def progress(done, total, file, seconds, reused, result):
            print(f"  {done}/{total} {file}: {'kept' if reused else f'{seconds:.0f} s'}", file=sys.stderr, flush=True)

        graphs = convert_vae_graphs(folder, tmp / f"npu_rknn_{size}", progress=progress)
        for g in graphs.graphs:
            x = g.extra
            print(f"{Path(g.file).stem:<26} {f'{size}x{size}':>9} {x['gflop']:>7.0f} {x['build_seconds']:>8.1f} "
                  f"{x['check_seconds']:>7.1f} {x['build_peak_rss_mib'] / 1024:>8.2f}G {x['peak_rss_mib'] / 1024:>7.2f}G "
                  f"{len(x['cpu_ops']):>7} {x['sim_psnr']:>8.1f}")
        for layout, check in graphs.checks.items():
            print(f"{'  layout ' + layout:<26} {f'{size}x{size}':>9} {'':>7} {'':>8} {'':>7} {'':>9} {'':>8} {'':>7} "
                  f"{check['sim_psnr']:>8.1f}")
        print(f"    {size}x{size}: converted and simulated in {time.perf_counter() - started:.0f} s", flush=True)


def _print_board_table(folder: Path, core_mask: str, repeats: int) -> None:
    from anima_ui.runtime.executor import make_backend
    from anima_ui.vae.npu_decoder import check_npu_decoder, decode_npu
    from anima_ui.vae.npu_graphs import CHECK_LATENT, VaeGraphs

    graphs = VaeGraphs.read(folder)
    backend = make_backend("rknn")
    latent = np.load(folder / CHECK_LATENT)
    checks = check_npu_decoder(folder, backend, core_mask=core_mask)  # also the warm-up of every layout
    print(f"\nNPU decoder on this board's NPU ({graphs.width}x{graphs.height}, core mask {core_mask}, median of {repeats})")
    print(f"{'layout':<16} {'total s':>8} {'load':>6} {'init':>6} {'NPU':>6} {'release':>7} {'PSNR dB':>8} {'gate':>5}")
    for layout in graphs.layouts:
        runs = [decode_npu(latent, folder, backend, layout, core_mask=core_mask)[1] for _ in range(repeats)]
        med = {k: float(np.median([r[k] for r in runs])) for k in runs[0]}
        total = float(np.median([sum(r.values()) for r in runs]))
        print(f"{layout:<16} {total:>8.2f} {med['load']:>6.2f} {med['init']:>6.2f} {med['inference']:>6.2f} "
              f"{med['release']:>7.2f} {checks[layout]['psnr']:>8.1f} {'ok' if checks[layout]['ok'] else 'FAIL':>5}",
              flush=True)


def _print_preview_table(sizes, tmp: Path, repeats: int, threads: int) -> None:
    import torch

    from anima_ui.fixtures.weights import write_random_taehv
    from anima_ui.vae.preview import latent_to_rgb, preview_image
    from anima_ui.vae.taehv import load_taehv_decoder

    torch.set_num_threads(threads)
    taehv_path = tmp / "taew2_1.safetensors"
    write_random_taehv(taehv_path)
    taehv = load_taehv_decoder(taehv_path)
    cases = [("projection (latent px)", lambda x: latent_to_rgb(x), max(repeats, 50)),
             ("projection + 384 px display", lambda x: preview_image(x, 384), max(repeats, 50)),
             ("taew2_1 (8x, last frame)", taehv.decode, repeats)]
    print(f"\nPreview cost per step (median of N runs, {threads} threads)")
    print(f"{'preview':<30} {'image':>9} {'latent':>7} {'N':>3} {'median ms':>10}")
    for size in sizes:
        latent = bench_latent(size)
        for name, fn, n in cases:
            fn(latent)  # warm-up
            times = []
            for _ in range(n):
                start = time.perf_counter()
                fn(latent)
                times.append(time.perf_counter() - start)
            print(f"{name:<30} {f'{size}x{size}':>9} {f'{size // 8}x{size // 8}':>7} {n:>3} "
                  f"{1000 * float(np.median(times)):>10.2f}")


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--worker":
    _worker(json.loads(sys.argv[2]))
