"""The split branch runtime on the tiny random-weight model: numbers equal the torch reference, the
prefetching runner keeps at most K contexts, cancel and the memory gate stop it cleanly. Contexts are counted
from outside, by a backend that wraps the real one (recording_backend.py)."""

import sys
import tempfile
import threading
import time
from collections import Counter

import numpy as np
import pytest

from anima_ui.convert.export import export_graphs
from anima_ui.errors import Cancelled, UserError
from anima_ui.model.checkpoint import load_dit
from anima_ui.model.forward import dit_forward, prepare_kv, prepare_rope
from anima_ui.model.reference import reference_forward
from anima_ui.runtime import Plan, open_runtime
from anima_ui.runtime.manifest import Manifest
from anima_ui.runtime.memory import MemoryGate, process_memory, read_meminfo, swap_used
from anima_ui.runtime.sim import SimulatedBoard
from recording_backend import RecordingBackend

WIDTH = HEIGHT = 64  # 8x8 latent, 16 image tokens


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


@pytest.mark.parametrize("variant, graph_batch", [("serial", 1), ("prefetch", 1), ("batch2", 2)])
def test_split_onnx_equals_reference(model, variant, graph_batch):
    x, sigma, context = cfg_inputs(model)
    weights = model["weights"]
    reference = reference_forward(weights, x, sigma, context)
    kv, rope = prepare_kv(weights, context), prepare_rope(model["cfg"], HEIGHT // 8, WIDTH // 8)
    with open_runtime("onnx", model["graphs"][graph_batch], Plan.uniform(variant)) as runtime:
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
    with open_runtime("onnx", model["graphs"][2], Plan.uniform("batch2")) as runtime:
        out = runtime.forward(weights, x, sigma, kv, rope)
    assert out.shape == x.shape
    assert relative_error(out, reference_forward(weights, x, sigma, context)) < 1e-4


@pytest.mark.parametrize("contexts", [2, 3])
def test_prefetch_never_holds_more_than_k_contexts(model, contexts):
    x, sigma, context = cfg_inputs(model)
    weights = model["weights"]
    kv, rope = prepare_kv(weights, context), prepare_rope(model["cfg"], HEIGHT // 8, WIDTH // 8)
    backend = RecordingBackend(SimulatedBoard(time_scale=0.002))
    runtime = open_runtime(backend, model["graphs"][1], prefetch=True, max_contexts=contexts)
    seen = []

    def watched(block, kind, inputs):
        seen.append(backend.total_open())
        return runtime(block, kind, inputs)

    dit_forward(weights, watched, x, sigma, kv, rope)
    dit_forward(weights, watched, x, sigma, kv, rope)
    assert 2 <= backend.peak["auto"] <= contexts  # it did prefetch ...
    assert max(seen) <= contexts  # ... and never beyond K
    runtime.close()
    assert runtime.open_contexts == 0 and backend.total_open() == 0
    timings = runtime.timings
    assert timings["lifecycle"] == pytest.approx(timings["load"] + timings["init"] + timings["release"])
    per_kind = timings["per_kind"]
    assert all(per_kind[kind]["visits"] == 2 * model["cfg"].num_blocks for kind in per_kind)
    assert sum(per_kind[kind]["inference"] for kind in per_kind) == pytest.approx(timings["inference"])


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


@pytest.mark.parametrize("variant", ["serial", "prefetch", "two-chains", "mixed"])
def test_cancel_mid_step_closes_every_context(model, variant, tmp_path, monkeypatch):
    """Cancel in the middle of a forward: every chain stops within the branch it is in, 0 contexts stay open on
    either chain (counted per core mask, i.e. per chain), no file is left behind."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    graphs = model["graphs"][1]
    files_before = sorted(p.name for p in graphs.iterdir())
    x, sigma, context = cfg_inputs(model)
    weights = model["weights"]
    kv, rope = prepare_kv(weights, context), prepare_rope(model["cfg"], HEIGHT // 8, WIDTH // 8)
    cancel = threading.Event()
    calls, cancelled_at = [0], []

    def cancel_at_fifth_call(entry, core_mask, out):  # the middle of the forward (12 calls on either plan)
        calls[0] += 1
        if calls[0] == 5:
            cancelled_at.append(time.perf_counter())
            cancel.set()
        return out

    backend = RecordingBackend(SimulatedBoard(time_scale=0.002), alter=cancel_at_fifth_call)
    plan = Plan({"self_attn": "two-chains", "cross_attn": "prefetch", "mlp": "two-chains"}) if variant == "mixed" else Plan.uniform(variant)
    runtime = open_runtime(backend, graphs, plan, cancel=cancel)
    with pytest.raises(Cancelled):
        runtime.forward(weights, x, sigma, kv, rope)
    late = Counter(mask for phase, mask, start, _ in backend.intervals if phase == "run" and start > cancelled_at[0])
    # after the cancel, each chain runs at most the rest of the branch it is in (the uncond call of a batch-1 visit,
    # or the branch a chain was waiting for)
    assert all(n <= 1 for n in late.values()), late
    assert runtime.open_contexts == 0
    assert backend.total_open() == 0
    masks = {"two-chains": {"0", "1"}, "mixed": {"0", "1", "auto"}}.get(variant, {"auto"})
    assert {mask for mask, n in backend.inits.items() if n} == masks  # every chain opened contexts ...
    assert all(backend.open[mask] == 0 for mask in masks)  # ... and holds none now
    assert sorted(p.name for p in graphs.iterdir()) == files_before
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(UserError, match="closed"):
        runtime.forward(weights, x, sigma, kv, rope)


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


def fake_proc(tmp_path, pswpin=0, swap_free_kib=4 << 20):
    write_meminfo(tmp_path / "meminfo", available_kib=4 << 20, swap_free_kib=swap_free_kib)
    (tmp_path / "vmstat").write_text(f"nr_free_pages 1000\npswpin {pswpin}\npswpout 0\n")
    return {"meminfo_path": str(tmp_path / "meminfo"), "vmstat_path": str(tmp_path / "vmstat")}


def test_swap_that_grew_once_is_a_warning_not_a_refusal(tmp_path):
    gate = MemoryGate(floor_gib=1.5, wait_seconds=0.1, **fake_proc(tmp_path))
    assert gate.check().ok and gate.status.warning is None
    fake_proc(tmp_path, swap_free_kib=(4 << 20) - 500 * 1024)  # 500 MiB swapped out, nothing swapped back in
    status = gate.check()
    assert status.ok and status.swap_growth_mib == 500
    assert "swap grew 500 MiB" in status.warning
    gate.wait_until_open()


def test_gate_waits_out_a_burst_of_swap_in(tmp_path):
    paths = fake_proc(tmp_path)
    gate = MemoryGate(floor_gib=1.5, wait_seconds=5, **paths)
    fake_proc(tmp_path, pswpin=10_000)  # swapped in since the last check: the gate looks again while it waits
    assert not gate.check().ok and "swapped in" in gate.status.message
    gate.wait_until_open(poll_seconds=0.01)  # nothing more swapped in during the wait: it opens
    assert gate.status.ok


class SwappingVmstat:
    """/proc/vmstat of a machine that keeps swapping in: every read shows 1000 more pages."""

    def __init__(self, path):
        self.path, self.pages = path, 0

    def __call__(self, path):
        self.pages += 1000
        return {"pswpin": self.pages}


def test_gate_refuses_while_pages_keep_being_swapped_in_unless_told_to_ignore(tmp_path, monkeypatch):
    from anima_ui.runtime import memory

    paths = fake_proc(tmp_path)
    monkeypatch.setattr(memory, "read_vmstat", SwappingVmstat(paths["vmstat_path"]))
    gate = MemoryGate(floor_gib=1.5, wait_seconds=0.05, **paths)
    with pytest.raises(UserError, match="swapped in .* --swap-policy ignore"):
        gate.wait_until_open(poll_seconds=0.01)
    ignoring = MemoryGate(floor_gib=1.5, swap_policy="ignore", wait_seconds=0.05, **paths)
    ignoring.wait_until_open(poll_seconds=0.01)
    with pytest.raises(UserError, match="--swap-policy 'often'"):
        MemoryGate(swap_policy="often", **paths)


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


def test_onnx_sessions_stay_resident_when_memory_allows(model, monkeypatch):
    """A PC has the memory the board lacks: each session is created once for the whole run, not once per visit; with
    less memory, a fixed set (the first graphs of the cycle that fit beside the floor) stays and the rest cycle."""
    import onnxruntime

    from anima_ui.runtime import executor
    from anima_ui.runtime.backends import RESIDENT_BYTES_PER_FILE_BYTE
    from anima_ui.runtime.memory import GIB

    created = []

    class CountingSession(onnxruntime.InferenceSession):
        def __init__(self, *args, **kwargs):
            created.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(onnxruntime, "InferenceSession", CountingSession)
    x, sigma, context = cfg_inputs(model)
    weights, graphs = model["weights"], model["graphs"][1]
    kv, rope = prepare_kv(weights, context), prepare_rope(model["cfg"], HEIGHT // 8, WIDTH // 8)
    manifest = Manifest.read(graphs)
    files = [graphs / manifest.graph(block, kind).file for block, kind in manifest.cycle()]

    def three_steps(**options):
        created.clear()
        with open_runtime("onnx", graphs, **options) as runtime:
            outs = [runtime.forward(weights, x, sigma, kv, rope) for _ in range(3)]
            resident = runtime.backend.resident
        return outs, resident

    outs, resident = three_steps()  # resident="auto": this machine has room for the tiny graphs
    assert len(created) == len(files) and resident == {str(f) for f in files}
    fresh, _ = three_steps(resident="none", prefetch=False)  # serial: exactly one session per visit
    assert len(created) == 3 * len(files)
    np.testing.assert_array_equal(outs[2], fresh[2])

    room = sum(f.stat().st_size for f in files[:2]) * RESIDENT_BYTES_PER_FILE_BYTE
    fake = {"MemAvailable": int((1.5 + executor.RESIDENT_HEADROOM_GIB) * GIB + room) + 1024}
    monkeypatch.setattr(executor, "read_meminfo", lambda: fake)
    _, resident = three_steps(prefetch=False)
    assert resident == {str(f) for f in files[:2]}
    assert len(created) == 2 + 3 * (len(files) - 2)
