"""The RKNN-Lite backend against the RKNNLite API contract (rknn.md §2.1). The `rknnlite` package here is
a test double written into a temporary folder: it records calls and answers h + block so the test can
see which model ran on which input. Real RKNN numbers come from the simulator tier (test_rknn.py)."""

import sys
import textwrap

import numpy as np
import pytest

from anima_ui.runtime import open_runtime
from anima_ui.runtime.manifest import GraphEntry, Manifest, TensorSpec

FAKE_RKNNLITE = '''
import numpy as np

CALLS = []


class RKNNLite:
    NPU_CORE_AUTO, NPU_CORE_0, NPU_CORE_1, NPU_CORE_2 = 0, 1, 2, 4
    NPU_CORE_0_1, NPU_CORE_0_1_2, NPU_CORE_ALL = 3, 7, 0xFFFF

    def __init__(self, verbose=False, verbose_file=None):
        self.rknn_data = None
        self.block = None
        CALLS.append(("RKNNLite", verbose))

    def load_rknn(self, path, key_path=None):
        self.rknn_data = open(path, "rb").read()
        self.block = int(self.rknn_data.decode())
        CALLS.append(("load_rknn", path.rsplit("/", 1)[-1]))
        return 0

    def init_runtime(self, target=None, device_id=None, async_mode=False, core_mask=NPU_CORE_AUTO):
        assert self.rknn_data is not None, "init_runtime builds the graph from rknn_data"
        CALLS.append(("init_runtime", target, core_mask))
        return 0

    def inference(self, inputs, data_type=None, data_format=None, inputs_pass_through=None, get_frame_id=False):
        CALLS.append(("inference", tuple(a.shape for a in inputs), tuple(str(a.dtype) for a in inputs), self.rknn_data is None))
        return [inputs[0] + self.block]

    def release(self):
        CALLS.append(("release",))
'''

TOKENS, WIDTH, TEXT = 16, 8, 4


@pytest.fixture
def fake_rknnlite(tmp_path, monkeypatch):
    package = tmp_path / "fake" / "rknnlite"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "api.py").write_text(textwrap.dedent(FAKE_RKNNLITE))
    monkeypatch.syspath_prepend(str(tmp_path / "fake"))
    for name in ("rknnlite", "rknnlite.api"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    import rknnlite.api

    yield rknnlite.api
    for name in ("rknnlite", "rknnlite.api"):
        sys.modules.pop(name, None)


@pytest.fixture
def rknn_folder(tmp_path):
    """A converted-graphs folder for a 1-block model: its .rknn files hold their block number."""
    folder = tmp_path / "rknn"
    folder.mkdir()
    h = TensorSpec("h", (1, TOKENS, WIDTH), "float16", True)
    inputs = {"self_attn": (h, TensorSpec("rope_cos", (TOKENS, 4), "float16"), TensorSpec("rope_sin", (TOKENS, 4), "float16")),
              "cross_attn": (h, TensorSpec("k", (1, TEXT, WIDTH), "float16", True), TensorSpec("v", (1, TEXT, WIDTH), "float16", True)),
              "mlp": (h,)}
    graphs = []
    for block in range(2):
        for kind, specs in inputs.items():
            file = f"block{block:02d}_{kind}.rknn"
            (folder / file).write_text(str(block + 1))
            graphs.append(GraphEntry(file, block, kind, specs, (TensorSpec("out", h.shape, "float16", True),), "0" * 64))
    Manifest("rknn", 64, 64, 1, "fp16", graphs, {}, {"rknn-toolkit2": "2.5.0"}).write(folder)
    return folder


def branch_inputs(kind, batch=2):
    rng = np.random.default_rng(0)
    extra = {"self_attn": {"rope_cos": np.ones((TOKENS, 4)), "rope_sin": np.zeros((TOKENS, 4))},
             "cross_attn": {"k": rng.standard_normal((batch, TEXT, WIDTH)), "v": rng.standard_normal((batch, TEXT, WIDTH))},
             "mlp": {}}[kind]
    return {"h": rng.standard_normal((batch, TOKENS, WIDTH)), **extra}


def test_serial_call_sequence_per_model(fake_rknnlite, rknn_folder):
    runtime = open_runtime("rknn", rknn_folder, prefetch=False, core_mask="0_1_2")
    inputs = branch_inputs("cross_attn")
    out = runtime(0, "cross_attn", inputs)
    runtime.close()
    np.testing.assert_allclose(out, inputs["h"] + 1, atol=1e-5)  # block 0's model ran on cond, then uncond
    shapes = ((1, TOKENS, WIDTH), (1, TEXT, WIDTH), (1, TEXT, WIDTH))
    assert fake_rknnlite.CALLS == [
        ("RKNNLite", False),
        ("load_rknn", "block00_cross_attn.rknn"),
        ("init_runtime", None, 7),  # NPU_CORE_0_1_2; target None = the board's own NPU
        # float32 in (the runtime converts to FP16), one call per CFG half, the file copy freed after init
        ("inference", shapes, ("float32",) * 3, True),
        ("inference", shapes, ("float32",) * 3, True),
        ("release",),
    ]
    assert runtime.open_contexts == 0


def test_prefetch_opens_each_model_once_in_cycle_order(fake_rknnlite, rknn_folder):
    with open_runtime("rknn", rknn_folder, prefetch=True, max_contexts=2) as runtime:
        for block in range(2):
            for kind in ("self_attn", "cross_attn", "mlp"):
                inputs = branch_inputs(kind)
                np.testing.assert_allclose(runtime(block, kind, inputs), inputs["h"] + block + 1, atol=1e-5)
    calls = fake_rknnlite.CALLS
    loads = [c[1] for c in calls if c[0] == "load_rknn"]
    # the cycle's first six models in order; the prefetcher may already have read block 0's next-step file
    assert loads[:6] == [f"block{b:02d}_{k}.rknn" for b in range(2) for k in ("self_attn", "cross_attn", "mlp")]
    inits = sum(c[0] == "init_runtime" for c in calls)
    assert sum(c[0] == "inference" for c in calls) == 12
    assert sum(c[0] == "release" for c in calls) == inits  # close() released every context it had opened
    assert runtime.open_contexts == 0
