"""The split branch runtime on the tiny random-weight model: numbers equal the torch reference, the
prefetching executor keeps at most K contexts, cancel and the memory gate stop it cleanly."""

import sys
import tempfile
import threading

import numpy as np
import pytest

from anima_ui.convert.export import export_graphs
from anima_ui.errors import Cancelled, UserError
from anima_ui.model.checkpoint import load_dit
from anima_ui.model.forward import dit_forward, prepare_kv, prepare_rope
from anima_ui.model.reference import reference_forward
from anima_ui.runtime import open_runtime
from anima_ui.runtime.backends import SimulatedBoard
from anima_ui.runtime.memory import MemoryGate, process_memory, read_meminfo, swap_used

WIDTH = HEIGHT = 64  # 8x8 latent, 16 image tokens


class CountingBoard(SimulatedBoard):
    """The simulated board, counting the contexts it initialised and has not released: a check on the executor's own
    count from the backend's side."""

    def __init__(self, **options):
        super().__init__(**options)
        self._lock = threading.Lock()
        self.open_count = 0

    def init(self, loaded, entry):
        context = super().init(loaded, entry)
        with self._lock:
            self.open_count += 1
        return context

    def release(self, context, entry):
        super().release(context, entry)
        with self._lock:
            self.open_count -= 1


@pytest.fixture(scope="module")
def model(tmp_path_factory, tiny_state, write_dit_file):
    """A tiny DiT file in the release layout, loaded back by the real loader, and its exported graphs."""
    root = tmp_path_factory.mktemp("tiny")
    (root / "diffusion_models").mkdir()
    checkpoint = root / "diffusion_models" / "anima-tiny.safetensors"
    write_dit_file(tiny_state, checkpoint)
    cfg, weights = load_dit(checkpoint)
    graphs = {batch: export_graphs(checkpoint, WIDTH, HEIGHT, root / f"exported-b{batch}", batch=batch)
              for batch in (1, 2)}
    return {"root": root, "cfg": cfg, "weights": weights, "graphs": {b: root / f"exported-b{b}" for b in graphs}}


def cfg_inputs(model, batch=2, seed=0):
    rng = np.random.default_rng(seed)
    cfg = model["cfg"]
    x = rng.standard_normal((batch, 16, HEIGHT // 8, WIDTH // 8)).astype(np.float32)
    sigma = np.full(batch, 0.6, np.float32)
    context = rng.standard_normal((batch, cfg.context_len, cfg.context_dim)).astype(np.float32)
    return x, sigma, context


def relative_error(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("graph_batch", [1, 2])
def test_split_onnx_equals_reference(model, prefetch, graph_batch):
    x, sigma, context = cfg_inputs(model)
    weights = model["weights"]
    reference = reference_forward(weights, x, sigma, context)
    kv, rope = prepare_kv(weights, context), prepare_rope(model["cfg"], HEIGHT // 8, WIDTH // 8)
    with open_runtime("onnx", model["graphs"][graph_batch], prefetch=prefetch) as runtime:
        first = dit_forward(weights, runtime, x, sigma, kv, rope)
        second = dit_forward(weights, runtime, x, sigma, kv, rope)  # the cycle wraps into the next step
        timings = runtime.timings
    assert relative_error(first, reference) < 1e-4
    assert relative_error(second, reference) < 1e-4
    visits = 2 * 3 * model["cfg"].num_blocks
    assert timings["visits"] == visits
    # batch-1 graphs run cond and uncond as two calls on one context, a batch-2 graph as one call
    assert timings["calls"] == visits * (2 // graph_batch)


def test_batch2_graph_serves_a_single_image(model):
    x, sigma, context = cfg_inputs(model, batch=1)
    weights = model["weights"]
    kv, rope = prepare_kv(weights, context), prepare_rope(model["cfg"], HEIGHT // 8, WIDTH // 8)
    with open_runtime("onnx", model["graphs"][2]) as runtime:
        out = dit_forward(weights, runtime, x, sigma, kv, rope)
    assert out.shape == x.shape
    assert relative_error(out, reference_forward(weights, x, sigma, context)) < 1e-4


def test_prefetch_never_holds_more_than_k_contexts(model):
    x, sigma, context = cfg_inputs(model)
    weights = model["weights"]
    kv, rope = prepare_kv(weights, context), prepare_rope(model["cfg"], HEIGHT // 8, WIDTH // 8)
    backend = CountingBoard(time_scale=0.002)
    runtime = open_runtime(backend, model["graphs"][1], prefetch=True, max_contexts=2)
    seen = []

    def watched(block, kind, inputs):
        seen.append(runtime.open_contexts)
        return runtime(block, kind, inputs)

    dit_forward(weights, watched, x, sigma, kv, rope)
    dit_forward(weights, watched, x, sigma, kv, rope)
    assert runtime.peak_open_contexts == 2  # it did prefetch ...
    assert max(seen) <= 2  # ... and never beyond K
    runtime.close()
    assert runtime.open_contexts == 0 and backend.open_count == 0
    timings = runtime.timings
    assert timings["lifecycle"] == pytest.approx(timings["load"] + timings["init"] + timings["release"])


def test_prefetch_recovers_from_an_abandoned_forward(model):
    """A forward stopped half-way (an error upstream) leaves prefetched contexts of the old position;
    the next forward starts at block 0 again and must still get the right graphs."""
    x, sigma, context = cfg_inputs(model)
    weights = model["weights"]
    kv, rope = prepare_kv(weights, context), prepare_rope(model["cfg"], HEIGHT // 8, WIDTH // 8)
    with open_runtime("onnx", model["graphs"][1], prefetch=True) as runtime:
        runtime(0, "self_attn", {"h": np.zeros((2, 16, model["cfg"].width), np.float32), "rope_cos": rope[0], "rope_sin": rope[1]})
        out = dit_forward(weights, runtime, x, sigma, kv, rope)
    assert relative_error(out, reference_forward(weights, x, sigma, context)) < 1e-4


@pytest.mark.parametrize("prefetch", [False, True])
def test_cancel_mid_step_closes_every_context(model, prefetch, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    graphs = model["graphs"][1]
    files_before = sorted(p.name for p in graphs.iterdir())
    x, sigma, context = cfg_inputs(model)
    weights = model["weights"]
    kv, rope = prepare_kv(weights, context), prepare_rope(model["cfg"], HEIGHT // 8, WIDTH // 8)
    cancel = threading.Event()
    backend = CountingBoard(time_scale=0.002)
    runtime = open_runtime(backend, graphs, prefetch=prefetch, cancel=cancel)
    visits = []

    def cancelling(block, kind, inputs):
        visits.append((block, kind))
        if len(visits) == 4:  # block 1 self-attention: the middle of the step
            cancel.set()
        return runtime(block, kind, inputs)

    with pytest.raises(Cancelled):
        dit_forward(weights, cancelling, x, sigma, kv, rope)
    assert len(visits) == 4
    assert runtime.open_contexts == 0
    assert backend.open_count == 0
    assert sorted(p.name for p in graphs.iterdir()) == files_before
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("prefetch", [False, True])
def test_memory_gate_refuses_when_floor_is_above_available(model, prefetch):
    runtime = open_runtime("onnx", model["graphs"][1], prefetch=prefetch, mem_floor_gib=1e6, gate_wait_seconds=0.2)
    assert not runtime.gate_status.ok
    rope = prepare_rope(model["cfg"], HEIGHT // 8, WIDTH // 8)
    with pytest.raises(UserError, match="memory gate: MemAvailable .* under the 1e\\+06 GiB floor"):
        runtime(0, "self_attn", {"h": np.zeros((1, 16, model["cfg"].width), np.float32), "rope_cos": rope[0], "rope_sin": rope[1]})
    runtime.close()
    assert runtime.open_contexts == 0


def write_meminfo(path, available_kib, swap_free_kib, swap_total_kib=4 << 20):
    path.write_text(f"MemTotal: 8000000 kB\nMemAvailable: {available_kib} kB\nSwapTotal: {swap_total_kib} kB\nSwapFree: {swap_free_kib} kB\n")


def test_memory_gate_refuses_when_swap_grows(tmp_path):
    meminfo = tmp_path / "meminfo"
    write_meminfo(meminfo, available_kib=4 << 20, swap_free_kib=4 << 20)
    gate = MemoryGate(floor_gib=1.5, wait_seconds=0.1, meminfo_path=str(meminfo))
    assert gate.check().ok
    write_meminfo(meminfo, available_kib=4 << 20, swap_free_kib=(4 << 20) - 15 * 1024)  # 15 MiB: still fine
    assert gate.check().ok
    write_meminfo(meminfo, available_kib=4 << 20, swap_free_kib=(4 << 20) - 17 * 1024)
    assert not gate.check().ok
    with pytest.raises(UserError, match="swap grew 17.0 MiB"):
        gate.wait_until_open()


def test_memory_readings_of_the_machine_and_this_process(tmp_path):
    meminfo = tmp_path / "meminfo"
    write_meminfo(meminfo, available_kib=3 << 20, swap_free_kib=(4 << 20) - 1024)
    info = read_meminfo(str(meminfo))
    assert info["MemAvailable"] == 3 << 30 and swap_used(info) == 1 << 20
    own = process_memory()
    assert 0 < own["pss"] <= own["rss"] <= own["peak_rss"] + (64 << 20)  # the two files are read a moment apart


def test_wrong_resolution_names_the_problem(model):
    rope = prepare_rope(model["cfg"], 4, 4)
    with open_runtime("onnx", model["graphs"][1], prefetch=False) as runtime:
        with pytest.raises(UserError, match="are for 64x64; export graphs for this size"):
            runtime(0, "self_attn", {"h": np.zeros((1, 4, model["cfg"].width), np.float32), "rope_cos": rope[0], "rope_sin": rope[1]})


def test_rknn_backend_without_the_package_says_how_to_install(model, monkeypatch):
    monkeypatch.setitem(sys.modules, "rknnlite", None)
    with pytest.raises(UserError, match="pip install rknn-toolkit-lite2"):
        open_runtime("rknn", model["graphs"][1])


def test_onnx_backend_refuses_an_rknn_folder(model, tmp_path):
    from anima_ui.runtime.manifest import Manifest

    manifest = Manifest.read(model["graphs"][1])
    manifest.format = "rknn"
    for g in manifest.graphs:
        (tmp_path / g.file).write_bytes(b"")
    manifest.write(tmp_path)
    with pytest.raises(UserError, match="holds rknn graphs but the onnx backend"):
        open_runtime("onnx", tmp_path)


def test_split_run_needs_only_the_host_weights(model):
    """The graphs carry the branch weights, so the host loads the rest: same numbers, ~1/7 of the bytes at full size."""
    from anima_ui.runtime.host_weights import load_host_weights

    checkpoint = model["root"] / "diffusion_models" / "anima-tiny.safetensors"
    cfg, host = load_host_weights(checkpoint)
    full = model["weights"]
    assert set(host) < set(full)
    dit_blocks = [k for k in host if k.startswith("blocks.")]
    assert dit_blocks and not any(".mlp." in k or ".self_attn." in k or ".cross_attn.q_proj" in k for k in dit_blocks)
    assert all(np.array_equal(host[k], full[k]) for k in host)
    assert not any(k.startswith("llm_adapter.") for k in host)
    x, sigma, context = cfg_inputs(model)
    kv, rope = prepare_kv(host, context), prepare_rope(cfg, HEIGHT // 8, WIDTH // 8)
    with open_runtime("onnx", model["graphs"][1]) as runtime:
        out = dit_forward(host, runtime, x, sigma, kv, rope)
    assert relative_error(out, reference_forward(full, x, sigma, context)) < 1e-4


def test_fp16_graphs_take_and_give_float32_at_the_boundary(model, tmp_path):
    checkpoint = model["root"] / "diffusion_models" / "anima-tiny.safetensors"
    export_graphs(checkpoint, WIDTH, HEIGHT, tmp_path / "fp16", dtype="fp16")
    x, sigma, context = cfg_inputs(model)
    weights = model["weights"]
    kv, rope = prepare_kv(weights, context), prepare_rope(model["cfg"], HEIGHT // 8, WIDTH // 8)
    with open_runtime("onnx", tmp_path / "fp16") as runtime:
        assert runtime.manifest.graphs[0].inputs[0].dtype == "float16"
        out = dit_forward(weights, runtime, x, sigma, kv, rope)
    reference = reference_forward(weights, x, sigma, context)
    assert out.dtype == np.float32
    cosine = float(np.dot(out.ravel(), reference.ravel()) / (np.linalg.norm(out) * np.linalg.norm(reference)))
    assert cosine > 0.9999
    assert relative_error(out, reference) > 1e-5  # it really ran in half precision
