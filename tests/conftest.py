"""Shared fixtures: the tiny random-weight Anima model, as a state dict and as a model folder in the official layout."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from anima_ui.fixtures.model import write_random_model
from anima_ui.fixtures.weights import random_dit_state
from anima_ui.model.config import AnimaConfig
from helpers import CHROMIUM


@pytest.fixture(scope="session")
def tiny_cfg() -> AnimaConfig:
    return AnimaConfig.tiny()


@pytest.fixture(scope="session")
def tiny_state(tiny_cfg) -> dict[str, np.ndarray]:
    """Read-only by convention: shared by every test in the session."""
    return random_dit_state(tiny_cfg, seed=0)


def save_dit_file(state: dict[str, np.ndarray], path, prefix: str = "net.", dtype=torch.bfloat16) -> None:
    """Write a state dict the way the release files are written (torch safetensors, bf16, `net.` keys)."""
    save_file({prefix + k: torch.from_numpy(v).to(dtype) for k, v in state.items()}, str(path))


@pytest.fixture(scope="session")
def write_dit_file():
    """save_dit_file(state, path, prefix="net.", dtype=torch.bfloat16)."""
    return save_dit_file


RKNNLITE_STANDIN = Path(__file__).parent / "rknnlite_standin"
STANDIN_VARIABLES = ("RKNN_STANDIN_FAULT", "RKNN_STANDIN_FAULT_FILE", "RKNN_STANDIN_RUNTIME", "RKNN_STANDIN_DRIVER")


@pytest.fixture
def rknnlite_standin(monkeypatch):
    """tests/rknnlite_standin importable as `rknnlite` (with rknn-toolkit-lite2 2.5.0's metadata): the RKNNLite
    2.5.0 API over onnxruntime, faults injected with RKNN_STANDIN_* variables. Yields its rknn_lite module."""
    monkeypatch.syspath_prepend(str(RKNNLITE_STANDIN))
    for name in STANDIN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    _forget_rknnlite()
    import rknnlite.api.rknn_lite as standin

    standin.CALLS.clear()
    standin.OPEN.clear()
    yield standin
    _forget_rknnlite()


def _forget_rknnlite():
    for name in [m for m in sys.modules if m == "rknnlite" or m.startswith("rknnlite.")]:
        del sys.modules[name]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The tiny model folder (seed 0), shared by the session: read-only by convention. A test that writes into a model
    folder (exports, broken files) copies it first (shutil.copytree)."""
    return write_random_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", 0)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models run in milliseconds on one thread; with two OpenMP threads on a shared, oversubscribed machine
    each barrier can stall for seconds. Restores the setting for the next module."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# `anima-ui` with every `import torch` failing, the way a board without torch behaves.
_NO_TORCH = """
import sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test")
sys.meta_path.insert(0, NoTorch())
from anima_ui.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="session")
def anima_ui_without_torch() -> list[str]:
    """The command prefix that runs `anima-ui` in a process where torch cannot be imported."""
    return [sys.executable, "-c", _NO_TORCH]


@pytest.fixture(scope="module")
def browser():
    """Debian's chromium through Playwright, for the browser and hostile-input tests."""
    playwright_api = pytest.importorskip("playwright.sync_api")  # optional: the browser tests' own dependency
    if CHROMIUM is None:
        pytest.fail("chromium is not installed: apt-get install chromium (scripts/setup.sh does)")
    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True)
        yield browser
        browser.close()
