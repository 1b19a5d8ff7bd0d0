"""The memory gate's refusals name flags that exist: each test runs the command the message suggests."""

import re
import shutil

import pytest

from anima_ui.errors import UserError
from anima_ui.runtime import memory
from anima_ui.runtime.memory import MemoryGate
from test_generate_cli import run_cli


@pytest.fixture(scope="module")
def tiny(tiny_model, tmp_path_factory):
    return shutil.copytree(tiny_model, tmp_path_factory.mktemp("gate") / "tiny")


def generate(tiny, tmp_path, *flags):
    return run_cli(["generate", "--models", str(tiny), "--prompt", "a lighthouse", "--steps", "1", "--width", "64",
                    "--height", "64", "--backend", "sim", "--time-scale", "0.001", "--out", str(tmp_path / "out.png"), *flags])


@pytest.mark.parametrize("variant", ["serial", "prefetch", "two-chains"])
def test_a_floor_above_memavailable_is_refused_and_the_suggested_floor_runs(tiny, tmp_path, capsys, variant):
    assert generate(tiny, tmp_path, "--variant", variant, "--mem-floor-gib", "1e6", "--mem-wait-seconds", "0.2") == 2
    err = capsys.readouterr().err
    assert "memory gate: MemAvailable" in err and "under the 1e+06 GiB floor after waiting 0.2 s" in err
    suggested = re.search(r"--mem-floor-gib (\S+)$", err.strip()).group(1)
    assert generate(tiny, tmp_path, "--variant", variant, "--mem-floor-gib", suggested) == 0
    assert not list(tmp_path.glob(".*partial"))


def test_swapping_in_is_refused_and_the_suggested_policy_runs(tiny, tmp_path, monkeypatch):
    pages = iter(range(0, 10**9, 10_000))  # a machine that keeps swapping in between any two checks
    monkeypatch.setattr(memory, "read_vmstat", lambda path="/proc/vmstat": {"pswpin": next(pages)})
    gate = MemoryGate(wait_seconds=0.05)
    with pytest.raises(UserError) as refused:
        gate.wait_until_open(poll_seconds=0.01)
    flags = re.search(r"run again with (--\S+ \S+)", str(refused.value)).group(1).split()
    assert flags == ["--swap-policy", "ignore"]
    monkeypatch.undo()
    assert generate(tiny, tmp_path, *flags) == 0


def test_swap_that_grew_is_a_warning_in_the_status_panel(tmp_path):
    from types import SimpleNamespace

    from anima_ui.ui.system import gate_warning, swap_warning

    (tmp_path / "vmstat").write_text("pswpin 0\n")
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemAvailable: 4194304 kB\nSwapTotal: 4194304 kB\nSwapFree: 4194304 kB\n")
    gate = MemoryGate(meminfo_path=str(meminfo), vmstat_path=str(tmp_path / "vmstat"))
    meminfo.write_text("MemAvailable: 4194304 kB\nSwapTotal: 4194304 kB\nSwapFree: 3670016 kB\n")  # 512 MiB swapped out
    gate.check()
    runtime = SimpleNamespace(gate_status=gate.status)
    assert gate_warning(runtime) is None  # the gate lets contexts open ...
    assert swap_warning(runtime).startswith("swap grew 512 MiB since the run opened")  # ... and the panel says it grew
    assert swap_warning(None) is None
