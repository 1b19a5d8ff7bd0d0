"""`--backend auto`: the NPU where it can run, else the fastest backend this machine's memory holds.

The rule (`choose`, a pure function of `Facts`):
1. rknn, when rknn-toolkit-lite2 imports, librknnrt.so loads and converted graphs exist for the size asked for
   (for `serve`, which takes its sizes from the converted folders: any converted size);
2. else torch, when torch is installed and MemAvailable holds what the torch backend keeps: the float32 DiT
   without its LLM adapter, plus a quarter for activations, the text encoding, the decode and the process
   (9.1 GiB for the official release). The text encoder and the adapter are not counted: every backend streams
   them from their files per prompt and drops them. On a CPU torch runs the branches in place, with no graph
   sessions to build per visit;
3. else onnx: the branch graphs through onnxruntime, which keeps only the host tensors in memory.
The simulated board (sim) is never chosen: it only imitates the board's timing."""

import importlib.util
import math
import os
from dataclasses import dataclass
from pathlib import Path

from anima_ui import modelfiles
from anima_ui.model.checkpoint import ADAPTER_PREFIX, strip_prefix
from anima_ui.runtime import board
from anima_ui.runtime.graphs import ready_graph_folders
from anima_ui.runtime.memory import GIB, read_meminfo

TORCH_OVERHEAD = 1.25  # activations, text encoding, the VAE decode and the Python process on top of the float32 DiT
# parameters of the official release's DiT without its LLM adapter, for a model folder not downloaded yet
OFFICIAL_DIT_PARAMETERS = 2_091_068_928 - 134_663_680


@dataclass(frozen=True)
class Facts:
    rknn_blocker: str | None  # why the NPU runtime cannot run here; None when rknnlite imports and librknnrt.so loads
    rknn_sizes: tuple[str, ...]  # converted graph sizes in the model folder ("512x512", ...)
    size: str | None  # the size asked for; None: any converted size will do
    torch: bool  # torch is installed
    dit_parameters: int  # of the model's DiT without its LLM adapter (what the torch backend holds in float32)
    available: int  # MemAvailable, bytes


@dataclass(frozen=True)
class Choice:
    backend: str
    reason: str

    def line(self) -> str:
        return f"--backend auto chose {self.backend}: {self.reason}"


def torch_bytes(dit_parameters: int) -> int:
    return int(dit_parameters * 4 * TORCH_OVERHEAD)


def choose(facts: Facts) -> Choice:
    graphs = facts.size in facts.rknn_sizes if facts.size else bool(facts.rknn_sizes)
    if facts.rknn_blocker is None and graphs:
        where = facts.size or ", ".join(facts.rknn_sizes)
        return Choice("rknn", f"the NPU runtime is here and converted graphs exist for {where}")
    if facts.rknn_blocker is not None:
        no_rknn = f"no NPU runtime ({facts.rknn_blocker})"
    else:
        no_rknn = f"no converted graphs for {facts.size}" if facts.size else "no converted graphs in the model folder"
    need, have = _size(torch_bytes(facts.dit_parameters)), _size(facts.available)
    if facts.torch and facts.available >= torch_bytes(facts.dit_parameters):
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
        dit_parameters=dit_parameters(models),
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


def dit_parameters(models: Path) -> int:
    """Parameters of the folder's DiT without its LLM adapter (from the safetensors header); the official
    release's when the file is not there yet."""
    dits = sorted((models / modelfiles.DIT_DIR).glob("*.safetensors"))
    if not dits:
        return OFFICIAL_DIT_PARAMETERS
    header, _ = modelfiles.read_safetensors_header(dits[-1])
    return sum(math.prod(entry["shape"]) for key, entry in header.items()
               if key != "__metadata__" and not strip_prefix(key).startswith(ADAPTER_PREFIX))


def resolve(backend: str, models_dir, width: int | None = None, height: int | None = None) -> tuple[str, str | None]:
    """(the backend to run, the line saying why) for --backend; only "auto" is decided here."""
    if backend != "auto":
        return backend, None
    choice = choose(gather(models_dir, width, height))
    return choice.backend, choice.line()
