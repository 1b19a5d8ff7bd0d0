"""What the machine's memory is doing (/proc read in one place: the gate, the UI's status panel and the benchmarks
all read it here), and the memory gate: before a branch context is opened, check that the machine can afford it.

The gate is the source blog's safety stop (docs/board_facts.md): MemAvailable < 1.5 GiB or system swap growth
> 16 MiB. On an 8 GB board, swapping in the middle of a step costs far more than waiting, so the gate refuses
rather than letting the kernel decide. The latest verdict is kept in `status` for the UI."""

import time
from dataclasses import dataclass

from anima_ui.errors import Cancelled, UserError

GIB = 1 << 30
MIB = 1 << 20


def read_meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    """/proc/meminfo as bytes per field."""
    return _read_kb_fields(path)


def swap_used(meminfo: dict[str, int]) -> int:
    """Bytes of swap in use, from `read_meminfo()`."""
    return meminfo.get("SwapTotal", 0) - meminfo.get("SwapFree", 0)


def process_memory() -> dict[str, int]:
    """This process in bytes: `rss`, `pss` (shared pages counted fairly: what the process really costs the board)
    and `peak_rss` (VmHWM, the high-water mark of this process image since it started)."""
    rollup = _read_kb_fields("/proc/self/smaps_rollup")
    status = _read_kb_fields("/proc/self/status")
    return {"rss": rollup["Rss"], "pss": rollup["Pss"], "peak_rss": status["VmHWM"]}


def _read_kb_fields(path: str) -> dict[str, int]:
    """`Name: value [kB]` lines as bytes per name (fields that are not a number are skipped)."""
    fields = {}
    with open(path) as f:
        for line in f:
            name, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                fields[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return fields


@dataclass(frozen=True)
class GateStatus:
    ok: bool
    mem_available_gib: float
    swap_growth_mib: float
    message: str  # one line for the UI


class MemoryGate:
    def __init__(self, floor_gib: float = 1.5, max_swap_growth_mib: float = 16.0, wait_seconds: float = 30.0,
                 meminfo_path: str = "/proc/meminfo"):
        self.floor_gib = floor_gib
        self.max_swap_growth_mib = max_swap_growth_mib
        self.wait_seconds = wait_seconds
        self.meminfo_path = meminfo_path
        self.swap_at_start = swap_used(read_meminfo(meminfo_path))
        self.status = self.check()

    def check(self) -> GateStatus:
        info = read_meminfo(self.meminfo_path)
        available = info["MemAvailable"] / GIB
        growth = (swap_used(info) - self.swap_at_start) / MIB
        if available < self.floor_gib:
            message = f"memory gate: MemAvailable {available:.2f} GiB is under the {self.floor_gib:g} GiB floor"
        elif growth > self.max_swap_growth_mib:
            message = f"memory gate: swap grew {growth:.1f} MiB since the run started (limit {self.max_swap_growth_mib:g} MiB)"
        else:
            message = f"memory ok: MemAvailable {available:.2f} GiB, swap growth {growth:.1f} MiB"
        self.status = GateStatus(available >= self.floor_gib and growth <= self.max_swap_growth_mib, available, growth, message)
        return self.status

    def wait_until_open(self, stopped=lambda: False, poll_seconds: float = 0.25) -> None:
        """Return once the gate lets a context open; wait up to `wait_seconds` for memory to come back
        (another context being released, another program ending), then raise UserError. `stopped()`
        true (a cancel, a closing runtime) ends the wait with Cancelled."""
        deadline = time.monotonic() + self.wait_seconds
        while not self.check().ok:
            if stopped():
                raise Cancelled("cancelled while waiting for memory")
            if time.monotonic() >= deadline:
                raise UserError(
                    f"{self.status.message} after waiting {self.wait_seconds:g} s; close other programs or lower the floor (--mem-floor-gib)"
                )
            time.sleep(poll_seconds)


def rss_bytes() -> int:
    """This process's resident set now (VmRSS)."""
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """This process's resident-set high-water mark (VmHWM) since it started or since reset_peak_rss()."""
    return _status_kib("VmHWM") * 1024


def reset_peak_rss() -> None:
    """Start a new VmHWM window (Linux: 5 written to clear_refs resets the mark to the current RSS)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")
