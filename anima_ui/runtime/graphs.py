"""Where a backend finds its branch graphs in a model folder: `exported/<W>x<H>` (ONNX, run by the onnx and sim
backends) and `rknn/<W>x<H>` (RKNN, run by the rknn backend); batch-2 graphs (cond and uncond in one call) beside
them in `<W>x<H>-b2`. Their writers add the manifest.json last (and remove it while they rewrite the folder), so a
folder is ready once its manifest.json is there."""

from pathlib import Path

from anima_ui.errors import UserError
from anima_ui.runtime.manifest import MANIFEST


def graphs_ready(folder) -> bool:
    return Path(folder, MANIFEST).is_file()


def ready_graph_folders(models_dir, kind: str) -> list[Path]:
    """The finished graph folders of a model folder, by name: kind "exported" (ONNX) or "rknn"."""
    folder = Path(models_dir, kind)
    return sorted(p for p in folder.iterdir() if graphs_ready(p)) if folder.is_dir() else []


def graphs_dir(paths, backend: str, width: int, height: int, batch: int = 1) -> Path | None:
    """The folder `backend` runs for width x height and graph batch (None for torch, which runs no graphs). An ONNX
    folder may still be missing (`graphs_ready` says; `anima_ui.convert.model_graphs.export_model_graphs` makes it);
    RKNN graphs are made by `anima-ui prepare` (it needs .venv-rknn), so a missing RKNN folder is a UserError naming
    the commands that make it."""
    if backend == "torch":
        return None
    if backend != "rknn":
        return paths.exported_dir(width, height, batch)
    folder = paths.rknn_dir(width, height, batch)
    if not graphs_ready(folder):
        if batch == 1:
            raise UserError(f"no RKNN graphs for {width}x{height} in {folder}: run `anima-ui prepare --models {paths.root} "
                            f"--width {width} --height {height}` first (on the board or a PC)")
        exported = paths.exported_dir(width, height, batch)
        raise UserError(f"no RKNN graphs for {width}x{height} at batch {batch} in {folder}: run `anima-ui export --models "
                        f"{paths.root} --width {width} --height {height} --batch {batch}` and `anima-ui convert-rknn --onnx "
                        f"{exported} --out {folder}` first (on the board or a PC)")
    return folder
