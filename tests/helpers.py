"""Helpers shared by the test modules (a test module never imports another): the job engine and the served app on
the tiny model, and a recorder that watches a pipeline's branch runtimes from outside."""

import shutil
import socket
import threading
import time
from pathlib import Path

import pytest

from anima_ui.jobs import FINISHED
from anima_ui.request import GenerationRequest
from anima_ui.ui.app import App, AppConfig

# The start of a `python -c` script that runs as on the board: `import torch` fails.
WITHOUT_TORCH = """
import sys

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test: the board has none")

sys.meta_path.insert(0, NoTorch())
sys.modules["torch"] = None  # importlib.util.find_spec("torch") then answers None, as when torch is not installed
"""

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")  # Debian's, driven through Playwright

# Gradio 6.31's queue analytics call pandas APIs that pandas 3 deprecates; not ours to fix.
GRADIO_PANDAS_NOISE = [pytest.mark.filterwarnings("ignore:'future.no_silent_downcasting'"),
                       pytest.mark.filterwarnings("ignore:The copy keyword is deprecated")]


def wait(manager, job, timeout=120):
    version = manager.version
    while job.state not in FINISHED:
        version = manager.wait_for_change(version, timeout=timeout)
    return job


def occupy_worker(manager, steps=6):
    """Submit a job and return once it is running, so the next job queues behind it."""
    job = manager.submit(GenerationRequest(prompt="blocker", seed=1, steps=steps, width=128, height=128))
    version = manager.version
    while job.state == "queued":
        version = manager.wait_for_change(version, timeout=60)
    return job


def wait_idle(manager, timeout=300):
    """Return once no job is queued or running (jobs left by earlier tests have finished)."""
    version = manager.version
    deadline = time.monotonic() + timeout
    while manager.line() or manager.pipeline is None:
        assert time.monotonic() < deadline, "the worker did not become idle"
        version = manager.wait_for_change(version, timeout=1.0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_app(models_dir, outputs_dir, presets_dir, **config):
    # These tests' one client calls faster than a phone: no per-device rate limit (tests/test_hostile.py checks it).
    config.setdefault("calls_per_second", None)
    port = free_port()
    app = App(AppConfig(models_dir=models_dir, outputs_dir=outputs_dir, presets_dir=presets_dir, host="127.0.0.1",
                        port=port, demo=True, preview_size=64, **config))
    _, url, _ = app.launch(prevent_thread_lock=True, quiet=True)
    return app, url


class RecordingRuntimes:
    """Wraps a Pipeline's `open_runtime` from outside and records, for every branch runtime a generation opens, when
    it was open, and how many runtimes and branch calls were in use at the same moment. Each branch call is held
    for `hold_seconds`, so two generations running at once (a second worker) cannot slip past between calls."""

    def __init__(self, hold_seconds: float = 0.02):
        self.hold_seconds = hold_seconds
        self._lock = threading.Lock()
        self.open_now = self.max_open = 0
        self.calls_now = self.max_calls = 0
        self.intervals: list[list[float]] = []  # [opened, closed] per runtime, in the order they were opened

    def wrap(self, open_runtime):
        def opening(*args, **kwargs):
            return _RecordedRuntime(open_runtime(*args, **kwargs), self)

        return opening

    def _count(self, name: str, delta: int) -> None:
        with self._lock:
            now = getattr(self, f"{name}_now") + delta
            setattr(self, f"{name}_now", now)
            peak = f"max_{name}"
            setattr(self, peak, max(getattr(self, peak), now))


class _RecordedRuntime:
    def __init__(self, runtime, recorder: RecordingRuntimes):
        self._runtime, self._recorder = runtime, recorder
        self._interval = [time.perf_counter(), None]
        recorder.intervals.append(self._interval)
        recorder._count("open", +1)

    def forward(self, weights, x, sigma, kv, rope, on_block=None):
        """The pipeline's forward, with every branch through this wrapper (so its calls are counted)."""
        from anima_ui.model.forward import dit_forward  # torch (the reference lives there), as in the pipeline

        return dit_forward(weights, self, x, sigma, kv, rope, on_block)

    def __call__(self, block, kind, inputs):
        self._recorder._count("calls", +1)
        try:
            time.sleep(self._recorder.hold_seconds)
            return self._runtime(block, kind, inputs)
        finally:
            self._recorder._count("calls", -1)

    def close(self):
        self._runtime.close()
        if self._interval[1] is None:
            self._interval[1] = time.perf_counter()
            self._recorder._count("open", -1)

    def __getattr__(self, name):  # timings, open_contexts, gate_status: the real runtime's
        return getattr(self._runtime, name)


def make_library(folder: Path, version: str) -> Path:
    """A loadable stand-in for librknnrt.so that carries its version string: a copy of libm with
    "librknnrt version: <version>" appended (the loader ignores trailing bytes)."""
    library = folder / f"librknnrt-{version}.so"
    shutil.copyfile(_libm(), library)
    with open(library, "ab") as f:
        f.write(f"\0librknnrt version: {version} (0000000000@stand-in)\0".encode())
    return library


def _libm() -> str:
    for folder in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib/aarch64-linux-gnu", "/usr/lib64", "/lib64"):
        if Path(folder, "libm.so.6").is_file():
            return str(Path(folder, "libm.so.6"))
    pytest.skip("no libm.so.6 to stand in for librknnrt.so")


def fill_until_kept(page, fields: dict) -> None:
    """Fill a page's fields {selector: value} just after the settings accordion was opened. The accordion mounts its
    fields as it opens, and a value typed in the same millisecond can be lost to that first render (seen in CI: a job
    ran with the default random seed), so fill until the values hold."""
    for _ in range(3):
        for selector, value in fields.items():
            page.fill(selector, value)
        page.wait_for_timeout(100)
        if all(page.input_value(selector) == value for selector, value in fields.items()):
            return
    raise AssertionError(f"the form did not keep {fields}")
