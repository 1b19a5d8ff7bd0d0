"""`--decoder npu`: the decoder graphs of one layout (npu_graphs.py) run through a runtime backend (onnx,
sim, rknn) with the board's lifecycle per graph: load -> init -> run (once per tile, or once for a batch
graph) -> release. One context is open at a time; the cancel event is checked before every graph and every
run, and a context is released whatever happens."""

import threading
import time
from pathlib import Path

import numpy as np

from anima_ui.errors import Cancelled, UserError
from anima_ui.metrics import psnr
from anima_ui.runtime import board_latency
from anima_ui.runtime.backends import Backend
from anima_ui.runtime.executor import make_backend
from anima_ui.vae.latent import SCALE, Z_DIM, check_latent, to_uint8
from anima_ui.vae.npu_graphs import CHECK_IMAGES, CHECK_LATENT, MANIFEST, VaeGraphs, build_vae_graphs
from anima_ui.vae.onnx_decoder import OnnxDecoder
from anima_ui.vae.tiling import assemble, cut_windows

# the fewest FLOPs: 1100 GFLOP at 512x512 against 1950 for the 1x3 halo layouts; `tune` may choose another
DEFAULT_LAYOUT = "untiled"
# when a folder lacks the default (prepare skips the layouts whose conversion does not fit in memory): one
# graph before one batch call before a graph per tile
LAYOUT_PREFERENCE = ("untiled", "halo-batch", "halo")
MIN_BOARD_PSNR = 50.0  # dB: the board's gate against the fp32 decode of the same layout


def pick_layout(graphs: VaeGraphs) -> str:
    """The layout the NPU decoder runs from this folder: DEFAULT_LAYOUT when it has it, else its first layout in
    LAYOUT_PREFERENCE order."""
    return next(layout for layout in (DEFAULT_LAYOUT, *LAYOUT_PREFERENCE) if layout in graphs.layouts)


def model_layout(vae_path, backend: str, width: int, height: int) -> str:
    """pick_layout of the folder a model's NPU decoder runs on this backend (onnx, sim: the ONNX graphs; rknn: the
    converted ones) for this size; DEFAULT_LAYOUT while it has none (ONNX graphs are built with every layout on
    first use)."""
    folder = graphs_folder(vae_path, "rknn" if backend == "rknn" else "onnx", width, height)
    return pick_layout(VaeGraphs.read(folder)) if (folder / MANIFEST).is_file() else DEFAULT_LAYOUT


def decode_npu(latent, graphs_dir, backend: Backend | str = "onnx", layout: str | None = None,
               cancel: threading.Event | None = None, core_mask: str = "auto", **backend_options) -> tuple[np.ndarray, dict]:
    """Model-space latent [1,16,h,w] -> (uint8 RGB [8h,8w,3], seconds per phase). layout: None picks the
    folder's (pick_layout). core_mask: the NPU cores of each context; `backend_options` go to make_backend when `backend` is a name (time_scale, threads)."""
    graphs = VaeGraphs.read(graphs_dir)
    if isinstance(backend, str):
        backend = make_backend(backend, **backend_options)
    if graphs.format != backend.graph_format:
        raise UserError(f"{graphs_dir} holds {graphs.format} decoder graphs but the {backend.name} backend runs "
                        f"{backend.graph_format}; use the decoder's {backend.graph_format} folder")
    latent = check_latent(latent)
    if latent.shape[2:] != (graphs.height // SCALE, graphs.width // SCALE):
        raise UserError(f"the NPU decoder graphs in {graphs_dir} are for {graphs.width}x{graphs.height}, the image is "
                        f"{latent.shape[3] * SCALE}x{latent.shape[2] * SCALE}; build them for this size")
    seconds = dict.fromkeys(("load", "init", "inference", "release"), 0.0)
    image = run_layout(latent, graphs, Path(graphs_dir), backend, layout or pick_layout(graphs), cancel, seconds, core_mask)
    return to_uint8(image[0].transpose(1, 2, 0)), seconds


def run_layout(latent: np.ndarray, graphs: VaeGraphs, folder: Path, backend: Backend, layout: str,
               cancel: threading.Event | None, seconds: dict, core_mask: str = "auto") -> np.ndarray:
    """The image [1,3,8h,8w] in [0,1] (float32) of one layout's graphs."""
    if layout not in graphs.layouts:
        raise UserError(f"no {layout!r} NPU decoder layout in {folder} (it has {', '.join(graphs.layouts)}); "
                        f"choose one of those")
    files = graphs.layouts[layout]
    if layout == "untiled":
        return _run_graph(backend, folder, graphs.entry(files[0]), [latent], cancel, seconds, core_mask)[0]
    trunk, up = (graphs.entry(f) for f in files)
    features = _run_graph(backend, folder, trunk, [latent], cancel, seconds, core_mask)[0]
    plan = graphs.plan()
    windows = cut_windows(features, plan)
    calls = [windows] if up.inputs[0].shape[0] > 1 else [window[None] for window in windows]
    return assemble(np.concatenate(_run_graph(backend, folder, up, calls, cancel, seconds, core_mask)), plan)


def _run_graph(backend: Backend, folder: Path, entry, calls: list[np.ndarray], cancel, seconds: dict,
               core_mask: str) -> list[np.ndarray]:
    _check(cancel)
    started = time.perf_counter()
    loaded = backend.load(folder / entry.file, entry)
    seconds["load"] += time.perf_counter() - started
    started = time.perf_counter()
    context = backend.init(loaded, entry, core_mask)
    del loaded  # the file's bytes: the context no longer needs them
    seconds["init"] += time.perf_counter() - started
    try:
        outputs = []
        for x in calls:
            _check(cancel)
            started = time.perf_counter()
            out = np.asarray(backend.run(context, entry, [x.astype(backend.input_dtype(entry, 0))]), np.float32)
            seconds["inference"] += time.perf_counter() - started
            expected = entry.outputs[0].shape
            if out.size != int(np.prod(expected)):
                raise UserError(f"{entry.file} returned shape {out.shape}, its manifest says {expected}; "
                                "build and convert the NPU decoder graphs again")
            outputs.append(out.reshape(expected))
    finally:
        started = time.perf_counter()
        backend.release(context, entry)
        del context
        seconds["release"] += time.perf_counter() - started
    return outputs


def _check(cancel) -> None:
    if cancel is not None and cancel.is_set():
        raise Cancelled("cancelled")


def check_npu_decoder(graphs_dir, backend: Backend | str = "rknn", layouts=None, vae_path=None,
                      core_mask: str = "auto",
                      **backend_options) -> dict:
    """The board's gate: decode the folder's stored check latent with each layout and compare with the fp32
    onnxruntime image of the same layout stored next to it at conversion. A folder without them (ONNX graphs
    built here) is checked against the project's fp32 decoder of `vae_path` on a fixed latent, untiled: the
    halo plan is exact, so that is every layout's fp32 image. Returns {layout: {"psnr", "nonfinite",
    "seconds", "ok"}}; ok means >= MIN_BOARD_PSNR dB with no NaN/Inf."""
    folder = Path(graphs_dir)
    graphs = VaeGraphs.read(folder)
    if (folder / CHECK_LATENT).is_file() and (folder / CHECK_IMAGES).is_file():
        latent = np.load(folder / CHECK_LATENT)
        with np.load(folder / CHECK_IMAGES) as stored:
            references = {layout: stored[layout] for layout in stored.files}
    elif vae_path is not None:
        shape = (1, Z_DIM, graphs.height // SCALE, graphs.width // SCALE)
        latent = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
        image = OnnxDecoder(vae_path).decode_float(latent).transpose(2, 0, 1)[None]
        references = dict.fromkeys(graphs.layouts, image)
    else:
        raise UserError(f"{folder} has no stored check latent and images; convert the NPU decoder graphs again "
                        "(anima-ui prepare)")
    if isinstance(backend, str):
        backend = make_backend(backend, **backend_options)
    results = {}
    for layout in layouts or graphs.layouts:
        if layout not in references:
            raise UserError(f"{folder} has no stored check image for the {layout} layout; convert the NPU decoder "
                            "graphs again (anima-ui prepare)")
        seconds = dict.fromkeys(("load", "init", "inference", "release"), 0.0)
        image = run_layout(latent, graphs, folder, backend, layout, None, seconds, core_mask)
        nonfinite = int((~np.isfinite(image)).sum())
        quality = psnr(np.nan_to_num(image), references[layout])
        results[layout] = {"psnr": round(float(quality), 2), "nonfinite": nonfinite,
                           "seconds": round(sum(seconds.values()), 3),
                           "ok": nonfinite == 0 and quality >= MIN_BOARD_PSNR}
    return results


def estimated_board_seconds(graphs: VaeGraphs, layout: str) -> float:
    """What the simulated board charges for one decode with `layout`: every graph's load, init and release,
    and its inference once per call (board_latency's decode model)."""
    total = 0.0
    for file in graphs.layouts[layout]:
        entry = graphs.entry(file)
        phases = board_latency.graph_phase_seconds(entry)
        total += phases["load"] + phases["init"] + phases["release"] + runs_per_decode(graphs, file) * phases["inference"]
    return total


def runs_per_decode(graphs: VaeGraphs, file: str) -> int:
    """How often a decode runs a graph: an up-path tile graph of batch 1 once per tile, the others once."""
    entry = graphs.entry(file)
    return len(graphs.plan().tiles) if entry.kind == "vae_up" and entry.inputs[0].shape[0] == 1 else 1


def graphs_folder(vae_path, graph_format: str, width: int, height: int) -> Path:
    """Where a model keeps its NPU decoder graphs: next to the VAE file, vae/npu/<onnx|rknn>/<W>x<H>."""
    return Path(vae_path).parent / "npu" / graph_format / f"{width}x{height}"


def decode_for_model(latent, vae_path, backend: str = "onnx", layout: str | None = None, cancel=None,
                     core_mask: str = "auto", **backend_options) -> np.ndarray:
    """decode_npu with the model's own graphs folder: the ONNX graphs (onnx, sim) are built on first use,
    the RKNN ones must have been converted. layout: None picks the folder's (pick_layout)."""
    _, _, h, w = np.shape(latent)
    backend = make_backend(backend, **backend_options)
    folder = graphs_folder(vae_path, backend.graph_format, w * SCALE, h * SCALE)
    if not (folder / MANIFEST).is_file():
        if backend.graph_format != "onnx":
            raise UserError(f"no converted NPU decoder graphs for {w * SCALE}x{h * SCALE} in {folder}; "
                            "use --decoder sdcpp")
        build_vae_graphs(vae_path, w * SCALE, h * SCALE, folder)
    pixels, _ = decode_npu(latent, folder, backend, layout, cancel, core_mask)
    return pixels
