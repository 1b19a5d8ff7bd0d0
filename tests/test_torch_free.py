"""The board has no torch: `anima-ui generate` with a graph backend runs in a process where `import torch`
fails, and gives the torch backend's latent.

The graphs are exported first, in this (torch-allowed) process, as a PC does before copying them to a board."""

import json
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from anima_ui.cli import main
from anima_ui.fixtures.model import write_random_model

# Runs `anima-ui ARGS...` as if torch were not installed: `import torch` (and any torch.*) raises
# ModuleNotFoundError, and importlib.util.find_spec("torch") answers None, which is how transformers
# decides whether torch exists.
NO_TORCH = """
import importlib.abc
import sys

class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
        return None

sys.meta_path.insert(0, NoTorch())
sys.modules["torch"] = None
from anima_ui.cli import main
sys.exit(main(sys.argv[1:]))
"""

PROMPT = ["--prompt", "a lighthouse at dusk", "--negative", "blurry", "--seed", "7", "--steps", "3", "--width", "64", "--height", "64"]


def anima_ui_without_torch(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", NO_TORCH, *argv], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    models = write_random_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", 0)
    assert main(["export", "--models", str(models), "--width", "64", "--height", "64"]) == 0
    return models


@pytest.fixture(scope="module")
def torch_latent(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("torch")
    argv = ["generate", "--models", str(tiny), *PROMPT, "--backend", "torch", "--out", str(out / "torch.png"), "--save-latent", str(out / "z.npy")]
    assert main(argv) == 0
    return np.load(out / "z.npy")


def test_the_blocker_blocks_torch():
    done = subprocess.run([sys.executable, "-c", NO_TORCH.replace("from anima_ui.cli import main\nsys.exit(main(sys.argv[1:]))", "import torch")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "ModuleNotFoundError" in done.stderr


@pytest.mark.parametrize("backend", ["onnx", "sim"])
def test_generate_imports_no_torch_and_matches_the_torch_backend(tiny, torch_latent, backend, tmp_path):
    done = anima_ui_without_torch("generate", "--models", str(tiny), *PROMPT, "--backend", backend, "--time-scale", "0.001",
                                  "--out", str(tmp_path / "out.png"), "--save-latent", str(tmp_path / "z.npy"))
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    # sd.cpp supports only the release VAE width, not the tiny model's: its torch-free fallback decodes
    assert summary["backend"] == backend and summary["decoder"] == "onnx"
    latent = np.load(tmp_path / "z.npy")
    error = np.linalg.norm(latent - torch_latent) / np.linalg.norm(torch_latent)
    print(f"\n{backend} without torch vs the torch backend: relative L2 {error:.1e}")
    assert error < 1e-4
    image = Image.open(tmp_path / "out.png")
    assert image.size == (64, 64) and np.asarray(image).std() > 0
