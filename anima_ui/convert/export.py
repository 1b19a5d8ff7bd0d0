"""`anima-ui export`: the 28 x 3 DiT branch graphs as fixed-shape ONNX (opset 19) for one resolution,
plus manifest.json. The cross-attention K/V of the text are graph inputs (computed once per prompt on
the host by `cross_attention_kv`), not projections inside the graph.

Streamed and resumable: each graph is built from its own tensors, read straight from the safetensors
file (a few hundred MB at full size, never the whole fp32 DiT), written atomically, and followed by a
small record (`<graph>.json`: its sha256 and size, the checkpoint's sha256, shapes and dtype). A graph
whose record matches the request and whose bytes still hash to it is kept; anything else is rebuilt. The
manifest is written last, so a folder without one is unfinished and the runtime refuses it."""

import fcntl
import importlib.metadata
import json
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from anima_ui.errors import UserError
from anima_ui.files import PARTIAL, write_atomically
from anima_ui.model.branch_graphs import BRANCH_WEIGHTS, GRAPHS_VERSION, branch_graph
from anima_ui.model.checkpoint import open_dit
from anima_ui.model.config import BRANCH_INPUTS, BRANCH_KINDS, AnimaConfig
from anima_ui.model.onnx_graph import OPSET, write_model
from anima_ui.runtime.manifest import MANIFEST, GraphEntry, Manifest, TensorSpec, sha256_file
from anima_ui.runtime.profile import PROFILE

DTYPES = {"fp32": "float32", "fp16": "float16"}


def branch_input_specs(cfg: AnimaConfig, kind: str, width: int, height: int, batch: int, dtype: str) -> tuple[TensorSpec, ...]:
    """The fixed input shapes of one branch graph at width x height (image tokens N, text tokens S)."""
    tokens = image_tokens(cfg, width, height)
    shapes = {
        "h": ((batch, tokens, cfg.width), True),
        "rope_cos": ((tokens, cfg.head_dim), False),
        "rope_sin": ((tokens, cfg.head_dim), False),
        "k": ((batch, cfg.context_len, cfg.width), True),
        "v": ((batch, cfg.context_len, cfg.width), True),
    }
    return tuple(TensorSpec(name, shapes[name][0], dtype, shapes[name][1]) for name in BRANCH_INPUTS[kind])


def image_tokens(cfg: AnimaConfig, width: int, height: int) -> int:
    if width % 16 or height % 16 or width <= 0 or height <= 0:
        raise UserError(f"{width}x{height}: width and height must be positive multiples of 16")
    return (height // 8 // cfg.patch) * (width // 8 // cfg.patch)


def graph_file(block: int, kind: str) -> str:
    return f"block{block:02d}_{kind}.onnx"


def export_graphs(checkpoint, width: int, height: int, out_dir, dtype: str = "fp32", batch: int = 1,
                  progress=None, blocks: int | None = None) -> Manifest:
    """Write the 84 graphs of the DiT in `checkpoint` (a safetensors path, or the ModelPaths holding it) for
    width x height into `out_dir`, keeping graphs a previous (possibly killed) run finished.
    progress(done, total, file, seconds, reused) is called after each graph. blocks: only the first N blocks'
    graphs (a sample: `anima-ui tune` measures batch-2 variants on one without exporting the whole model)."""
    checkpoint = Path(getattr(checkpoint, "dit", checkpoint))
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: choose fp32 or fp16")
    if batch not in (1, 2):
        raise UserError(f"--batch {batch}: choose 1 (cond and uncond as two calls) or 2 (one batch-2 call)")
    cfg, dit = open_dit(checkpoint)
    image_tokens(cfg, width, height)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with folder_lock(out_dir):
        source = {"file": checkpoint.name, "sha256": sha256_file(checkpoint)}
        tools = {"opset": OPSET, "graphs": GRAPHS_VERSION, **{name: _version(name) for name in ("anima-ui", "onnx")}}
        start_folder(out_dir)
        order = [(block, kind) for block in range(min(blocks or cfg.num_blocks, cfg.num_blocks)) for kind in BRANCH_KINDS]
        graphs = []
        for done, (block, kind) in enumerate(order, 1):
            started = time.perf_counter()
            inputs = branch_input_specs(cfg, kind, width, height, batch, DTYPES[dtype])
            entry = GraphEntry(graph_file(block, kind), block, kind, inputs, (TensorSpec("out", inputs[0].shape, DTYPES[dtype], True),), "")
            wanted = {"source": source, "tools": tools, "inputs": [asdict(s) for s in entry.inputs],
                      "outputs": [asdict(s) for s in entry.outputs]}
            sha256 = finished_graph(out_dir, entry.file, wanted)
            reused = sha256 is not None
            if not reused:
                weights = {name: dit.read(f"blocks.{block}.{name}") for name in BRANCH_WEIGHTS[kind]}
                model = branch_graph(kind, weights, batch, inputs[0].shape[1], cfg.context_len, DTYPES[dtype])
                del weights
                sha256 = write_model(model, out_dir / entry.file)
                del model
                write_record(out_dir, entry.file, {**wanted, "sha256": sha256, "size": (out_dir / entry.file).stat().st_size})
            graphs.append(GraphEntry(entry.file, block, kind, entry.inputs, entry.outputs, sha256))
            if progress:
                progress(done, len(order), entry.file, time.perf_counter() - started, reused)
        manifest = Manifest(format="onnx", width=width, height=height, batch=batch, dtype=dtype, graphs=graphs,
                            source=source, tools=tools)
        finish_folder(out_dir, manifest)
    return manifest


# -- the per-graph records and the folder protocol (shared with the RKNN conversion) -------------------------------
def record_path(folder: Path, file: str) -> Path:
    return folder / f"{file}.json"


def write_record(folder: Path, file: str, record: dict) -> None:
    text = json.dumps(record, indent=1, sort_keys=True) + "\n"
    write_atomically(record_path(folder, file), lambda f: f.write(text.encode()))


def read_record(folder: Path, file: str) -> dict | None:
    try:
        return json.loads(record_path(folder, file).read_text())
    except (OSError, ValueError):
        return None


def finished_graph(folder: Path, file: str, wanted: dict) -> str | None:
    """The sha256 of `file` if a previous run finished it for the same request (its record matches `wanted`
    and the file's size and bytes still match the record), else None."""
    record = read_record(folder, file)
    wanted = json.loads(json.dumps(wanted))  # tuples become lists, as in the stored record
    path = folder / file
    if record is None or any(record.get(key) != value for key, value in wanted.items()):
        return None
    if not path.is_file() or path.stat().st_size != record.get("size") or sha256_file(path) != record.get("sha256"):
        return None
    return record["sha256"]


def start_folder(folder: Path) -> None:
    """The folder is being (re)written: without a manifest no reader takes it for finished; leftovers of a
    killed writer (temp files) go."""
    (folder / MANIFEST).unlink(missing_ok=True)
    for leftover in folder.glob(f".*{PARTIAL}*"):
        leftover.unlink()


def finish_folder(folder: Path, manifest: Manifest) -> None:
    """Drop files no graph of `manifest` owns (another size's or dtype's graphs), then write the manifest."""
    # the tune profile measured how the graphs run, not what they hold: it stays
    keep = {MANIFEST, PROFILE} | {g.file for g in manifest.graphs} | {record_path(folder, g.file).name for g in manifest.graphs}
    for path in folder.iterdir():
        if path.is_file() and path.name not in keep and path.name != ".lock" and path.suffix in (".onnx", ".rknn", ".json"):
            path.unlink()
    manifest.write(folder)


@contextmanager
def folder_lock(folder: Path):
    """One writer per graphs folder: a second export or conversion into it stops with a clear message."""
    with open(folder / ".lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(f"another anima-ui process is writing {folder}; wait for it to finish") from None
        yield


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
