"""The memory gate: before a branch context is opened, check that the machine can afford it.

The blog's safety stop (board_facts.md): MemAvailable < 1.5 GiB or system swap growth > 16 MiB. On an
8 GB board, swapping in the middle of a step costs far more than waiting, so the gate refuses rather
than letting the kernel decide. The latest verdict is kept in `status` for the UI."""

import time
from dataclasses import dataclass

from anima_ui.errors import Cancelled, UserError

GIB = 1 << 30
MIB = 1 << 20


def read_meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    """/proc/meminfo as bytes per field."""
    fields = {}
    with open(path) as f:
        for line in f:
            name, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
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
        self.swap_at_start = self._swap_used()
        self.status = self.check()

    def _swap_used(self) -> int:
        info = read_meminfo(self.meminfo_path)
        return info.get("SwapTotal", 0) - info.get("SwapFree", 0)

    def check(self) -> GateStatus:
        info = read_meminfo(self.meminfo_path)
        available = info["MemAvailable"] / GIB
        growth = (info.get("SwapTotal", 0) - info.get("SwapFree", 0) - self.swap_at_start) / MIB
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
