"""What the machine's memory is doing (/proc read in one place: the gate, the UI's status panel and the benchmarks
all read it here), and the memory gate: before a branch context is opened, check that the machine can afford it.

Two reasons to hold a context back:
- MemAvailable under the floor (`--mem-floor-gib`, default 1.5 GiB, the blog's safety stop, docs/board_facts.md);
- pages being swapped *in* (`pswpin` in /proc/vmstat) while the gate checks and waits: the machine is
  thrashing, and on an 8 GB board a step that swaps costs far more than waiting. Swap that grew once and
  stays put (a page swapped out early and never needed again) is harmless: it is only a warning for the
  status panel, never a refusal. `--swap-policy ignore` turns the swap-in check off.

The gate waits up to `wait_seconds` for memory to come back (a context being released, another program
ending), then refuses with a message that names the flag that would let the run go on."""

import time
from dataclasses import dataclass

from anima_ui.errors import Cancelled, UserError

GIB = 1 << 30
MIB = 1 << 20
PAGE = 4096
SWAP_POLICIES = ("wait", "ignore")
# Swap-ins below this many pages between two checks are noise (the kernel reads a few pages back now and then).
SWAP_IN_PAGES_LIMIT = 256  # 1 MiB
SWAP_GROWTH_WARNING_MIB = 16.0


def read_meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    """/proc/meminfo as bytes per field."""
    return _read_kb_fields(path)


def read_vmstat(path: str = "/proc/vmstat") -> dict[str, int]:
    """/proc/vmstat's counters (pages or events) by name."""
    fields = {}
    with open(path) as f:
        for line in f:
            name, _, value = line.partition(" ")
            if value.strip().isdigit():
                fields[name] = int(value)
    return fields


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
    swapped_in_pages: int = 0  # since the previous check
    warning: str | None = None  # swap grew since the run opened (shown, never a refusal)


class MemoryGate:
    def __init__(self, floor_gib: float = 1.5, swap_policy: str = "wait", wait_seconds: float = 30.0,
                 meminfo_path: str = "/proc/meminfo", vmstat_path: str = "/proc/vmstat"):
        if swap_policy not in SWAP_POLICIES:
            raise UserError(f"--swap-policy {swap_policy!r}: choose one of {', '.join(SWAP_POLICIES)}")
        if not floor_gib >= 0:
            raise UserError(f"--mem-floor-gib {floor_gib!r}: give a number of GiB, 0 or more")
        self.floor_gib = floor_gib
        self.swap_policy = swap_policy
        self.wait_seconds = wait_seconds
        self.meminfo_path = meminfo_path
        self.vmstat_path = vmstat_path
        self.swap_at_start = swap_used(read_meminfo(meminfo_path))
        self._swapped_in = self._pswpin()
        self.status = self.check()

    def _pswpin(self) -> int:
        try:
            return read_vmstat(self.vmstat_path).get("pswpin", 0)
        except OSError:  # no /proc/vmstat (not Linux): nothing to judge swap by
            return 0

    def check(self) -> GateStatus:
        info = read_meminfo(self.meminfo_path)
        available = info["MemAvailable"] / GIB
        growth = (swap_used(info) - self.swap_at_start) / MIB
        pswpin = self._pswpin()
        swapped_in, self._swapped_in = max(0, pswpin - self._swapped_in), pswpin
        thrashing = self.swap_policy == "wait" and swapped_in > SWAP_IN_PAGES_LIMIT
        if available < self.floor_gib:
            message = f"memory gate: MemAvailable {available:.2f} GiB is under the {self.floor_gib:g} GiB floor"
        elif thrashing:
            message = f"memory gate: {swapped_in * PAGE / MIB:.1f} MiB swapped in since the last check (the machine is swapping)"
        else:
            message = f"memory ok: MemAvailable {available:.2f} GiB, swap growth {growth:.1f} MiB"
        warning = (f"swap grew {growth:.0f} MiB since the run opened (not swapped back in; harmless unless it keeps growing)"
                   if growth > SWAP_GROWTH_WARNING_MIB else None)
        ok = available >= self.floor_gib and not thrashing
        self.status = GateStatus(ok, available, growth, message, swapped_in, warning)
        return self.status

    def wait_until_open(self, stopped=lambda: False, poll_seconds: float = 0.25) -> None:
        """Return once the gate lets a context open. While it is shut, re-check every `poll_seconds` (so swap is
        judged by what is swapped in while the run waits) for up to `wait_seconds`, then raise UserError.
        `stopped()` true (a cancel, a closing runtime) ends the wait with Cancelled."""
        deadline = time.monotonic() + self.wait_seconds
        while not self.check().ok:
            if stopped():
                raise Cancelled("cancelled while waiting for memory")
            if time.monotonic() >= deadline:
                raise UserError(f"{self.status.message} after waiting {self.wait_seconds:g} s; {self._advice()}")
            time.sleep(poll_seconds)

    def _advice(self) -> str:
        if self.status.mem_available_gib < self.floor_gib:
            lower = max(0.0, round(self.status.mem_available_gib / 2, 1))
            return f"close other programs, or run again with a lower floor: --mem-floor-gib {lower:g}"
        return "close other programs, or run again with --swap-policy ignore to go on while the machine swaps"


def rss_bytes() -> int:
    """This process's resident set now (VmRSS)."""
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """This process's resident-set high-water mark (VmHWM) since it started or since reset_peak_rss()."""
    return _status_kib("VmHWM") * 1024


def reset_peak_rss() -> None:
    """Start a new VmHWM window (Linux: 5 written to clear_refs resets the mark to the current RSS). Where the
    kernel refuses (some containers), the mark keeps counting from the process start: a peak, only a wider one."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")
