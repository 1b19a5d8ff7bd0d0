"""A stand-in for rknn-toolkit-lite2 2.5.0's `rknnlite.api.RKNNLite`, for tests on machines without an NPU.

The API is the wheel's own (read from rknnlite/api/rknn_lite.py in the cp311 aarch64 wheel): the same constructor,
NPU_CORE_* constants, method signatures and return conventions (0 / -1, outputs or None), init_runtime releasing a
previous runtime first, load_rknn keeping the file in `rknn_data`, get_sdk_version None before an init. Like the
real one, the runtime's lines come from C (printf through libc, so they sit in the C library's buffer until it is
flushed) and RKNNLite's own `E ...` lines go straight to the process's stderr descriptor. Two deliberate
differences: init_runtime runs on any machine (the real one refuses off aarch64), and the "NPU" is onnxruntime
(fed 4-D inputs as NHWC unless `data_format` says "nchw", as the real one takes them).

What a graph file computes: a file holding a small integer n answers inputs[0] + n (tests see which model ran on
which input); any other file must be an ONNX model, run by onnxruntime with its output rounded through float16.

Faults, injected through the environment so a subprocess sees them too:
  RKNN_STANDIN_FAULT = load | init-version | init-device | init-memory | init-silent | init-core-mask
                       | inference-submit | output-shape | output-count | output-flat | wrong-numbers
  RKNN_STANDIN_FAULT_FILE = only graph files whose name contains this fail (default: every file)
  RKNN_STANDIN_RUNTIME = the librknnrt version it reports (default 2.5.0); RKNN_STANDIN_DRIVER (default 0.9.8)
OPEN holds the runtimes initialised and not yet released; CALLS records every call."""

import ctypes
import os
import time

import numpy as np

CALLS = []
OPEN = set()
_LIBC = ctypes.CDLL(None)


def _fault(path) -> str:
    only = os.environ.get("RKNN_STANDIN_FAULT_FILE", "")
    return os.environ.get("RKNN_STANDIN_FAULT", "") if only in os.path.basename(path or "") else ""


def _runtime_line(level: str, text: str) -> None:
    """librknnrt's printf: `E RKNN: [hh:mm:ss.mmm] text`, buffered by the C library."""
    stamp = time.strftime("%H:%M:%S") + ".%03d" % (time.time() * 1000 % 1000)
    _LIBC.printf(b"%s RKNN: [%s] %s\n", level.encode(), stamp.encode(), text.encode())


def _log_error(text: str) -> None:
    """RKNNLite's own logger: `E text` on the process's stderr."""
    os.write(2, f"E {text}\n".encode())


class RKNNLite:
    NPU_CORE_AUTO = 0
    NPU_CORE_0 = 1
    NPU_CORE_1 = 2
    NPU_CORE_2 = 4
    NPU_CORE_0_1 = 3
    NPU_CORE_0_1_2 = 7
    NPU_CORE_ALL = 0xFFFF

    def __init__(self, verbose=False, verbose_file=None):
        self.verbose = verbose
        self.rknn_data = None
        self.rknn_user_key = None
        self.rknn_runtime = None
        self._path = None
        CALLS.append(("RKNNLite", verbose))

    def load_rknn(self, path, key_path=None):
        CALLS.append(("load_rknn", os.path.basename(path)))
        if _fault(path) == "load" or not os.path.exists(path):
            _log_error(f"Invalid RKNN model path: {path}")
            return -1
        with open(path, "rb") as f:
            self.rknn_data = f.read()
        self._path = path
        return 0

    def init_runtime(self, target=None, device_id=None, async_mode=False, core_mask=NPU_CORE_AUTO):
        CALLS.append(("init_runtime", target, core_mask))
        if self.rknn_data is None:
            _log_error("Model is not loaded yet, this interface should be called after load_rknn!")
            return -1
        if self.rknn_runtime is not None:
            self.release()
        fault = _fault(self._path)
        if fault == "init-device":
            _runtime_line("E", "failed to open rknpu module, need to insmod rknpu dirver!")
            _runtime_line("E", "failed to open rknn device!")
            return self._init_failed()
        _runtime_line("I", f"RKNN Runtime Information, librknnrt version: {self._runtime_version()} (0000000000@stand-in)")
        _runtime_line("I", f"RKNN Driver Information, version: {self._driver_version()}")
        if fault == "init-version":
            _runtime_line("E", "6, 1")
            _runtime_line("E", "Invalid RKNN model version 6")
            _runtime_line("E", "rknn_init, load model failed!")
            return self._init_failed()
        if fault == "init-memory":
            _runtime_line("E", "failed to allocate handle, ret: -1, errno: 14, errstr: Bad address")
            _runtime_line("E", f"failed to malloc npu memory!, size: {len(self.rknn_data)}, flags: 0x2")
            _runtime_line("E", "rknn_init, load model failed!")
            return self._init_failed()
        if fault == "init-silent":
            return -1
        if fault == "init-core-mask" or core_mask not in (0, 1, 2, 4, 3, 7, 0xFFFF):
            _log_error(f"The core mode {core_mask} is not supported currently.")
            _log_error("Catch exception when set npu core mode.")
            return -1  # like the real one: the runtime was built and stays until release()
        self.rknn_runtime = _Runtime(self.rknn_data)
        OPEN.add(id(self.rknn_runtime))
        return 0

    def _init_failed(self):
        _log_error("Catch exception when init runtime!")
        _log_error("Exception: RKNN init failed. error code: RKNN_ERR_FAIL")
        return -1

    def _runtime_version(self):
        return os.environ.get("RKNN_STANDIN_RUNTIME", "2.5.0")

    def _driver_version(self):
        return os.environ.get("RKNN_STANDIN_DRIVER", "0.9.8")

    def inference(self, inputs, data_type=None, data_format=None, inputs_pass_through=None, get_frame_id=False,
                  reuse_outputs=False):
        CALLS.append(("inference", tuple(a.shape for a in inputs), tuple(str(a.dtype) for a in inputs), self.rknn_data is None))
        if self.rknn_runtime is None:
            _log_error("Runtime environment is not inited, please call init_runtime to init it first!")
            return None
        fault = _fault(self._path)
        if fault == "inference-submit":
            _runtime_line("E", "failed to submit!, op id: 0, op name: MatMul, flags: 0x5, task start: 0, task number: 1")
            _log_error("Catch exception when running RKNN model.")
            return None
        outputs = self.rknn_runtime.run(inputs, data_format)
        if fault == "output-shape":
            outputs = [outputs[0].reshape(-1)[: outputs[0].size // 2]]
        elif fault == "output-flat":  # the same numbers without the unit axes
            outputs = [outputs[0].reshape(-1)]
        elif fault == "output-count":
            outputs = outputs + [outputs[0]]
        elif fault == "wrong-numbers":
            outputs = [np.roll(outputs[0], 1, axis=-1)]
        return outputs

    def get_sdk_version(self):
        if self.rknn_runtime is None:
            _log_error("Runtime environment is not inited, please call init_runtime to init it first!")
            return None
        return f"RKNN VERSION:\n  API: {self._runtime_version()} (0000000000@stand-in)\n  DRV: rknpu: {self._driver_version()}"

    def release(self):
        CALLS.append(("release",))
        if self.rknn_runtime is not None:
            OPEN.discard(id(self.rknn_runtime))
            self.rknn_runtime = None


class _Runtime:
    def __init__(self, data: bytes):
        text = data.strip()
        if text.isdigit():
            self.add, self.session = int(text), None
        else:
            import onnxruntime  # only files that are ONNX models need it

            self.add, self.session = None, onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])

    def run(self, inputs, data_format=None):
        if self.session is None:
            return [inputs[0] + self.add]
        # like the real runtime, a 4-D input is NHWC unless data_format says "nchw"
        formats = data_format if isinstance(data_format, (list, tuple)) else [data_format] * len(inputs)
        inputs = [a.transpose(0, 3, 1, 2) if a.ndim == 4 and f != "nchw" else a for a, f in zip(inputs, formats)]
        feeds = {i.name: np.asarray(a, dtype=np.float32) for i, a in zip(self.session.get_inputs(), inputs)}
        return [o.astype(np.float16).astype(np.float32) for o in self.session.run(None, feeds)]
