"""The NPU decoder's graphs for one image size: fixed-shape ONNX graphs built from the safetensors (no
torch), a manifest, and their conversion to FP16 RKNN, each graph checked on the toolkit's simulator.

Layouts (every one computes the untiled decode):
- untiled:    one graph, latent -> image;
- halo:       the trunk (latent -> features, untiled: it holds the only global op, the mid-block
              attention), then one up-path tile graph run once per tile of a halo plan (tiling.py);
- halo-batch: the trunk, then all the tiles as one batch graph (one call that can spread over NPU cores).
On onnxruntime the halo tiles reproduce the untiled up path bit for bit (tests/test_vae_npu.py).

A folder holds `manifest.json`, the graph files and, after conversion, `check_latent.npy` with the fp32
onnxruntime image of it (`check_image.npy`): the board's gate decodes the one and compares with the other.
The folder appears whole or not at all (written next to it, then renamed).
"""

import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx

from anima_ui.errors import UserError
from anima_ui.metrics import psnr
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
CHECK_LATENT, CHECK_IMAGE = "check_latent.npy", "check_image.npy"
MIN_SIM_PSNR = 60.0  # dB in [0,1] pixels, simulator (FP16) against onnxruntime fp32
REPO_ROOT = Path(__file__).resolve().parents[2]
VENV_PYTHON = REPO_ROOT / ".venv-rknn" / "bin" / "python"
WORKER = Path(__file__).with_name("rknn_worker.py")
LOG = "convert.log"


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
    checks: dict  # layout -> simulator results (rknn folders)

    def entry(self, file: str) -> GraphEntry:
        return next(g for g in self.graphs if g.file == file)

    def plan(self) -> HaloPlan:
        return halo_plan(self.height // SCALE, self.width // SCALE, tuple(self.grid), self.halo)

    def write(self, folder) -> None:
        Path(folder, MANIFEST).write_text(json.dumps(asdict(self), indent=1) + "\n")

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
            manifest = cls(graphs=graphs, **raw)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise UserError(f"{path} is damaged ({exc}); build the NPU decoder graphs again") from None
        for files in manifest.layouts.values():
            for file in files:
                if not Path(folder, file).is_file():
                    raise UserError(f"{file} listed in {path} is missing; build the NPU decoder graphs again")
        return manifest


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
    """Write the fp32 ONNX graphs of `layouts` for width x height images into `out_dir` (replacing it)."""
    if width % 16 or height % 16 or width <= 0 or height <= 0:
        raise UserError(f"{width}x{height}: width and height must be positive multiples of 16")
    unknown = [layout for layout in layouts if layout not in LAYOUTS]
    if unknown or not layouts:
        raise UserError(f"unknown NPU decoder layout {unknown or layouts}: choose from {', '.join(LAYOUTS)}")
    base_dim, weights = load_decoder_weights(vae_path)
    h, w = height // SCALE, width // SCALE
    plan = halo_plan(h, w, tuple(grid))
    top = base_dim * DIM_MULT[-1]
    with _new_folder(out_dir) as temp:
        entries, names = {}, {}
        for layout in layouts:
            names[layout] = []
            for part, batch, gh, gw in _graph_specs(layout, h, w, plan):
                file = _file_name(part, batch, gh, gw) + ".onnx"
                names[layout].append(file)
                if file in entries:
                    continue  # the trunk is shared by both halo layouts
                model = build_decoder_graph(weights, base_dim, gh, gw, part=part, batch=batch)
                onnx.save(model, str(temp / file))
                inputs = (TensorSpec("features", (batch, top, gh, gw), "float32") if part == "up"
                          else TensorSpec("latent", (batch, Z_DIM, gh, gw), "float32"),)
                outputs = (TensorSpec("features", (batch, top, gh, gw), "float32") if part == "trunk"
                           else TensorSpec("image", (batch, 3, gh * SCALE, gw * SCALE), "float32"),)
                entries[file] = GraphEntry(file, 0, f"vae_{part}", inputs, outputs, sha256_file(temp / file),
                                           {"gflop": round(graph_gflop(model), 2)})
                if progress:
                    progress(f"built {file}")
        manifest = VaeGraphs("onnx", width, height, tuple(plan_grid(plan)), HALO, names, list(entries.values()),
                             {"file": Path(vae_path).name, "sha256": sha256_file(vae_path), "base_dim": base_dim},
                             {"opset": OPSET, "onnx": onnx.__version__}, {})
        manifest.write(temp)
    return manifest


def plan_grid(plan: HaloPlan) -> tuple[int, int]:
    """Tiles per axis of a plan (a latent too small for the requested grid has fewer)."""
    return len({t.y for t in plan.tiles}), len({t.x for t in plan.tiles})


class _new_folder:
    """A temporary sibling of `out_dir` that replaces it when the block succeeds, and vanishes otherwise."""

    def __init__(self, out_dir):
        self.out_dir = Path(out_dir)

    def __enter__(self) -> Path:
        self.out_dir.parent.mkdir(parents=True, exist_ok=True)
        self.temp = Path(tempfile.mkdtemp(prefix=f".{self.out_dir.name}.build-", dir=self.out_dir.parent))
        return self.temp

    def __exit__(self, kind, exc, tb):
        if kind is not None:
            shutil.rmtree(self.temp, ignore_errors=True)
            return False
        old = None
        if self.out_dir.exists():
            old = self.out_dir.with_name(f".{self.out_dir.name}.old-{os.getpid()}")
            self.out_dir.rename(old)
        self.temp.rename(self.out_dir)
        if old is not None:
            shutil.rmtree(old)
        return False


# ---------------------------------------------------------------- RKNN

def convert_vae_graphs(onnx_dir, out_dir, target: str = "rk3588", python=VENV_PYTHON, seed: int = 0,
                       progress=None) -> VaeGraphs:
    """FP16 .rknn graphs of an ONNX decoder folder, each built in .venv-rknn and run on the simulator along its
    layout's chain (the up path gets the simulated trunk's features). Every graph must reach MIN_SIM_PSNR
    against onnxruntime fp32 on the same inputs, in [0,1] pixels (the trunk's features through the fp32 up
    path), with no NaN/Inf; the folder is written only then."""
    if target != "rk3588":
        raise UserError(f"--target {target!r}: only rk3588 is supported")
    python = Path(python)
    if not python.exists():
        raise UserError(f"no RKNN conversion environment at {python}: run scripts/make_rknn_venv.sh first")
    source = VaeGraphs.read(onnx_dir)
    if source.format != "onnx":
        raise UserError(f"{onnx_dir} holds {source.format} decoder graphs; point at an ONNX decoder folder")
    onnx_dir = Path(onnx_dir)
    latent = np.random.default_rng(seed).standard_normal((1, Z_DIM, source.height // SCALE, source.width // SCALE))
    latent = latent.astype(np.float32)
    plan = source.plan()
    ort = {}

    def fp32(file, x):
        if file not in ort:
            ort[file] = ort_file_session(onnx_dir / file)
        return ort[file].run(None, {source.entry(file).inputs[0].name: x})[0]

    def up_path(run, file, windows, batched):
        parts = [run(file, windows)] if batched else [run(file, windows[i:i + 1]) for i in range(len(windows))]
        return assemble(np.concatenate(parts), plan)

    log = Path(out_dir).with_name(f"{Path(out_dir).name}.{LOG}")  # kept when the conversion fails
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    with _new_folder(out_dir) as temp, tempfile.TemporaryDirectory(prefix="vae-sim-") as scratch:
        results, simulated, checks = {}, {}, {}

        def convert(file, inputs):
            if file not in simulated:
                results[file], simulated[file] = _convert_one(python, onnx_dir / file, temp, target, inputs,
                                                              Path(scratch), log, progress)
            return simulated[file]

        reference = None
        for layout, files in source.layouts.items():
            if layout == "untiled":
                image = fp32(files[0], latent)
                sim = convert(files[0], [latent])[0]
                results[files[0]]["sim_psnr"] = psnr(sim, image)
            else:
                trunk, up = files
                batched = source.entry(up).inputs[0].shape[0] > 1
                features = fp32(trunk, latent)
                image = up_path(fp32, up, cut_windows(features, plan), batched)
                sim_windows = cut_windows(convert(trunk, [latent])[0], plan)
                through_fp32 = up_path(fp32, up, sim_windows, batched)
                results[trunk].setdefault("sim_psnr", psnr(through_fp32, image))
                sim_parts = convert(up, [sim_windows] if batched else [w[None] for w in sim_windows])
                sim = assemble(np.concatenate(sim_parts), plan)
                results[up]["sim_psnr"] = psnr(sim, through_fp32)
            reference = image if reference is None else reference
            checks[layout] = {"sim_psnr": round(float(psnr(sim, image)), 2), "sim_nonfinite": int((~np.isfinite(sim)).sum())}
            if progress:
                progress(f"{layout}: simulator {checks[layout]['sim_psnr']:.1f} dB against onnxruntime fp32")
        _check_simulation(results, checks, log)
        log.rename(temp / LOG)
        np.save(temp / CHECK_LATENT, latent)
        np.save(temp / CHECK_IMAGE, reference)
        graphs = []
        for entry in source.graphs:
            file = Path(entry.file).with_suffix(".rknn").name
            extra = {**entry.extra, **results[entry.file], "onnx_file": entry.file, "onnx_sha256": entry.sha256}
            graphs.append(GraphEntry(file, entry.block, entry.kind, entry.inputs, entry.outputs, sha256_file(temp / file), extra))
        layouts = {k: [Path(f).with_suffix(".rknn").name for f in v] for k, v in source.layouts.items()}
        tools = {"rknn-toolkit2": next(iter(results.values()))["toolkit"], "target": target}
        manifest = VaeGraphs("rknn", source.width, source.height, source.grid, source.halo, layouts, graphs,
                             {"onnx_manifest_sha256": sha256_file(onnx_dir / MANIFEST), **source.source}, tools, checks)
        manifest.write(temp)
    return manifest


def _convert_one(python: Path, onnx_path: Path, out: Path, target: str, inputs: list[np.ndarray], scratch: Path,
                 log: Path, progress) -> tuple[dict, list[np.ndarray]]:
    folder = Path(tempfile.mkdtemp(prefix=onnx_path.stem + "-", dir=scratch))
    paths = []
    for i, x in enumerate(inputs):
        paths.append(folder / f"in_{i}.npy")
        np.save(paths[-1], x)
    command = [str(python), str(WORKER), "--onnx", str(onnx_path), "--rknn", str(out / (onnx_path.stem + ".rknn")),
               "--target", target, "--outputs", str(folder), "--inputs", *map(str, paths)]
    with open(log, "a") as stream:
        stream.write(f"== {onnx_path.name}\n")
        stream.flush()
        # cwd: the toolkit writes its intermediate check*.onnx files into the working directory
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=stream, text=True, cwd=folder)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise UserError(f"RKNN conversion of {onnx_path.name} failed (exit {done.returncode}): {tail[0][:300]}")
    result = json.loads(lines[-1])
    if progress:
        progress(f"{onnx_path.stem}.rknn: built in {result['build_seconds']:.1f} s, simulated in {result['sim_seconds']:.1f} s, "
                 f"peak RSS {result['peak_rss_gb']:.2f} GB")
    outputs = [np.load(folder / f"out_{i}.npy") for i in range(len(inputs))]
    result["sim_nonfinite"] = int(sum((~np.isfinite(x)).sum() for x in outputs))
    shutil.rmtree(folder)
    return result, outputs


def _check_simulation(results: dict, checks: dict, log: Path) -> None:
    for file, r in results.items():
        r["sim_psnr"] = round(float(r["sim_psnr"]), 2)
        if r["sim_nonfinite"] or not r["sim_psnr"] >= MIN_SIM_PSNR:
            raise UserError(f"{file} failed the simulator check ({r['sim_psnr']:.1f} dB, {r['sim_nonfinite']} NaN/Inf; "
                            f"needs >= {MIN_SIM_PSNR:.0f} dB against onnxruntime fp32 and none; ops on the CPU: "
                            f"{', '.join(r['cpu_ops']) or 'none'}); see {log}")
    for layout, check in checks.items():
        if check["sim_nonfinite"]:
            raise UserError(f"the {layout} decoder gave {check['sim_nonfinite']} NaN/Inf values on the simulator; see {log}")
