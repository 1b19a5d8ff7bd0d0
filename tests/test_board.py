"""The board probes and the RKNN failure diagnosis as pure functions (the doctor and backend tests run them end to end)."""

from pathlib import Path

import pytest

from anima_ui.runtime import board


@pytest.mark.parametrize("runtime, toolkit, covers", [
    ("2.5.0", "2.5.0", True), ("2.5.1", "2.5.0", True), ("2.3.2 (429f97ae6b@2025-04-09T09:09:27)", "2.5.0", False),
    ("2.0.0b0", "2.0.0b0+9bab5682", True), ("1.4.0", "2.3.0", False), (None, "2.5.0", None), ("2.5.0", None, None),
])
def test_runtime_covers_toolkit(runtime, toolkit, covers):
    assert board.runtime_covers(runtime, toolkit) is covers


def test_library_version_is_read_from_the_file(tmp_path):
    library = tmp_path / "librknnrt.so"
    library.write_bytes(b"\x7fELF" + b"\0" * 64 + b"librknnrt version: 2.3.2 (429f97ae6b@2025-04-09T09:09:27)\0" + b"\0" * 16)
    found = board.find_librknnrt({"LIBRKNNRT_PATH": str(library)})
    assert found.path == library and found.version == "2.3.2"
    assert found.exists and found.load_error  # not a loadable library
    assert not board.find_librknnrt({"LIBRKNNRT_PATH": str(tmp_path / "missing.so")}).exists
    assert board.librknnrt_path({}) == Path("/usr/lib/librknnrt.so")


@pytest.mark.parametrize("text, expected", [
    ("RKNN VERSION:\n  API: 2.3.2 (429f97ae6b@2025-04-09T09:09:27)\n  DRV: rknpu: 0.9.8", {"api": "2.3.2", "driver": "0.9.8"}),
    ("I RKNN: [14:34:00.921] RKNN Runtime Information, librknnrt version: 1.4.0 (a10f100eb@2022-09-09T09:07:14)\n"
     "I RKNN: [14:34:00.922] RKNN Driver Information: version: 0.9.8", {"api": "1.4.0", "driver": "0.9.8"}),
    ("I RKNN: [14:09:40.197] RKNN Driver Information, version: 0.8.2", {"driver": "0.8.2"}),
    (None, {}),
])
def test_sdk_version_in_both_of_the_runtimes_formats(text, expected):
    assert board.parse_sdk_version(text) == expected


def device(node=Path("/dev/dri/renderD129"), access=True):
    return board.NpuDevice("rockchip,rk3588", "RKNPU", None, node, access, "render", "rock", ("rock",), ())


@pytest.mark.parametrize("call, errors, npu, runtime, causes", [
    ("init_runtime", ["E RKNN: Invalid RKNN model version 6"], device(), "2.3.2", ["version"]),
    ("init_runtime", ["E RKNN: failed to malloc npu memory!, size: 1, flags: 0x2"], device(), "2.3.2", ["memory", "version"]),
    ("init_runtime", ["E RKNN: failed to open rknn device!"], device(access=False), "2.5.0", ["device"]),
    ("init_runtime", [], device(access=False), "2.3.2", ["device", "version"]),
    ("init_runtime", [], device(), "2.5.0", ["memory"]),
    ("init_runtime", [], None, None, ["memory", "device", "version"]),  # nothing known: every cause of the same -1
    ("inference", ["E RKNN: failed to submit!, op id: 0"], device(), "2.5.0", ["submit"]),
    ("inference", [], device(), "2.5.0", ["submit", "memory"]),
    ("load_rknn", [], device(), "2.5.0", ["file"]),
])
def test_failure_causes(call, errors, npu, runtime, causes):
    assert board.failure_causes(call, errors, npu, runtime, "2.5.0") == causes


def test_npu_found_through_sysfs_and_the_device_tree(tmp_path):
    driver = tmp_path / "sys/bus/platform/drivers/RKNPU"
    driver.mkdir(parents=True)
    (tmp_path / "sys/class/drm/renderD129/device").mkdir(parents=True)
    (tmp_path / "sys/class/drm/renderD129/device/driver").symlink_to(driver)
    (tmp_path / "sys/class/drm/renderD128/device").mkdir(parents=True)  # the GPU: another driver
    (tmp_path / "dev/dri").mkdir(parents=True)
    (tmp_path / "dev/dri/renderD129").touch()
    (tmp_path / "proc/device-tree").mkdir(parents=True)
    (tmp_path / "proc/device-tree/compatible").write_bytes(b"radxa,rock-5b\0rockchip,rk3588\0")
    (tmp_path / "sys/kernel/debug/rknpu").mkdir(parents=True)
    (tmp_path / "sys/kernel/debug/rknpu/version").write_text("RKNPU driver: v0.9.8\n")
    npu = board.find_npu(tmp_path, access=lambda path, mode: False)
    assert (npu.soc, npu.driver, npu.driver_version, npu.node) == ("rockchip,rk3588", "RKNPU", "0.9.8", tmp_path / "dev/dri/renderD129")
    assert npu.present and not npu.access and npu.access_fix() == board.GROUP_FIX
    nothing = board.find_npu(tmp_path / "elsewhere")
    assert not nothing.present and nothing.access_fix() is None
