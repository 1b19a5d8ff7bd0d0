"""`anima-ui doctor`: on this machine (no NPU) and on a made-up RK3588 (a device tree, sysfs and /dev under a temp
folder, a loadable librknnrt.so carrying its version string) with the stand-in rknnlite package, where it must
name each injected failure. The graphs are the tiny model's exported ONNX graphs, "converted" by copying them
under .rknn names (the stand-in runs ONNX files, rounding outputs through float16 like the NPU)."""

import functools
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from anima_ui.checkup import collect, verdict
from anima_ui.cli import build_parser
from anima_ui.runtime import board
from anima_ui.runtime.manifest import MANIFEST, GraphEntry, Manifest, sha256_file
from anima_ui.vae.npu_decoder import graphs_folder
from anima_ui.vae.npu_graphs import CHECK_IMAGES, CHECK_LATENT, build_vae_graphs
from anima_ui.vae.onnx_decoder import OnnxDecoder
from helpers import WITHOUT_TORCH, make_library

REPO = Path(__file__).resolve().parents[1]
# Runs the CLI in a process where `import torch` fails, as on the board.
CLI_WITHOUT_TORCH = WITHOUT_TORCH + """
from anima_ui.cli import main
sys.exit(main(sys.argv[1:]))
"""
BOARD_MEMINFO = """MemTotal:        8125608 kB
MemFree:          812340 kB
MemAvailable:    6354120 kB
SwapTotal:       3932156 kB
SwapFree:        3932156 kB
"""


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-c", CLI_WITHOUT_TORCH, *args], capture_output=True, text=True, timeout=300, env=env, cwd=REPO)


def rows_by_check(report):
    return {row.check: row for row in report.rows}


def commands_in(text: str) -> list[tuple[str, list[str]]]:
    """Every `anima-ui COMMAND --flag ...` quoted in a message: (command, its --flags)."""
    return [(m.group(1), re.findall(r"--[a-z][a-z-]*", m.group(2))) for m in re.finditer(r"`anima-ui ([a-z-]+)([^`]*)`", text)]


def assert_commands_exist(text: str) -> None:
    for command, flags in commands_in(text):
        parser = build_parser(command)
        sub = next(a for a in parser._subparsers._group_actions if a.dest == "command").choices
        assert command in sub, f"`anima-ui {command}` in {text!r} is not a command"
        known = {option for action in sub[command]._actions for option in action.option_strings}
        assert set(flags) <= known, f"{set(flags) - known} are not flags of anima-ui {command} (from {text!r})"


@pytest.fixture(scope="module")
def tiny_board_models(tiny_model, tmp_path_factory):
    """The tiny model with exported 64x64 ONNX graphs and their .rknn copies under models/rknn/64x64."""
    models = shutil.copytree(tiny_model, tmp_path_factory.mktemp("doctor") / "tiny")
    export = subprocess.run([sys.executable, "-m", "anima_ui", "export", "--models", str(models), "--width", "64", "--height", "64"],
                            capture_output=True, text=True, timeout=600)
    assert export.returncode == 0, export.stderr
    exported = models / "exported" / "64x64"
    onnx = Manifest.read(exported)
    converted = models / "rknn" / "64x64"
    converted.mkdir(parents=True)
    graphs = []
    for g in onnx.graphs:
        file = Path(g.file).with_suffix(".rknn").name
        shutil.copyfile(exported / g.file, converted / file)
        extra = {"toolkit": "2.5.0", "target": "rk3588", "onnx_file": g.file, "onnx_sha256": g.sha256}
        graphs.append(GraphEntry(file, g.block, g.kind, g.inputs, g.outputs, sha256_file(converted / file), extra))
    Manifest("rknn", 64, 64, onnx.batch, "fp16", graphs, {"onnx_manifest_sha256": sha256_file(exported / MANIFEST)},
             {"rknn-toolkit2": "2.5.0", "target": "rk3588"}).write(converted)
    _npu_decoder_copy(models / "vae" / "qwen_image_vae.safetensors", 64, 64)
    return models


def _npu_decoder_copy(vae, width, height):
    """The NPU decoder's ONNX graphs under .rknn names in vae/npu/rknn/WxH, with the check latent and images a
    conversion stores."""
    onnx_dir, rknn_dir = graphs_folder(vae, "onnx", width, height), graphs_folder(vae, "rknn", width, height)
    graphs = build_vae_graphs(vae, width, height, onnx_dir)
    rknn_dir.mkdir(parents=True)
    for g in graphs.graphs:
        shutil.copyfile(onnx_dir / g.file, rknn_dir / g.file.replace(".onnx", ".rknn"))
    graphs.format = "rknn"
    graphs.graphs = [replace(g, file=g.file.replace(".onnx", ".rknn")) for g in graphs.graphs]
    graphs.layouts = {k: [f.replace(".onnx", ".rknn") for f in v] for k, v in graphs.layouts.items()}
    graphs.write(rknn_dir)
    latent = np.random.default_rng(3).standard_normal((1, 16, height // 8, width // 8)).astype(np.float32)
    np.save(rknn_dir / CHECK_LATENT, latent)
    image = OnnxDecoder(vae).decode_float(latent).transpose(2, 0, 1)[None]
    np.savez(rknn_dir / CHECK_IMAGES, **dict.fromkeys(graphs.layouts, image))


@pytest.fixture
def fake_board(tmp_path):
    """A made-up RK3588 under tmp_path/root, and an environment whose LIBRKNNRT_PATH names a loadable library that
    embeds "librknnrt version: 2.5.0" (a copy of libm with the string appended: the loader ignores trailing bytes)."""
    root = tmp_path / "root"
    driver = root / "sys/bus/platform/drivers/RKNPU"
    driver.mkdir(parents=True)
    device = root / "sys/class/drm/renderD129/device"
    device.mkdir(parents=True)
    (device / "driver").symlink_to(driver)
    (root / "dev/dri").mkdir(parents=True)
    (root / "dev/dri/renderD129").touch()
    (root / "proc/device-tree").mkdir(parents=True)
    (root / "proc/device-tree/compatible").write_bytes(b"radxa,rock-5c\0rockchip,rk3588s\0")
    (root / "proc/meminfo").write_text(BOARD_MEMINFO)
    (root / "proc/swaps").write_text("Filename\tType\tSize\tUsed\tPriority\n/dev/zram0 partition\t3932156\t0\t100\n")
    return root, {"LIBRKNNRT_PATH": str(make_library(tmp_path, "2.5.0"))}


def doctor(models, fake_board, **options):
    root, environ = fake_board
    environ = {**environ, **options.pop("environ", {})}
    report = collect(models, root=root, environ=environ, arch="aarch64", **options)
    ready, line = verdict(report)
    for row in report.rows:
        assert_commands_exist(row.fix or "")
    assert_commands_exist(line)
    return rows_by_check(report), ready, line


# -- this machine ------------------------------------------------------------------------------------------------
def test_doctor_here_prints_the_table_and_says_no_npu(tmp_path):
    if board.find_npu().present:
        pytest.skip("this machine has an NPU")
    result = run_cli("doctor", "--models", str(tmp_path / "no-models"))
    assert result.returncode == 1, result.stderr
    lines = result.stdout.strip().splitlines()
    checks = [line.split("  ")[0].strip() for line in lines[:-1] if not line.startswith(" ")]
    assert checks == ["machine", "NPU driver", "NPU device", "rknn-toolkit-lite2", "librknnrt.so", "converted graphs",
                      "memory", "swap / zram", "model files", "hashes", "NPU run", "NPU decoder"]
    assert lines[-1].startswith(f"no NPU present: this {platform.machine()} machine has no rknpu driver and no /dev/dri/renderD129")
    assert_commands_exist(result.stdout)


def test_doctor_quick_runs_the_command_its_verdict_names(tmp_path):
    """--quick is what scripts/setup.sh runs; the verdict's suggested commands are real ones."""
    result = run_cli("doctor", "--quick", "--models", str(tmp_path))
    assert result.returncode == 1 and "left out (--quick)" in result.stdout
    generate = run_cli("generate", "--help")
    assert generate.returncode == 0 and "--backend" in generate.stdout


# -- a made-up board -----------------------------------------------------------------------------------------------
def test_ready_board(rknnlite_standin, tiny_board_models, fake_board):
    rows, ready, line = doctor(tiny_board_models, fake_board)
    assert ready, (line, rows)
    assert line.startswith("ready: the NPU ran a converted graph and matched its ONNX twin")
    assert rows["machine"].value.startswith("aarch64, rockchip,rk3588s")
    assert rows["NPU device"].status == "ok" and "renderD129" in rows["NPU device"].value
    assert rows["NPU driver"].value == "RKNPU 0.9.8 (as the runtime reports it)"  # no debugfs in the made-up tree
    assert rows["rknn-toolkit-lite2"].value == "2.5.0"
    assert rows["librknnrt.so"].status == "ok" and "2.5.0" in rows["librknnrt.so"].value
    assert rows["converted graphs"].value == "64x64 by rknn-toolkit2 2.5.0; librknnrt.so 2.5.0 >= toolkit: compatible"
    assert rows["memory"].value == "MemTotal 7.75 GiB, MemAvailable 6.06 GiB"
    assert "zram0: zram, compressed RAM, 3.75 GiB" in rows["swap / zram"].value
    assert rows["hashes exported/64x64"].status == rows["hashes rknn/64x64"].status == "ok"
    run = rows["NPU run"]
    assert run.status == "ok" and "runtime 2.5.0, driver 0.9.8" in run.value
    assert float(re.search(r"cosine (\S+)", run.value).group(1)) >= 0.9999
    decoder = rows["NPU decoder"]
    assert decoder.status == "ok" and decoder.value.startswith("64x64: untiled ") and "--decoder npu works" in decoder.value
    assert not rknnlite_standin.OPEN


def test_runtime_older_than_the_toolkit(rknnlite_standin, tiny_board_models, fake_board, monkeypatch, tmp_path):
    monkeypatch.setenv("RKNN_STANDIN_FAULT", "init-version")
    monkeypatch.setenv("RKNN_STANDIN_RUNTIME", "2.3.2")
    old = make_library(tmp_path, "2.3.2")
    rows, ready, line = doctor(tiny_board_models, fake_board, environ={"LIBRKNNRT_PATH": str(old)})
    assert not ready and line.startswith("not ready for the NPU: 1 failed check (NPU run)")
    assert rows["converted graphs"].status == "warn" and "librknnrt.so 2.3.2 is older" in rows["converted graphs"].value
    assert "E RKNN: Invalid RKNN model version 6" in rows["NPU run"].fix
    assert "librknnrt.so 2.3.2 is older than rknn-toolkit2 2.5.0" in rows["NPU run"].fix
    assert not rknnlite_standin.OPEN


def test_user_without_access_to_the_npu(rknnlite_standin, tiny_board_models, fake_board, monkeypatch):
    monkeypatch.setenv("RKNN_STANDIN_FAULT", "init-device")
    monkeypatch.setattr(board, "find_npu", functools.partial(board.find_npu, access=lambda path, mode: False))
    rows, ready, _ = doctor(tiny_board_models, fake_board)
    assert not ready
    assert rows["NPU device"].status == "fail" and rows["NPU device"].fix == board.GROUP_FIX
    assert "failed to open rknpu module" in rows["NPU run"].fix
    assert "likely cause: no access to the NPU device" in rows["NPU run"].fix


def test_npu_out_of_memory(rknnlite_standin, tiny_board_models, fake_board, monkeypatch):
    monkeypatch.setenv("RKNN_STANDIN_FAULT", "init-memory")
    rows, ready, _ = doctor(tiny_board_models, fake_board)
    assert not ready and "likely cause: out of NPU memory" in rows["NPU run"].fix
    assert "failed to malloc npu memory" in rows["NPU run"].fix


def test_inference_failure(rknnlite_standin, tiny_board_models, fake_board, monkeypatch):
    monkeypatch.setenv("RKNN_STANDIN_FAULT", "inference-submit")
    rows, ready, _ = doctor(tiny_board_models, fake_board)
    assert not ready and "E RKNN: failed to submit!" in rows["NPU run"].fix
    assert not rknnlite_standin.OPEN


def test_wrong_numbers_fail_the_cosine_gate(rknnlite_standin, tiny_board_models, fake_board, monkeypatch):
    monkeypatch.setenv("RKNN_STANDIN_FAULT", "wrong-numbers")
    rows, ready, _ = doctor(tiny_board_models, fake_board)
    assert not ready and rows["NPU run"].status == "fail"
    assert float(re.search(r"cosine (\S+)", rows["NPU run"].value).group(1)) < 0.9999
    # the decoder's gate fails too, as a warning: sd.cpp still decodes
    assert rows["NPU decoder"].status == "warn" and "below 50 dB" in rows["NPU decoder"].value
    assert "keep --decoder sdcpp" in rows["NPU decoder"].fix


def test_missing_runtime_library(rknnlite_standin, tiny_board_models, fake_board, tmp_path):
    rows, ready, _ = doctor(tiny_board_models, fake_board, environ={"LIBRKNNRT_PATH": str(tmp_path / "nowhere.so")}, quick=True)
    assert rows["librknnrt.so"].status == "fail" and rows["librknnrt.so"].fix == board.LIBRKNNRT_FIX
    assert not ready


def test_missing_lite2_package(tiny_board_models, fake_board, monkeypatch):
    monkeypatch.setattr(board, "find_lite2", lambda: board.Lite2(None, "No module named 'rknnlite'"))
    rows, ready, _ = doctor(tiny_board_models, fake_board)
    assert rows["rknn-toolkit-lite2"].status == "fail" and rows["rknn-toolkit-lite2"].fix == board.LITE_FIX
    assert rows["NPU run"].status == "skip" and not ready


def test_board_without_the_npu_driver(tiny_board_models, tmp_path):
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/meminfo").write_text(BOARD_MEMINFO)
    rows, ready, line = doctor(tiny_board_models, (tmp_path, {}), quick=True)
    assert rows["NPU driver"].status == "fail" and "RKNPU driver" in rows["NPU driver"].fix
    assert not ready and line.startswith("no NPU present: this aarch64 machine")


def test_changed_graph_file_fails_its_hash(rknnlite_standin, tiny_board_models, fake_board, tmp_path):
    models = tmp_path / "models"
    shutil.copytree(tiny_board_models, models)
    with open(models / "rknn/64x64/block01_mlp.rknn", "ab") as f:
        f.write(b"\0")
    rows, ready, _ = doctor(models, fake_board)
    row = rows["hashes rknn/64x64"]
    assert row.status == "fail" and "block01_mlp.rknn" in row.value and not ready
    assert rows["hashes exported/64x64"].status == "ok"


def test_doctor_command_with_the_standin_in_a_process_without_torch(tiny_board_models):
    """The whole command, as a board runs it: no torch; the stand-in found through PYTHONPATH. This machine has no
    NPU device, so the verdict says so, but the graph still runs through the stand-in and matches its twin."""
    import os

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "rknnlite_standin"), os.environ.get("PYTHONPATH", "")])}
    result = run_cli("doctor", "--models", str(tiny_board_models), env=env)
    assert re.search(r"^rknn-toolkit-lite2 +ok +2\.5\.0$", result.stdout, re.M), result.stdout + result.stderr
    run = next(line for line in result.stdout.splitlines() if line.startswith("NPU run"))
    assert re.match(r"NPU run +ok +64x64/block\d\d_\w+\.rknn ran .*cosine", run), result.stdout
    assert result.returncode == 1 and result.stdout.strip().splitlines()[-1].startswith("no NPU present")


def test_the_ready_verdicts_next_command_runs(tiny_board_models):
    """`anima-ui verify --backend rknn --reference onnx`, which a ready verdict names next, runs through the stand-in
    on the same folder: every branch of the forward goes through RknnLiteBackend and its output checks."""
    import os

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "rknnlite_standin"), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-m", "anima_ui", "verify", "--models", str(tiny_board_models), "--backend", "rknn",
                             "--reference", "onnx", "--width", "64", "--height", "64"], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert '"passed": true' in result.stdout.strip().splitlines()[-1]


def test_status_panel_shows_the_same_facts(rknnlite_standin, tiny_board_models, fake_board, monkeypatch, tmp_path):
    from anima_ui import checkup

    if not board.find_npu().present:
        assert checkup.panel_lines(tmp_path) == [f"**NPU** none on this {platform.machine()} machine (`anima-ui doctor` lists what a board needs)"]
    root, environ = fake_board
    monkeypatch.setattr(board, "find_npu", functools.partial(board.find_npu, access=lambda path, mode: False))
    lines = checkup.panel_lines(tiny_board_models, root=root, environ=environ, arch="aarch64")
    assert lines[0] == "**NPU driver** RKNPU (version: reported by the runtime below, or `sudo cat /sys/kernel/debug/rknpu/version`)"
    assert any(line.startswith("❌ **NPU device**") and board.GROUP_FIX in line for line in lines)
    assert "**rknn-toolkit-lite2** 2.5.0" in lines and any(line.startswith("**librknnrt.so**") for line in lines)
    assert lines[-1].startswith("**swap / zram** 3.75 GiB")
