"""`--backend auto`: the NPU where it can run, else the fastest backend this machine's memory holds.

The rule (`choose`, a pure function of `Facts`):
1. rknn, when rknn-toolkit-lite2 imports, librknnrt.so loads and converted graphs exist for the size asked for
   (for `serve`, which takes its sizes from the converted folders: any converted size);
2. else torch, when torch is installed and MemAvailable holds what the torch backend keeps: the float32 weights
   of the DiT, the text encoder and the VAE, plus a quarter for activations and the process (13.1 GiB for the
   official release; the issue measured 12-14 GB); on a CPU it runs the branches in place, with no graph
   sessions to build per visit;
3. else onnx: the branch graphs through onnxruntime, which keeps only the host tensors in memory.
The simulated board (sim) is never chosen: it only imitates the board's timing."""

import importlib.util
import math
import os
from dataclasses import dataclass
from pathlib import Path

from anima_ui import modelfiles
from anima_ui.runtime import board
from anima_ui.runtime.graphs import ready_graph_folders
from anima_ui.runtime.memory import GIB, read_meminfo

TORCH_OVERHEAD = 1.25  # activations, the VAE decode and the Python process on top of the float32 weights
# parameters of the official release (DiT + Qwen3-0.6B + Qwen-Image VAE), for a model folder not downloaded yet
OFFICIAL_PARAMETERS = 2_091_068_928 + 596_049_920 + 126_892_531


@dataclass(frozen=True)
class Facts:
    rknn_blocker: str | None  # why the NPU runtime cannot run here; None when rknnlite imports and librknnrt.so loads
    rknn_sizes: tuple[str, ...]  # converted graph sizes in the model folder ("512x512", ...)
    size: str | None  # the size asked for; None: any converted size will do
    torch: bool  # torch is installed
    parameters: int  # of the model's DiT, text encoder and VAE
    available: int  # MemAvailable, bytes


@dataclass(frozen=True)
class Choice:
    backend: str
    reason: str

    def line(self) -> str:
        return f"--backend auto chose {self.backend}: {self.reason}"


def torch_bytes(parameters: int) -> int:
    return int(parameters * 4 * TORCH_OVERHEAD)


def choose(facts: Facts) -> Choice:
    graphs = facts.size in facts.rknn_sizes if facts.size else bool(facts.rknn_sizes)
    if facts.rknn_blocker is None and graphs:
        where = facts.size or ", ".join(facts.rknn_sizes)
        return Choice("rknn", f"the NPU runtime is here and converted graphs exist for {where}")
    if facts.rknn_blocker is not None:
        no_rknn = f"no NPU runtime ({facts.rknn_blocker})"
    else:
        no_rknn = f"no converted graphs for {facts.size}" if facts.size else "no converted graphs in the model folder"
    need, have = _size(torch_bytes(facts.parameters)), _size(facts.available)
    if facts.torch and facts.available >= torch_bytes(facts.parameters):
        return Choice("torch", f"{no_rknn}; torch fits (needs about {need} for this model, {have} available)")
    no_torch = "torch is not installed" if not facts.torch else f"torch would need about {need}, {have} available"
    return Choice("onnx", f"{no_rknn}; {no_torch}")


def _size(size: int) -> str:
    return f"{size / GIB:.1f} GiB" if size >= GIB else f"{size / (1 << 20):.0f} MiB"


def gather(models_dir, width: int | None = None, height: int | None = None, environ=os.environ) -> Facts:
    """This machine's facts for `choose`."""
    models = Path(models_dir)
    return Facts(
        rknn_blocker=rknn_blocker(environ),
        rknn_sizes=tuple(p.name for p in ready_graph_folders(models, "rknn")),
        size=f"{width}x{height}" if width and height else None,
        torch=importlib.util.find_spec("torch") is not None,
        parameters=model_parameters(models),
        available=read_meminfo().get("MemAvailable", 0),
    )


def rknn_blocker(environ) -> str | None:
    lite2 = board.find_lite2()
    if lite2.import_error is not None:
        return "rknn-toolkit-lite2 is not installed" if "rknnlite" in lite2.import_error else f"rknnlite: {lite2.import_error}"
    library = board.find_librknnrt(environ)
    if not library.exists:
        return f"no librknnrt.so at {library.path}"
    if library.load_error:
        return f"librknnrt.so does not load: {library.load_error}"
    return None


def model_parameters(models: Path) -> int:
    """Parameters of the DiT, text encoder and VAE in the folder (from their safetensors headers); the official
    release's when the files are not there yet."""
    dits = sorted((models / modelfiles.DIT_DIR).glob("*.safetensors"))
    files = [dits[-1] if dits else None, models / modelfiles.TEXT_ENCODER, models / modelfiles.VAE]
    if not all(f is not None and f.is_file() for f in files):
        return OFFICIAL_PARAMETERS
    return sum(_safetensors_parameters(f) for f in files)


def _safetensors_parameters(path: Path) -> int:
    header, _ = modelfiles.read_safetensors_header(path)
    return sum(math.prod(entry["shape"]) for key, entry in header.items() if key != "__metadata__")


def resolve(backend: str, models_dir, width: int | None = None, height: int | None = None) -> tuple[str, str | None]:
    """(the backend to run, the line saying why) for --backend; only "auto" is decided here."""
    if backend != "auto":
        return backend, None
    choice = choose(gather(models_dir, width, height))
    return choice.backend, choice.line()
