"""`--backend auto`: the rule as a table, the facts this machine gives it, and `generate` saying what it chose."""

import json
import shutil
import subprocess
import sys

import pytest

from anima_ui.model.checkpoint import ADAPTER_PREFIX, load_dit
from anima_ui.runtime import auto
from anima_ui.runtime.manifest import MANIFEST
from helpers import make_library

GIB = 1 << 30
FULL = auto.OFFICIAL_DIT_PARAMETERS
TINY = 3_000_000


def facts(**changes):
    base = dict(rknn_blocker=None, rknn_sizes=("512x512",), size="512x512", torch=True, dit_parameters=FULL, available=20 * GIB)
    return auto.Facts(**{**base, **changes})


@pytest.mark.parametrize("changes, backend, because", [
    ({}, "rknn", "the NPU runtime is here and converted graphs exist for 512x512"),
    (dict(size=None, rknn_sizes=("512x512", "768x768")), "rknn", "converted graphs exist for 512x512, 768x768"),  # serve
    (dict(size="1024x1024"), "torch", "no converted graphs for 1024x1024; torch fits (needs about 9.1 GiB"),
    (dict(rknn_blocker="rknn-toolkit-lite2 is not installed"), "torch", "no NPU runtime (rknn-toolkit-lite2 is not installed); torch fits"),
    (dict(rknn_blocker="no librknnrt.so at /usr/lib/librknnrt.so", available=7 * GIB), "onnx",
     "no NPU runtime (no librknnrt.so at /usr/lib/librknnrt.so); torch would need about 9.1 GiB, 7.0 GiB available"),
    (dict(rknn_blocker="x", torch=False), "onnx", "torch is not installed"),
    (dict(rknn_blocker="x", dit_parameters=TINY, available=1 * GIB), "torch", "torch fits (needs about 14 MiB for this model, 1.0 GiB"),  # tiny fits anywhere
    (dict(rknn_sizes=(), size=None, available=7 * GIB), "onnx", "no converted graphs in the model folder; torch would need"),
])
def test_the_rule(changes, backend, because):
    choice = auto.choose(facts(**changes))
    assert choice.backend == backend and because in choice.reason
    assert choice.line().startswith(f"--backend auto chose {backend}: ")


def test_torch_needs_9_gib_for_the_official_release():
    """The float32 DiT without its adapter and a quarter more; the text encoder is not resident (streamed per prompt)."""
    assert auto.torch_bytes(auto.OFFICIAL_DIT_PARAMETERS) / GIB == pytest.approx(9.1, abs=0.05)


@pytest.fixture(scope="module")
def tiny(tiny_model, tmp_path_factory):
    return shutil.copytree(tiny_model, tmp_path_factory.mktemp("auto") / "tiny")  # generate may export into it


def test_facts_of_this_machine(tiny, tmp_path):
    found = auto.gather(tiny, 64, 64)
    _, dit = load_dit(next((tiny / "diffusion_models").glob("*.safetensors")))
    assert found.dit_parameters == sum(v.size for k, v in dit.items() if not k.startswith(ADAPTER_PREFIX))
    assert found.size == "64x64" and found.rknn_sizes == ()
    assert auto.gather(tmp_path / "not-downloaded").dit_parameters == auto.OFFICIAL_DIT_PARAMETERS


def test_rknn_is_chosen_with_the_runtime_and_converted_graphs(rknnlite_standin, tiny, tmp_path):
    models = tmp_path / "models"
    shutil.copytree(tiny, models)
    (models / "rknn" / "64x64").mkdir(parents=True)
    (models / "rknn" / "64x64" / MANIFEST).write_text("{}")
    environ = {"LIBRKNNRT_PATH": str(make_library(tmp_path, "2.5.0"))}
    assert auto.choose(auto.gather(models, 64, 64, environ)).backend == "rknn"
    assert auto.gather(models, 64, 64, {"LIBRKNNRT_PATH": str(tmp_path / "none.so")}).rknn_blocker.startswith("no librknnrt.so at")
    assert auto.choose(auto.gather(models, 128, 128, environ)).reason.startswith("no converted graphs for 128x128")


def test_generate_says_what_auto_chose(tiny, tmp_path):
    out = tmp_path / "out.png"
    result = subprocess.run([sys.executable, "-m", "anima_ui", "generate", "--models", str(tiny), "--prompt", "a lighthouse",
                             "--steps", "1", "--width", "64", "--height", "64", "--out", str(out)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    expected = auto.choose(auto.gather(tiny, 64, 64))  # MemAvailable moves between the two: compare up to it
    said = [line for line in result.stderr.splitlines() if line.startswith("--backend auto chose")]
    assert len(said) == 1 and said[0].split(" available")[0].rsplit(", ", 1)[0] == expected.line().split(" available")[0].rsplit(", ", 1)[0]
    assert json.loads(result.stdout.strip().splitlines()[-1])["backend"] == expected.backend
