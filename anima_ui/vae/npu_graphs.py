"""The NPU decoder's graphs for one image size: fixed-shape ONNX graphs built from the safetensors (no
torch), a manifest, and their conversion to FP16 RKNN, each graph checked on the toolkit's simulator.

Layouts (every one computes the untiled decode):
- untiled:    one graph, latent -> image;
- halo:       the trunk (latent -> features, untiled: it holds the only global op, the mid-block
              attention), then one up-path tile graph run once per tile of a halo plan (tiling.py);
- halo-batch: the trunk, then all the tiles as one batch graph (one call that can spread over NPU cores).
On onnxruntime the halo tiles reproduce the untiled up path bit for bit (tests/test_vae_npu.py).

Both folders follow the DiT graphs' protocol (convert/export.py): one writer at a time, every graph renamed
into place when complete with a record beside it, the manifest written last; a run after a kill keeps every
graph whose record still matches and redoes the rest. A converted folder also holds `check_latent.npy` and
the fp32 onnxruntime image of it per layout (`check_images.npz`): the board's gate decodes the one and
compares with the other.
"""

import json
import shutil
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx

from anima_ui.convert.convert_rknn import LOG, TARGETS, VENV_PYTHON, WORKER, rknn_name, toolkit_info
from anima_ui.convert.export import finish_folder, finished_graph, folder_lock, read_record, start_folder, write_record
from anima_ui.errors import UserError
from anima_ui.files import write_atomically
from anima_ui.metrics import psnr
from anima_ui.model.onnx_graph import write_model
from anima_ui.runtime.manifest import GraphEntry, TensorSpec, sha256_file
from anima_ui.vae.graphs import build_decoder_graph, graph_gflop
from anima_ui.vae.latent import SCALE, Z_DIM
from anima_ui.vae.onnx_decoder import ort_file_session
from anima_ui.vae.onnx_nodes import OPSET
from anima_ui.vae.tiling import HALO, HaloPlan, assemble, cut_windows, halo_plan
from anima_ui.vae.weights import DIM_MULT, load_decoder_weights

MANIFEST = "manifest.json"
LAYOUTS = ("untiled", "halo", "halo-batch")
# Three strips: one per NPU core for the batch graph, and less window area than 2x2 tiles at 512x512
# (3 x 64x39 against 4 x 45x45 latent px with the 13-px halo).
DEFAULT_GRID = (1, 3)
CHECK_LATENT, CHECK_IMAGES = "check_latent.npy", "check_images.npz"
MIN_SIM_PSNR = 60.0  # dB in [0,1] pixels, simulator (FP16) against onnxruntime fp32
GRAPHS_VERSION = 1  # bump when build_decoder_graph's output changes: kept graphs are then rebuilt
# Peak RSS (GiB) of one layout's conversion + simulator check, measured at 512x512 on full-size random weights
# (`anima-ui bench vae --sizes 512 --decoders --simulator`): untiled 6.0, halo 4.8 (its up-tile graph; the
# trunk 0.77), halo-batch 10.5. Assumed: the peak scales with the output's pixel count (the activations dominate;
# the decoder's weights are a few hundred MB), so at other sizes it is scaled by W*H / 512^2.
CONVERT_PEAK_GIB_512 = {"untiled": 6.0, "halo": 4.8, "halo-batch": 10.5}
CONVERT_FLOOR_GIB = 1.5  # left to the OS and the prepare process itself beside one conversion worker


@dataclass
class VaeGraphs:
    format: str  # "onnx" | "rknn"
    width: int  # image px
    height: int
    grid: tuple[int, int]  # halo tiles per axis
    halo: int  # latent px
    layouts: dict[str, list[str]]  # layout -> graph files in run order
    graphs: list[GraphEntry]
    source: dict
    tools: dict
    checks: dict  # layout -> simulator result of the whole chain (rknn folders)

    def entry(self, file: str) -> GraphEntry:
        return next(g for g in self.graphs if g.file == file)

    def plan(self) -> HaloPlan:
        return halo_plan(self.height // SCALE, self.width // SCALE, tuple(self.grid), self.halo)

    def write(self, folder) -> None:
        text = json.dumps(asdict(self), indent=1) + "\n"
        write_atomically(Path(folder, MANIFEST), lambda f: f.write(text.encode()))

    @classmethod
    def read(cls, folder) -> "VaeGraphs":
        path = Path(folder, MANIFEST)
        if not path.is_file():
            raise UserError(f"no NPU decoder graphs in {folder} ({MANIFEST} is missing); build them again")
        try:
            raw = json.loads(path.read_text())
            specs = lambda items: tuple(TensorSpec(s["name"], tuple(s["shape"]), s["dtype"]) for s in items)
            graphs = [GraphEntry(g["file"], g["block"], g["kind"], specs(g["inputs"]), specs(g["outputs"]), g["sha256"],
                                 g.get("extra", {})) for g in raw.pop("graphs")]
            manifest = cls(graphs=graphs, **{**raw, "grid": tuple(raw["grid"])})
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise UserError(f"{path} is damaged ({exc}); build the NPU decoder graphs again") from None
        for files in manifest.layouts.values():
            for file in files:
                if not Path(folder, file).is_file():
                    raise UserError(f"{file} listed in {path} is missing; build the NPU decoder graphs again")
        return manifest


def convert_layouts(width: int, height: int, available_bytes: int, chosen: list[str] | None = None) -> tuple[list[str], str | None]:
    """The layouts `prepare` converts: `chosen` (--decoder-layouts) as given, else those whose estimated
    conversion peak fits in `available_bytes` (MemAvailable at start) minus CONVERT_FLOOR_GIB. Returns (layouts,
    the line that says which were skipped and why, or None)."""
    if chosen is not None:
        unknown = [layout for layout in chosen if layout not in LAYOUTS]
        if unknown or not chosen:
            raise UserError(f"unknown NPU decoder layout {unknown or chosen}: choose from {', '.join(LAYOUTS)}")
        return list(dict.fromkeys(chosen)), None
    budget = available_bytes / 2**30 - CONVERT_FLOOR_GIB
    estimate = {layout: peak * width * height / 512**2 for layout, peak in CONVERT_PEAK_GIB_512.items()}
    kept = [layout for layout in LAYOUTS if estimate[layout] <= budget]
    skipped = [layout for layout in LAYOUTS if layout not in kept]
    if not skipped:
        return kept, None
    line = (f"decoder: skipping the {', '.join(f'{layout} (~{estimate[layout]:.1f} GiB)' for layout in skipped)} "
            f"layout{'s' if len(skipped) > 1 else ''}: the conversion would peak above the {budget:.1f} GiB available "
            f"(MemAvailable {available_bytes / 2**30:.1f} GiB minus a {CONVERT_FLOOR_GIB:g} GiB floor); "
            f"--decoder-layouts {','.join(LAYOUTS)} forces them, or convert on a PC with more memory")
    return kept, line


# ---------------------------------------------------------------- ONNX

def _graph_specs(layout: str, height: int, width: int, plan: HaloPlan) -> list[tuple[str, int, int, int]]:
    """(part, batch, height, width) of each graph of a layout, in run order (latent px)."""
    if layout == "untiled":
        return [("full", 1, height, width)]
    up_batch = len(plan.tiles) if layout == "halo-batch" else 1
    return [("trunk", 1, height, width), ("up", up_batch, *plan.window)]


def _file_name(part: str, batch: int, height: int, width: int) -> str:
    return f"vae_{part}_{'' if batch == 1 else f'b{batch}_'}{height}x{width}"


def build_vae_graphs(vae_path, width: int, height: int, out_dir, layouts=LAYOUTS, grid=DEFAULT_GRID,
                     progress=None) -> VaeGraphs:
    """Write the fp32 ONNX graphs of `layouts` for width x height images into `out_dir`, keeping the graphs an
    earlier run built from the same VAE file. progress(done, total, file, seconds, reused) after each graph."""
    if width % 16 or height % 16 or width <= 0 or height <= 0:
        raise UserError(f"{width}x{height}: width and height must be positive multiples of 16")
    unknown = [layout for layout in layouts if layout not in LAYOUTS]
    if unknown or not layouts:
        raise UserError(f"unknown NPU decoder layout {unknown or layouts}: choose from {', '.join(LAYOUTS)}")
    h, w = height // SCALE, width // SCALE
    plan = halo_plan(h, w, tuple(grid))
    names = {layout: [_file_name(*spec) + ".onnx" for spec in _graph_specs(layout, h, w, plan)] for layout in layouts}
    specs = {_file_name(*spec) + ".onnx": spec for layout in layouts for spec in _graph_specs(layout, h, w, plan)}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    source = {"file": Path(vae_path).name, "sha256": sha256_file(vae_path)}
    tools = {"opset": OPSET, "onnx": onnx.__version__, "graphs": GRAPHS_VERSION}
    weights = None  # read once, and only when a graph has to be built
    with folder_lock(out_dir):
        start_folder(out_dir)
        entries = []
        for done, (file, (part, batch, gh, gw)) in enumerate(specs.items(), 1):
            started = time.perf_counter()
            wanted = {"source": source, "tools": tools, "part": part, "batch": batch, "shape": [gh, gw]}
            record = read_record(out_dir, file) if finished_graph(out_dir, file, wanted) else None
            reused = record is not None
            if not reused:
                if weights is None:
                    base_dim, weights = load_decoder_weights(vae_path)
                model = build_decoder_graph(weights, base_dim, gh, gw, part=part, batch=batch)
                sha256 = write_model(model, out_dir / file)
                record = {**wanted, "sha256": sha256, "size": (out_dir / file).stat().st_size, "base_dim": base_dim,
                          "gflop": round(graph_gflop(model), 2)}
                write_record(out_dir, file, record)
            top = record["base_dim"] * DIM_MULT[-1]
            inputs = (TensorSpec("features", (batch, top, gh, gw), "float32") if part == "up"
                      else TensorSpec("latent", (batch, Z_DIM, gh, gw), "float32"),)
            outputs = (TensorSpec("features", (batch, top, gh, gw), "float32") if part == "trunk"
                       else TensorSpec("image", (batch, 3, gh * SCALE, gw * SCALE), "float32"),)
            entries.append(GraphEntry(file, 0, f"vae_{part}", inputs, outputs, record["sha256"], {"gflop": record["gflop"]}))
            if progress:
                progress(done, len(specs), file, time.perf_counter() - started, reused)
        manifest = VaeGraphs("onnx", width, height, tuple(plan_grid(plan)), HALO, names, entries,
                             {**source, "base_dim": record["base_dim"]}, tools, {})
        finish_folder(out_dir, manifest)
    return manifest


def plan_grid(plan: HaloPlan) -> tuple[int, int]:
    """Tiles per axis of a plan (a latent too small for the requested grid has fewer)."""
    return len({t.y for t in plan.tiles}), len({t.x for t in plan.tiles})


# ---------------------------------------------------------------- RKNN

def convert_vae_graphs(onnx_dir, out_dir, target: str = "rk3588", python=VENV_PYTHON, seed: int = 0,
                       progress=None) -> VaeGraphs:
    """FP16 .rknn graphs of an ONNX decoder folder, each built in .venv-rknn and run on the simulator along its
    layout's chain (the up path gets the simulated trunk's features). Every graph must reach MIN_SIM_PSNR
    against onnxruntime fp32 on the same inputs, in [0,1] pixels (the trunk's features through the fp32 up
    path), with no NaN/Inf. Graphs an earlier run finished from the same ONNX graph, toolkit and check input
    are kept. progress(done, total, file, seconds, reused, result) after each graph."""
    if target not in TARGETS:
        raise UserError(f"--target {target!r}: only {', '.join(TARGETS)} is supported")
    source = VaeGraphs.read(onnx_dir)
    if source.format != "onnx":
        raise UserError(f"{onnx_dir} holds {source.format} decoder graphs; point at an ONNX decoder folder")
    toolkit = toolkit_info(python)["rknn-toolkit2"]
    onnx_dir, out_dir = Path(onnx_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    chain = _Chain(onnx_dir, source, seed)
    with folder_lock(out_dir), tempfile.TemporaryDirectory(prefix="vae-sim-") as scratch:
        start_folder(out_dir)
        order = list(dict.fromkeys(f for files in source.layouts.values() for f in files))
        records, checks = {}, {}
        for layout, files in source.layouts.items():
            for file in files:
                if file in records:
                    continue  # the trunk, shared by both halo layouts
                started = time.perf_counter()
                rknn = rknn_name(file)
                wanted = {"onnx_sha256": source.entry(file).sha256, "toolkit": toolkit, "target": target, "seed": seed}
                if source.entry(file).kind == "vae_up":  # its check input is the simulated trunk's output
                    wanted["trunk_sha256"] = records[files[0]]["sha256"]
                record = read_record(out_dir, rknn) if finished_graph(out_dir, rknn, wanted) else None
                if record is not None and record.get("features") and not (out_dir / record["features"]).is_file():
                    record = None  # the trunk's simulated features are gone: the up graphs need them
                reused = record is not None
                if not reused:
                    record = _convert_and_check(python, chain, layout, files, file, out_dir, target, Path(scratch))
                    record = {**wanted, **record}
                    _check_graph(record, out_dir)
                    write_record(out_dir, rknn, record)
                records[file] = record
                if progress:
                    progress(len(records), len(order), rknn, time.perf_counter() - started, reused, record)
            checks[layout] = {"sim_psnr": records[files[-1]]["layout_psnr"], "sim_nonfinite": records[files[-1]]["sim_nonfinite"]}
        _write_check(out_dir, chain, source)
        graphs = [GraphEntry(rknn_name(e.file), e.block, e.kind, e.inputs, e.outputs, records[e.file]["sha256"],
                             {**e.extra, "onnx_file": e.file, "onnx_sha256": e.sha256,
                              **{k: records[e.file][k] for k in RECORD_KEYS}})
                  for e in source.graphs]
        layouts = {k: [rknn_name(f) for f in v] for k, v in source.layouts.items()}
        manifest = VaeGraphs("rknn", source.width, source.height, source.grid, source.halo, layouts, graphs,
                             {"onnx_manifest_sha256": sha256_file(onnx_dir / MANIFEST), **source.source},
                             {"rknn-toolkit2": toolkit, "target": target}, checks)
        finish_folder(out_dir, manifest)
    return manifest


RECORD_KEYS = ("sim_psnr", "sim_nonfinite", "cpu_ops", "npu_ops", "build_seconds", "check_seconds", "cpu_seconds",
               "build_peak_rss_mib", "peak_rss_mib")


class _Chain:
    """The fp32 side of the checks: the check latent, onnxruntime sessions of the ONNX graphs (opened on first
    use), and each layout's fp32 image of the latent."""

    def __init__(self, onnx_dir: Path, source: VaeGraphs, seed: int):
        self.onnx_dir, self.source, self.plan = onnx_dir, source, source.plan()
        shape = (1, Z_DIM, source.height // SCALE, source.width // SCALE)
        self.latent = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
        self.sessions, self.images, self.features = {}, {}, None

    def run(self, file: str, x: np.ndarray) -> np.ndarray:
        if file not in self.sessions:
            self.sessions[file] = ort_file_session(self.onnx_dir / file)
        return self.sessions[file].run(None, {self.source.entry(file).inputs[0].name: x})[0]

    def up_path(self, run, up: str, features: np.ndarray) -> np.ndarray:
        """Image [1,3,H,W] of trunk features through the up graph `up` (`run(file, x)` runs a graph)."""
        windows = cut_windows(features, self.plan)
        batched = self.source.entry(up).inputs[0].shape[0] > 1
        parts = [run(up, windows)] if batched else [run(up, w[None]) for w in windows]
        return assemble(np.concatenate(parts), self.plan)

    def image(self, layout: str) -> np.ndarray:
        """The fp32 image of the check latent through a layout's ONNX graphs."""
        if layout not in self.images:
            files = self.source.layouts[layout]
            if layout == "untiled":
                self.images[layout] = self.run(files[0], self.latent)
            else:
                if self.features is None:
                    self.features = self.run(files[0], self.latent)
                self.images[layout] = self.up_path(self.run, files[1], self.features)
        return self.images[layout]


def _convert_and_check(python: Path, chain: _Chain, layout: str, files: list[str], file: str, out_dir: Path,
                       target: str, scratch: Path) -> dict:
    """Convert one graph and check it on the simulator along `layout`'s chain; the worker's result plus
    sim_psnr (this graph), layout_psnr (the layout's simulated chain against its fp32 image) and, for the
    trunk, the file holding its simulated features."""
    entry = chain.source.entry(file)
    if entry.kind == "vae_full":
        (image,) = _simulate(python, chain, file, [chain.latent], out_dir, target, scratch)
        result = _worker_result(scratch, file)
        result["sim_psnr"] = result["layout_psnr"] = psnr(image, chain.image(layout))
    elif entry.kind == "vae_trunk":
        (features,) = _simulate(python, chain, file, [chain.latent], out_dir, target, scratch)
        result = _worker_result(scratch, file)
        # in pixel space: the simulated features through the fp32 up path
        result["sim_psnr"] = psnr(chain.up_path(chain.run, files[1], features), chain.image(layout))
        result["layout_psnr"] = result["sim_psnr"]
        result["features"] = rknn_name(file) + ".features.npy"
        write_atomically(out_dir / result["features"], lambda f: np.save(f, features))
    else:
        trunk = read_record(out_dir, rknn_name(files[0]))
        windows = cut_windows(np.load(out_dir / trunk["features"]), chain.plan)
        batched = entry.inputs[0].shape[0] > 1
        outputs = _simulate(python, chain, file, [windows] if batched else [w[None] for w in windows], out_dir, target, scratch)
        result = _worker_result(scratch, file)
        simulated = assemble(np.concatenate(outputs), chain.plan)
        through_fp32 = chain.up_path(chain.run, file, np.load(out_dir / trunk["features"]))
        result["sim_psnr"] = psnr(simulated, through_fp32)
        result["layout_psnr"] = psnr(simulated, chain.image(layout))
        result["sim_nonfinite"] += int((~np.isfinite(simulated)).sum())
    return {**result, "sim_psnr": round(float(result["sim_psnr"]), 2), "layout_psnr": round(float(result["layout_psnr"]), 2)}


def _simulate(python: Path, chain: _Chain, file: str, inputs: list[np.ndarray], out_dir: Path, target: str,
              scratch: Path) -> list[np.ndarray]:
    """Run the conversion worker on one graph with `inputs` (one simulator run each); its outputs."""
    feeds = scratch / Path(file).stem
    shutil.rmtree(feeds, ignore_errors=True)
    feeds.mkdir(parents=True)
    for i, x in enumerate(inputs):
        np.save(feeds / f"in_{i}.npy", x)
    command = [str(python), str(WORKER), "--onnx", str(chain.onnx_dir.resolve()), "--out", str(out_dir.resolve()),
               "--target", target, "--feeds", str(scratch), file]
    with open(out_dir / LOG, "a") as log:
        log.write(f"== {file}\n")
        log.flush()
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=log, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (out_dir / LOG).read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise UserError(f"RKNN conversion of {file} failed (exit {done.returncode}): {tail[0][:300]}; "
                        f"the toolkit's output is in {out_dir / LOG}")
    (feeds / "result.json").write_text(lines[-1])
    return [np.load(feeds / f"out_{i}.npy") for i in range(len(inputs))]


def _worker_result(scratch: Path, file: str) -> dict:
    return json.loads((scratch / Path(file).stem / "result.json").read_text())


def _check_graph(record: dict, out_dir: Path) -> None:
    if record["sim_nonfinite"] or not record["sim_shape_ok"] or not record["sim_psnr"] >= MIN_SIM_PSNR:
        (out_dir / record["file"]).unlink(missing_ok=True)  # no graph without a passing record
        raise UserError(f"{record['onnx_file']} failed the simulator check ({record['sim_psnr']:.1f} dB, "
                        f"{record['sim_nonfinite']} NaN/Inf; needs >= {MIN_SIM_PSNR:.0f} dB against onnxruntime fp32 and "
                        f"none; ops on the CPU: {', '.join(record['cpu_ops']) or 'none'}); see {out_dir / LOG}")


def _write_check(out_dir: Path, chain: _Chain, source: VaeGraphs) -> None:
    """What the board's gate compares with: the check latent and each layout's fp32 image of it."""
    images = {layout: chain.image(layout) for layout in source.layouts}
    write_atomically(out_dir / CHECK_LATENT, lambda f: np.save(f, chain.latent))
    write_atomically(out_dir / CHECK_IMAGES, lambda f: np.savez(f, **images))
