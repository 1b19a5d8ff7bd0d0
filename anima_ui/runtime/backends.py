"""Branch backends with the board's lifecycle: load (read the file) -> init (make a runnable context on some NPU
cores) -> run (one call per graph batch) -> release. The runners time each phase; backends only do them.

- OnnxBackend: onnxruntime on the CPU. Sessions of the files in `resident` are created once and kept (a PC has
  the memory the board lacks); the others are created per visit, like RKNN contexts.
- SimulatedBoard (sim.py): onnxruntime numbers at the RK3588's speed.
- RknnLiteBackend: rknn-toolkit-lite2 on the board (RKNNLite 2.5.0: load_rknn -> init_runtime(core_mask) ->
  inference -> release, each returning 0 on success)."""

from pathlib import Path

import numpy as np

from anima_ui.errors import UserError
from anima_ui.runtime import board
from anima_ui.runtime.manifest import GraphEntry
from anima_ui.runtime.native_output import captured_output

# RKNNLite 2.5.0's NPU_CORE_* constants, by the name the flags use. Only these: the runtime rejects other
# combinations ("The core mode 6 is not supported currently"). auto (0) lets the driver pick one core.
CORE_MASKS = {"auto": 0, "0": 1, "1": 2, "2": 4, "0_1": 3, "0_1_2": 7}


def check_core_mask(name: str) -> str:
    if name not in CORE_MASKS:
        raise UserError(f"unknown NPU core mask {name!r}: choose one of {', '.join(CORE_MASKS)}")
    return name


def mask_cores(name: str) -> frozenset[int]:
    """The NPU cores a context with this mask runs on (auto: one core; the simulator takes core 0)."""
    value = CORE_MASKS[check_core_mask(name)] or 1
    return frozenset(core for core in range(3) if value >> core & 1)


class Backend:
    name = ""
    graph_format = "onnx"  # which manifest format this backend runs

    def host_gap(self, seconds: float, batch: int) -> None:
        """Called by a runner before a visit with the host time since the previous visit of the same chain
        (`batch` images); only the simulated board turns it into the board's host time."""

    def input_dtype(self, entry: GraphEntry, index: int) -> np.dtype:
        return np.dtype(entry.inputs[index].dtype)

    def load(self, path: Path, entry: GraphEntry):
        raise NotImplementedError

    def init(self, loaded, entry: GraphEntry, core_mask: str):
        raise NotImplementedError

    def run(self, context, entry: GraphEntry, arrays: list[np.ndarray]) -> np.ndarray:
        raise NotImplementedError

    def release(self, context, entry: GraphEntry) -> None:
        raise NotImplementedError


# What a resident session holds per byte of its fp32 graph file once it has run, measured on the full-size graphs
# (session made from the file's path): FFN 1.2x, self-attention 2.0x, cross-attention 2.1x; 1.57x per block.
RESIDENT_BYTES_PER_FILE_BYTE = 1.6


class OnnxBackend(Backend):
    """load = read the file into memory; init = create the InferenceSession from those bytes. A resident graph's
    session is made once, from the file's path (bytes read in Python leave about as much again behind in the
    allocator, which a session kept for the whole run would pin), and reused; its load reads nothing.
    NPU core masks mean nothing here: two chains are two sessions running at once on the CPU."""

    name = "onnx"

    def __init__(self, threads: int = 0, resident: frozenset[str] = frozenset()):
        import onnxruntime  # optional on the board (the rknn backend does not need it)

        self._ort = onnxruntime
        self.threads = threads
        self.resident = frozenset(str(p) for p in resident)  # graph file paths whose sessions are kept
        self._sessions: dict[str, object] = {}

    def load(self, path, entry):
        key = str(path)
        return key, (None if key in self.resident else Path(path).read_bytes())

    def init(self, loaded, entry, core_mask):
        key, data = loaded
        if key not in self.resident:
            return self._session(data)
        if key not in self._sessions:
            self._sessions[key] = self._session(key)
        return self._sessions[key]

    def _session(self, source):
        """A session from the graph's bytes or its path."""
        options = self._ort.SessionOptions()
        options.intra_op_num_threads = self.threads
        # The arena keeps freed activation buffers for reuse; with a fresh session per visit it only
        # holds memory a released context should have given back.
        options.enable_cpu_mem_arena = False
        # Spinning worker threads would take the cores the prefetch thread needs for the next session.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        return self._ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])

    def run(self, context, entry, arrays):
        feeds = {spec.name: array for spec, array in zip(entry.inputs, arrays)}
        return context.run([entry.outputs[0].name], feeds)[0]

    def release(self, context, entry):
        """A resident session stays in self._sessions; any other is freed when the runner drops its last reference."""


def choose_resident(files: list[Path], budget_bytes: float) -> frozenset[Path]:
    """The graph files whose sessions stay resident within `budget_bytes` (RESIDENT_BYTES_PER_FILE_BYTE each). The
    visiting order is a fixed cycle, so a fixed set is what helps (an LRU would evict every entry before its reuse):
    the first files of the cycle that fit, all of them when they all fit."""
    chosen, used = [], 0
    for path in files:
        size = path.stat().st_size * RESIDENT_BYTES_PER_FILE_BYTE
        if used + size > budget_bytes:
            break
        chosen.append(path)
        used += size
    return frozenset(chosen)


RKNN_INSTALL_HINT = (
    "the rknn backend needs rknn-toolkit-lite2 on the RK3588 board: `pip install rknn-toolkit-lite2==2.5.0` "
    "(aarch64 only) and librknnrt.so 2.5.0 in /usr/lib (or LIBRKNNRT_PATH); `anima-ui doctor` checks both"
)


class RknnLiteBackend(Backend):
    """RKNNLite: load_rknn(path) -> init_runtime(core_mask=...) -> inference(inputs=[...]) -> release().
    load_rknn and init_runtime return 0 on success, inference the outputs (None on failure). Imported only when
    the backend is opened. Each context gets its own core mask (two chains run on two cores).

    A failed call raises a UserError that quotes the runtime's own `E RKNN:` lines (captured at the
    file-descriptor level: librknnrt prints them from C) and names the likely causes; a context whose init
    failed is released. Every output is checked against the manifest's output spec and reshaped to it."""

    name = "rknn"
    graph_format = "rknn"

    def __init__(self, npu: board.NpuDevice | None = None, library: board.Librknnrt | None = None):
        """npu, library: this machine's facts for error messages, when the caller has them (else probed on failure)."""
        try:
            from rknnlite.api import RKNNLite  # aarch64 only: imported when the board backend is chosen
        except ImportError:
            raise UserError(RKNN_INSTALL_HINT) from None
        for name, value in CORE_MASKS.items():
            if getattr(RKNNLite, "NPU_CORE_" + name.upper()) != value:
                raise UserError(f"this rknn-toolkit-lite2 numbers NPU_CORE_{name.upper()} differently than 2.5.0; install 2.5.0")
        self._RKNNLite = RKNNLite
        self.sdk_version = None  # RKNNLite.get_sdk_version() after the first init: the runtime's and driver's versions
        self._facts = {"npu": npu, "library": library}

    def input_dtype(self, entry, index):
        return np.dtype(np.float32)  # the runtime converts float32 to the model's FP16 itself

    def load(self, path, entry):
        rknn = self._RKNNLite(verbose=False)
        with captured_output() as out:
            code = rknn.load_rknn(str(path))
        if code != 0:
            raise UserError(board.explain_failure("load_rknn", entry.file, out.text, _toolkit(entry), **self._facts))
        return rknn

    def init(self, loaded, entry, core_mask):
        with captured_output() as out:
            code = loaded.init_runtime(core_mask=CORE_MASKS[core_mask])
        if code != 0:
            loaded.release()  # a failed init may still hold a runtime (a rejected core mask, for one)
            raise UserError(board.explain_failure("init_runtime", entry.file, out.text, _toolkit(entry), **self._facts))
        if self.sdk_version is None:
            with captured_output():
                self.sdk_version = loaded.get_sdk_version() or ""
        # load_rknn keeps the whole file as Python bytes; the context no longer needs them after init.
        loaded.rknn_data = None
        return loaded

    def run(self, context, entry, arrays):
        # 4-D inputs (the VAE decoder's) are NCHW; RKNNLite takes a 4-D input as NHWC unless told
        formats = {"data_format": ["nchw"] * len(arrays)} if any(a.ndim == 4 for a in arrays) else {}
        with captured_output() as out:
            outputs = context.inference(inputs=arrays, **formats)
        if outputs is None:
            raise UserError(board.explain_failure("inference", entry.file, out.text, _toolkit(entry), **self._facts))
        return check_outputs(outputs, entry)[0]

    def release(self, context, entry):
        with captured_output():
            context.release()


def check_outputs(outputs: list, entry: GraphEntry) -> list[np.ndarray]:
    """The runtime's outputs reshaped to the manifest's output shapes (it may add or drop unit axes); a count or
    size that does not match means the graph file is not the one the manifest describes."""
    if len(outputs) != len(entry.outputs):
        raise UserError(f"{entry.file} gave {len(outputs)} outputs, its manifest lists {len(entry.outputs)}: "
                        "the graphs folder is inconsistent; convert again with `anima-ui convert-rknn`")
    shaped = []
    for spec, output in zip(entry.outputs, outputs):
        output = np.asarray(output)
        if output.size != int(np.prod(spec.shape)):
            raise UserError(f"{entry.file} output {spec.name} has shape {output.shape}, its manifest says {spec.shape}: "
                            "the graphs folder is inconsistent; convert again with `anima-ui convert-rknn`")
        shaped.append(output.reshape(spec.shape))
    return shaped


def _toolkit(entry: GraphEntry) -> str | None:
    return entry.extra.get("toolkit")
