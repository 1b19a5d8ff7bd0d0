"""Branch backends with the board's lifecycle: load (read the file) -> init (make a runnable context)
-> run (one call per graph batch) -> release. The executor times each phase; backends only do them.

- OnnxBackend: onnxruntime on the CPU.
- SimulatedBoard: onnxruntime computes the numbers, and every phase lasts at least what the RK3588
  latency table (board_latency.py) says, times `time_scale`.
- RknnLiteBackend: rknn-toolkit-lite2 2.5.0 on the board."""

import threading
import time
from pathlib import Path

import numpy as np

from anima_ui.errors import UserError
from anima_ui.runtime import board, board_latency
from anima_ui.runtime.manifest import GraphEntry
from anima_ui.runtime.native_output import captured_output


class Backend:
    name = ""
    graph_format = "onnx"  # which manifest format this backend runs

    def simulate_host(self, seconds_since_last_visit: float) -> None:
        """Called by the executor between two visits; only the simulated board adds host time."""

    def input_dtype(self, entry: GraphEntry, index: int) -> np.dtype:
        return np.dtype(entry.inputs[index].dtype)

    def load(self, folder: Path, entry: GraphEntry):
        raise NotImplementedError

    def init(self, loaded, entry: GraphEntry):
        raise NotImplementedError

    def run(self, context, entry: GraphEntry, arrays: list[np.ndarray]) -> np.ndarray:
        raise NotImplementedError

    def release(self, context, entry: GraphEntry) -> None:
        raise NotImplementedError


class OnnxBackend(Backend):
    """load = read the file into memory; init = create the InferenceSession from those bytes."""

    name = "onnx"

    def __init__(self, threads: int = 0):
        import onnxruntime  # only the onnx and sim backends need it: the rknn backend runs without

        self._ort = onnxruntime
        self.threads = threads

    def load(self, folder, entry):
        return Path(folder, entry.file).read_bytes()

    def init(self, loaded, entry):
        options = self._ort.SessionOptions()
        options.intra_op_num_threads = self.threads
        # The arena keeps freed activation buffers for reuse; with a fresh session per visit it only
        # holds memory a released context should have given back.
        options.enable_cpu_mem_arena = False
        # Spinning worker threads would take the cores the prefetch thread needs for the next session.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        return self._ort.InferenceSession(loaded, options, providers=["CPUExecutionProvider"])

    def run(self, context, entry, arrays):
        feeds = {spec.name: array for spec, array in zip(entry.inputs, arrays)}
        return context.run([entry.outputs[0].name], feeds)[0]

    def release(self, context, entry):
        """Nothing to call: the executor drops its last reference to the session right after this."""


class SimulatedBoard(OnnxBackend):
    """onnxruntime numbers at RK3588 speed: each phase is padded with a sleep up to the board's time
    for it (board_latency.py) times `time_scale`, so `time_scale=0.01` runs a 20-step job in seconds.

    keep_sessions: create each onnxruntime session once and reuse it. The board's init cost is already
    the table's; building a session on top of it is CPU work (holding the GIL) the board does not do,
    which slows the caller's thread while a prefetch runs. Use it for small graphs: it keeps all 84.

    Scaled runs keep a simulated clock per thread: when a sleep wakes late, or real work outlasts its
    phase, the excess is owed and taken off the next pads, so totals stay on the table's schedule on a
    busy machine (each phase still lasts at least its real work)."""

    name = "sim"

    def __init__(self, time_scale: float = 1.0, threads: int = 0, keep_sessions: bool = False):
        super().__init__(threads)
        self.time_scale = time_scale
        self.host_seconds_per_visit = board_latency.host_seconds_per_visit()  # board seconds
        self.keep_sessions = keep_sessions
        self._sessions = {}
        self._clock = threading.local()  # .owed: seconds this thread is behind the table's schedule

    def _pad(self, started: float, board_seconds: float) -> None:
        owed = getattr(self._clock, "owed", 0.0)
        remaining = board_seconds * self.time_scale - (time.perf_counter() - started) - owed
        if remaining > 0:
            before = time.perf_counter()
            time.sleep(remaining)
            self._clock.owed = time.perf_counter() - before - remaining
        else:
            self._clock.owed = -remaining

    def simulate_host(self, seconds_since_last_visit):
        self._pad(time.perf_counter() - seconds_since_last_visit, self.host_seconds_per_visit)

    def load(self, folder, entry):
        started = time.perf_counter()
        loaded = entry.file if entry.file in self._sessions else super().load(folder, entry)
        self._pad(started, board_latency.graph_phase_seconds(entry)["load"])
        return loaded

    def init(self, loaded, entry):
        started = time.perf_counter()
        if self.keep_sessions:
            if entry.file not in self._sessions:
                self._sessions[entry.file] = super().init(loaded, entry)
            session = self._sessions[entry.file]
        else:
            session = super().init(loaded, entry)
        self._pad(started, board_latency.graph_phase_seconds(entry)["init"])
        return session

    def run(self, context, entry, arrays):
        started = time.perf_counter()
        out = super().run(context, entry, arrays)
        self._pad(started, board_latency.graph_phase_seconds(entry)["inference"])
        return out

    def release(self, context, entry):
        started = time.perf_counter()
        super().release(context, entry)
        self._pad(started, board_latency.graph_phase_seconds(entry)["release"])


RKNN_INSTALL_HINT = (
    "the rknn backend needs rknn-toolkit-lite2 on the RK3588 board: `pip install rknn-toolkit-lite2==2.5.0` "
    "(aarch64 only) and librknnrt.so 2.5.0 in /usr/lib (or LIBRKNNRT_PATH); `anima-ui doctor` checks both"
)
CORE_MASKS = ("auto", "0", "1", "2", "0_1", "0_1_2", "all")


class RknnLiteBackend(Backend):
    """RKNNLite: load_rknn(path) -> init_runtime(core_mask=...) -> inference(inputs=[...]) -> release().
    load_rknn and init_runtime return 0 on success, inference the outputs (None on failure). Imported only when
    the backend is opened.

    A failed call raises a UserError that quotes the runtime's own `E RKNN:` lines (captured at the
    file-descriptor level: librknnrt prints them from C) and names the likely causes; a context whose init
    failed is released. Every output is checked against the manifest's output spec and reshaped to it."""

    name = "rknn"
    graph_format = "rknn"

    def __init__(self, core_mask: str = "auto", npu: board.NpuDevice | None = None, library: board.Librknnrt | None = None):
        """npu, library: this machine's facts for error messages, when the caller has them (else probed on failure)."""
        try:
            from rknnlite.api import RKNNLite  # aarch64 only: imported when the board backend is chosen
        except ImportError:
            raise UserError(RKNN_INSTALL_HINT) from None
        if core_mask not in CORE_MASKS:
            raise UserError(f"unknown NPU core mask {core_mask!r}: choose one of {', '.join(CORE_MASKS)}")
        self._RKNNLite = RKNNLite
        self.core_mask = getattr(RKNNLite, "NPU_CORE_" + core_mask.upper())
        self.sdk_version = None  # RKNNLite.get_sdk_version() after the first init: the runtime's and driver's versions
        self._facts = {"npu": npu, "library": library}

    def input_dtype(self, entry, index):
        return np.dtype(np.float32)  # the runtime converts float32 to the model's FP16 itself

    def load(self, folder, entry):
        rknn = self._RKNNLite(verbose=False)
        with captured_output() as out:
            code = rknn.load_rknn(str(Path(folder, entry.file)))
        if code != 0:
            raise UserError(board.explain_failure("load_rknn", entry.file, out.text, _toolkit(entry), **self._facts))
        return rknn

    def init(self, loaded, entry):
        with captured_output() as out:
            code = loaded.init_runtime(core_mask=self.core_mask)
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


def make_backend(name: str, time_scale: float = 1.0, core_mask: str = "auto", threads: int = 0,
                 keep_sessions: bool = False) -> Backend:
    if name == "onnx":
        return OnnxBackend(threads)
    if name == "sim":
        return SimulatedBoard(time_scale, threads, keep_sessions)
    if name == "rknn":
        return RknnLiteBackend(core_mask)
    raise UserError(f"unknown runtime backend {name!r}: choose onnx, sim or rknn")
