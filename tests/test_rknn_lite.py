"""The RKNN-Lite backend against the RKNNLite 2.5.0 API, through the stand-in package in tests/rknnlite_standin
(the real API over onnxruntime; faults injected with RKNN_STANDIN_* variables). Here its graph files hold their
block number and answer h + block, so the tests see which model ran on which input. Real RKNN numbers come from
the simulator tier (test_rknn.py)."""

from pathlib import Path

import numpy as np
import pytest

from anima_ui.commands.pipeline_flags import add_pipeline_arguments
from anima_ui.errors import UserError
from anima_ui.runtime import board, open_runtime
from anima_ui.runtime.manifest import GraphEntry, Manifest, TensorSpec

TOKENS, WIDTH, TEXT = 16, 8, 4
FIND_NPU = board.find_npu


@pytest.fixture
def rknn_folder(tmp_path):
    """A converted-graphs folder for a 2-block model: its .rknn files hold their block number + 1."""
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
            graphs.append(GraphEntry(file, block, kind, specs, (TensorSpec("out", h.shape, "float16", True),), "0" * 64,
                                     {"toolkit": "2.5.0"}))
    Manifest("rknn", 64, 64, 1, "fp16", graphs, {}, {"rknn-toolkit2": "2.5.0"}).write(folder)
    return folder


def branch_inputs(kind, batch=2):
    rng = np.random.default_rng(0)
    extra = {"self_attn": {"rope_cos": np.ones((TOKENS, 4)), "rope_sin": np.zeros((TOKENS, 4))},
             "cross_attn": {"k": rng.standard_normal((batch, TEXT, WIDTH)), "v": rng.standard_normal((batch, TEXT, WIDTH))},
             "mlp": {}}[kind]
    return {"h": rng.standard_normal((batch, TOKENS, WIDTH)), **extra}


def npu(access: bool, listed=()):
    """The NPU facts of a board whose render node exists, for a user `rock` with or without access."""
    return board.NpuDevice(soc="rockchip,rk3588", driver="RKNPU", driver_version=None, node=Path("/dev/dri/renderD129"),
                           access=access, node_group="render", user="rock", groups=("rock",), listed_groups=tuple(listed))


def test_serial_call_sequence_per_model(rknnlite_standin, rknn_folder):
    runtime = open_runtime("rknn", rknn_folder, prefetch=False, core_mask="0_1_2")
    inputs = branch_inputs("cross_attn")
    out = runtime(0, "cross_attn", inputs)
    runtime.close()
    np.testing.assert_allclose(out, inputs["h"] + 1, atol=1e-5)  # block 0's model ran on cond, then uncond
    shapes = ((1, TOKENS, WIDTH), (1, TEXT, WIDTH), (1, TEXT, WIDTH))
    assert rknnlite_standin.CALLS == [
        ("RKNNLite", False),
        ("load_rknn", "block00_cross_attn.rknn"),
        ("init_runtime", None, 7),  # NPU_CORE_0_1_2; target None = the board's own NPU
        # float32 in (the runtime converts to FP16), one call per CFG half, the file copy freed after init
        ("inference", shapes, ("float32",) * 3, True),
        ("inference", shapes, ("float32",) * 3, True),
        ("release",),
    ]
    assert runtime.open_contexts == 0 and not rknnlite_standin.OPEN
    assert "API: 2.5.0" in runtime.backend.sdk_version  # asked once, after the first init


def test_prefetch_opens_each_model_once_in_cycle_order(rknnlite_standin, rknn_folder):
    with open_runtime("rknn", rknn_folder, prefetch=True, max_contexts=2) as runtime:
        for block in range(2):
            for kind in ("self_attn", "cross_attn", "mlp"):
                inputs = branch_inputs(kind)
                np.testing.assert_allclose(runtime(block, kind, inputs), inputs["h"] + block + 1, atol=1e-5)
    calls = rknnlite_standin.CALLS
    loads = [c[1] for c in calls if c[0] == "load_rknn"]
    # the cycle's first six models in order; the prefetcher may already have read block 0's next-step file
    assert loads[:6] == [f"block{b:02d}_{k}.rknn" for b in range(2) for k in ("self_attn", "cross_attn", "mlp")]
    inits = sum(c[0] == "init_runtime" for c in calls)
    assert sum(c[0] == "inference" for c in calls) == 12
    assert sum(c[0] == "release" for c in calls) == inits  # close() released every context it had opened
    assert runtime.open_contexts == 0 and not rknnlite_standin.OPEN


def run_failing(folder, prefetch=False, kind="mlp"):
    """Run one branch with the injected fault; return the UserError's message, after checking nothing stays open."""
    runtime = open_runtime("rknn", folder, prefetch=prefetch, max_contexts=2)
    try:
        with pytest.raises(UserError) as failure:
            runtime(0, kind, branch_inputs(kind))
    finally:
        runtime.close()
    assert runtime.open_contexts == 0
    return str(failure.value)


@pytest.mark.parametrize("prefetch", [False, True])
def test_init_version_mismatch_quotes_the_runtime_and_names_the_versions(rknnlite_standin, rknn_folder, monkeypatch, prefetch):
    monkeypatch.setenv("RKNN_STANDIN_FAULT", "init-version")
    monkeypatch.setenv("RKNN_STANDIN_RUNTIME", "2.3.2")
    monkeypatch.setattr(board, "find_npu", lambda: npu(access=True))
    message = run_failing(rknn_folder, prefetch)
    assert "RKNNLite init_runtime failed for block00_mlp.rknn" in message
    assert "E RKNN: Invalid RKNN model version 6" in message  # quoted from the C runtime's own output
    assert "likely cause: librknnrt.so 2.3.2 is older than rknn-toolkit2 2.5.0" in message
    assert "LIBRKNNRT_PATH" in message and "`anima-ui doctor`" in message
    assert not rknnlite_standin.OPEN


def test_init_without_device_access_gives_the_group_fix(rknnlite_standin, rknn_folder, monkeypatch):
    monkeypatch.setenv("RKNN_STANDIN_FAULT", "init-device")
    monkeypatch.setattr(board, "find_npu", lambda: npu(access=False))
    message = run_failing(rknn_folder)
    assert "E RKNN: failed to open rknpu module, need to insmod rknpu dirver!" in message
    assert "likely cause: no access to the NPU device /dev/dri/renderD129: `sudo usermod -aG render,video $USER`, then log out and back in" in message
    # added to the group already, but this login predates it
    monkeypatch.setattr(board, "find_npu", lambda: npu(access=False, listed=("render",)))
    assert "rock is in group render but this login predates it: log out and back in (or `newgrp render`)" in run_failing(rknn_folder)


def test_init_device_failure_without_a_device_node_says_the_driver_is_missing(rknnlite_standin, rknn_folder, monkeypatch, tmp_path):
    monkeypatch.setenv("RKNN_STANDIN_FAULT", "init-device")
    monkeypatch.setattr(board, "find_npu", lambda: FIND_NPU(tmp_path))  # an empty tree: no driver, no node
    message = run_failing(rknn_folder)
    assert "no NPU device node (the rknpu kernel driver is not loaded)" in message


def test_init_out_of_npu_memory(rknnlite_standin, rknn_folder, monkeypatch):
    monkeypatch.setenv("RKNN_STANDIN_FAULT", "init-memory")
    monkeypatch.setattr(board, "find_npu", lambda: npu(access=True))
    message = run_failing(rknn_folder, prefetch=True)
    assert "failed to malloc npu memory" in message
    assert "likely cause: out of NPU memory" in message and "--no-prefetch" in message
    assert not rknnlite_standin.OPEN


@pytest.mark.parametrize("facts, runtime_version, first", [
    (dict(access=False), "2.5.0", "no access to the NPU device"),
    (dict(access=True), "2.3.2", "librknnrt.so 2.3.2 is older than rknn-toolkit2 2.5.0"),
    (dict(access=True), "2.5.0", "out of NPU memory"),
])
def test_silent_init_failure_ranks_causes_by_the_machines_facts(rknnlite_standin, rknn_folder, monkeypatch, facts,
                                                                 runtime_version, first):
    """No `E RKNN:` line: the causes come from what this machine shows, all three when it shows nothing."""
    monkeypatch.setenv("RKNN_STANDIN_FAULT", "init-silent")
    monkeypatch.setattr(board, "find_npu", lambda: npu(**facts))
    monkeypatch.setenv("RKNN_STANDIN_RUNTIME", runtime_version)  # what the runtime's info lines say it is
    message = run_failing(rknn_folder)
    assert "the runtime said" not in message
    causes = message.split(". likely cause", 1)[1].split(": ", 1)[1]
    assert causes.startswith(first)
    if first == "out of NPU memory":  # nothing points anywhere, and access and versions rule the others out
        assert "older than" not in causes and "no access" not in causes


def test_rejected_core_mask_releases_the_half_built_runtime(rknnlite_standin, rknn_folder, monkeypatch):
    monkeypatch.setenv("RKNN_STANDIN_FAULT", "init-core-mask")
    monkeypatch.setattr(board, "find_npu", lambda: npu(access=True))
    run_failing(rknn_folder)
    assert rknnlite_standin.CALLS[-1] == ("release",) and not rknnlite_standin.OPEN


def test_inference_failure_quotes_the_runtime_and_leaves_nothing_open(rknnlite_standin, rknn_folder, monkeypatch):
    monkeypatch.setenv("RKNN_STANDIN_FAULT", "inference-submit")
    monkeypatch.setattr(board, "find_npu", lambda: npu(access=True))
    for prefetch in (False, True):
        message = run_failing(rknn_folder, prefetch)
        assert "RKNNLite inference failed for block00_mlp.rknn" in message
        assert "E RKNN: failed to submit!, op id: 0, op name: MatMul" in message
        assert "the NPU driver failed to run the graph" in message and "--no-prefetch" in message
        assert not rknnlite_standin.OPEN


def test_load_failure_says_to_convert_again(rknnlite_standin, rknn_folder, monkeypatch):
    monkeypatch.setenv("RKNN_STANDIN_FAULT", "load")
    message = run_failing(rknn_folder)
    assert "RKNNLite load_rknn failed for block00_mlp.rknn" in message
    assert "convert the graphs again with `anima-ui convert-rknn`" in message


@pytest.mark.parametrize("fault, expected", [("output-shape", "output out has shape (64,), its manifest says (1, 16, 8)"),
                                             ("output-count", "gave 2 outputs, its manifest lists 1")])
def test_outputs_are_checked_against_the_manifest(rknnlite_standin, rknn_folder, monkeypatch, fault, expected):
    monkeypatch.setenv("RKNN_STANDIN_FAULT", fault)
    message = run_failing(rknn_folder)
    assert expected in message and "`anima-ui convert-rknn`" in message
    assert not rknnlite_standin.OPEN


def test_outputs_are_reshaped_to_the_manifest(rknnlite_standin, rknn_folder, monkeypatch):
    monkeypatch.setenv("RKNN_STANDIN_FAULT", "output-flat")
    inputs = branch_inputs("mlp")
    with open_runtime("rknn", rknn_folder, prefetch=False) as runtime:
        out = runtime(1, "mlp", inputs)
    np.testing.assert_allclose(out, inputs["h"] + 2, atol=1e-5)


def test_the_runtimes_output_still_reaches_the_terminal(rknnlite_standin, rknn_folder, monkeypatch, capfd):
    """Captured for the error message, then passed on: the lines are not lost, the repeated info lines are."""
    monkeypatch.setenv("RKNN_STANDIN_FAULT", "init-version")
    monkeypatch.setattr(board, "find_npu", lambda: npu(access=True))
    run_failing(rknn_folder)
    out, err = capfd.readouterr()
    assert "E RKNN: [" in out and "Invalid RKNN model version 6" in out
    assert "E Catch exception when init runtime!" in err


def test_suggested_flags_exist():
    """Every --flag the RKNN error messages suggest is a flag of generate and serve."""
    import argparse

    parser = argparse.ArgumentParser()
    add_pipeline_arguments(parser)
    texts = [board.cause_text(c, npu(access=False), "2.3.2", "2.5.0") for c in ("file", "device", "version", "memory", "submit")]
    flags = {word.strip("`.,():") for text in texts for word in text.split() if word.startswith("--")}
    assert flags == {"--no-prefetch"}
    for flag in flags:
        assert parser.parse_args([flag])


def test_two_chains_init_their_contexts_on_cores_0_and_1(rknnlite_standin, rknn_folder):
    """cond on NPU_CORE_0 (mask 1), uncond on NPU_CORE_1 (mask 2), each chain its own contexts; nothing stays open."""
    from anima_ui.runtime import Plan

    with open_runtime("rknn", rknn_folder, Plan.uniform("two-chains")) as runtime:
        for block in range(2):
            for kind in ("self_attn", "cross_attn", "mlp"):
                inputs = branch_inputs(kind)
                np.testing.assert_allclose(runtime(block, kind, inputs), inputs["h"] + block + 1, atol=1e-5)
    masks = [call[2] for call in rknnlite_standin.CALLS if call[0] == "init_runtime"]
    assert set(masks) == {1, 2} and masks.count(1) >= 6 and masks.count(2) >= 6  # every graph opened on both chains
    assert runtime.open_contexts == 0 and not rknnlite_standin.OPEN
