"""Runners: each is a `run_branch(block, kind, inputs)` over the graphs of one cycle (the fixed order in which a
forward visits them, restricted to the branch kinds the runner serves), with the board's lifecycle:
load (read the file) -> init (a runnable context on the runner's NPU cores) -> run -> release.

- SerialRunner: the blog's loop, in the caller's thread: load, init, run, release, one graph at a time.
- PrefetchRunner: the cycle makes the next graph perfectly predictable (a prefetch, never a cache), so a
  background thread keeps the next K contexts open and releases the ones behind. The caller and the thread
  meet on one condition: the caller waits for its context, the thread for work.
- Rendezvous: where the two chains of a two-chain forward meet to run a branch on one shared runner.

Every phase is timed per branch kind in the runtime's PhaseTimings (what `bench runtime` and `tune` read);
every load and init first asks the memory gate; a stopped runtime (cancel or close) ends every wait."""

import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from anima_ui.errors import Cancelled, UserError
from anima_ui.model.config import BRANCH_KINDS
from anima_ui.runtime.backends import Backend
from anima_ui.runtime.manifest import GraphEntry, Manifest
from anima_ui.runtime.memory import MemoryGate


class PhaseTimings:
    """Seconds per phase and counts, per branch kind, summed over every runner and chain of one runtime.
      load / init / release / inference: time in those backend calls, whichever thread made them
      lifecycle_exposed: time a chain spent doing, or waiting for, load/init/release of the graph it needed
      host: time between two visits of a chain (host ops: AdaLN, residual, sampler ...), before this kind's visit
      wall: time the caller spent in visits of this kind (for a two-chain visit: until both chains finished)
      visits / calls / inits: branch visits, backend run calls, contexts opened"""

    SECONDS = ("load", "init", "inference", "release", "lifecycle_exposed", "host", "wall")
    COUNTS = ("visits", "calls", "inits")

    def __init__(self):
        self._lock = threading.Lock()
        self._per_kind = {kind: dict.fromkeys(self.SECONDS + self.COUNTS, 0.0) for kind in BRANCH_KINDS}

    def add(self, kind: str, name: str, value: float = 1.0) -> None:
        with self._lock:
            self._per_kind[kind][name] += value

    def snapshot(self) -> dict:
        """Totals over the kinds (additive: a caller may diff two snapshots), plus `per_kind`."""
        with self._lock:
            per_kind = {kind: dict(values) for kind, values in self._per_kind.items()}
        totals = {name: sum(values[name] for values in per_kind.values()) for name in self.SECONDS + self.COUNTS}
        totals["lifecycle"] = totals["load"] + totals["init"] + totals["release"]
        totals["lifecycle_hidden"] = max(0.0, totals["lifecycle"] - totals["lifecycle_exposed"])
        totals["per_kind"] = per_kind
        return totals


class NpuGuard:
    """With wait_for_inference, init and release wait until no inference runs and hold new inference back while
    they work: the driver's behaviour under init/release concurrent with inference is undocumented (it has failed
    under concurrency before), so a first run can rule it out. Without it, the guard does nothing."""

    def __init__(self, wait_for_inference: bool = False):
        self.enabled = wait_for_inference
        self._cond = threading.Condition()
        self._inferring = 0
        self._lifecycle = False
        self._lifecycle_waiting = 0

    @contextmanager
    def inference(self):
        if not self.enabled:
            yield
            return
        with self._cond:
            self._cond.wait_for(lambda: not self._lifecycle and not self._lifecycle_waiting)
            self._inferring += 1
        try:
            yield
        finally:
            with self._cond:
                self._inferring -= 1
                self._cond.notify_all()

    @contextmanager
    def lifecycle(self):
        if not self.enabled:
            yield
            return
        with self._cond:
            self._lifecycle_waiting += 1
            self._cond.wait_for(lambda: self._inferring == 0 and not self._lifecycle)
            self._lifecycle_waiting -= 1
            self._lifecycle = True
        try:
            yield
        finally:
            with self._cond:
                self._lifecycle = False
                self._cond.notify_all()


class Lifecycle:
    """The phases of one graph set on one backend for one chain's NPU cores, each timed per kind."""

    def __init__(self, backend: Backend, folder, manifest: Manifest, core_mask: str, gate: MemoryGate, guard: NpuGuard,
                 timings: PhaseTimings, stopped):
        self.backend = backend
        self.folder = Path(folder)
        self.manifest = manifest
        self.core_mask = core_mask
        self.gate = gate
        self.guard = guard
        self.timings = timings
        self.stopped = stopped  # () -> bool: cancel set or runtime closing
        self._lock = threading.Lock()
        self.open_contexts = 0

    def entry(self, block: int, kind: str) -> GraphEntry:
        return self.manifest.graph(block, kind)

    def _timed(self, entry: GraphEntry, phase: str, exposed: bool, fn, *args):
        started = time.perf_counter()
        try:
            return fn(*args)
        finally:
            elapsed = time.perf_counter() - started
            self.timings.add(entry.kind, phase, elapsed)
            if exposed:
                self.timings.add(entry.kind, "lifecycle_exposed", elapsed)

    def load(self, entry: GraphEntry, exposed: bool):
        self.gate.wait_until_open(self.stopped)
        return self._timed(entry, "load", exposed, self.backend.load, self.folder / entry.file, entry)

    def init(self, loaded, entry: GraphEntry, exposed: bool):
        self.gate.wait_until_open(self.stopped)
        with self.guard.lifecycle():
            context = self._timed(entry, "init", exposed, self.backend.init, loaded, entry, self.core_mask)
        with self._lock:
            self.open_contexts += 1
        self.timings.add(entry.kind, "inits")
        return context

    def open(self, entry: GraphEntry, exposed: bool):
        return self.init(self.load(entry, exposed), entry, exposed)

    def release(self, holder: list, entry: GraphEntry, exposed: bool) -> None:
        """Release the context in the one-element `holder`, which holds its last reference: the object is freed
        inside the timed phase, not whenever a caller's variable goes out of scope."""
        try:
            with self.guard.lifecycle():
                self._timed(entry, "release", exposed, lambda: self.backend.release(holder.pop(), entry))
        finally:
            with self._lock:
                self.open_contexts -= 1

    def run(self, context, entry: GraphEntry, inputs: dict) -> np.ndarray:
        """One visit's calls: the whole batch in one call when the graph takes it; on a batch-1 graph one call per
        image; a batch-2 graph asked for one image is filled up and the extra row dropped."""
        arrays = [self._input(entry, i, inputs) for i in range(len(entry.inputs))]
        batched = [i for i, spec in enumerate(entry.inputs) if spec.batched]
        batch = arrays[batched[0]].shape[0]
        graph_batch = entry.inputs[batched[0]].shape[0]
        if batch == graph_batch:
            return self._call(context, entry, arrays)
        if graph_batch == 1:
            parts = [self._call(context, entry, [a[b:b + 1] if i in batched else a for i, a in enumerate(arrays)])
                     for b in range(batch)]
            return np.concatenate(parts, axis=0)
        if batch < graph_batch:
            padded = [np.concatenate([a] + [a[-1:]] * (graph_batch - batch)) if i in batched else a for i, a in enumerate(arrays)]
            return self._call(context, entry, padded)[:batch]
        raise UserError(f"{entry.file} takes a batch of {graph_batch}, got {batch}; export with --batch {batch}")

    def _input(self, entry: GraphEntry, index: int, inputs: dict) -> np.ndarray:
        spec = entry.inputs[index]
        array = np.asarray(inputs[spec.name])
        expected = spec.shape[1:] if spec.batched else spec.shape
        got = array.shape[1:] if spec.batched else array.shape
        if tuple(got) != tuple(expected):
            m = self.manifest
            raise UserError(
                f"{entry.file} input {spec.name} has shape {tuple(expected)}, got {tuple(got)}: the graphs in {self.folder} "
                f"are for {m.width}x{m.height}; export graphs for this size"
            )
        return np.ascontiguousarray(array, dtype=self.backend.input_dtype(entry, index))

    def _call(self, context, entry: GraphEntry, arrays: list) -> np.ndarray:
        with self.guard.inference():
            out = self._timed(entry, "inference", False, self.backend.run, context, entry, arrays)
        self.timings.add(entry.kind, "calls")
        return np.asarray(out, dtype=np.float32)


class SerialRunner:
    """The blog's loop: every visit loads, inits, runs and releases its graph in the caller's thread."""

    def __init__(self, phases: Lifecycle):
        self.phases = phases

    def __call__(self, block: int, kind: str, inputs: dict) -> np.ndarray:
        entry = self.phases.entry(block, kind)
        holder = [self.phases.open(entry, exposed=True)]
        try:
            return self.phases.run(holder[0], entry, inputs)
        finally:
            self.phases.release(holder, entry, exposed=True)

    def wake(self) -> None:
        """Nothing waits inside a serial runner."""

    def close(self) -> None:
        """Nothing stays open between visits."""


class PrefetchRunner:
    """Keeps the contexts of the next `contexts` (K) positions of the cycle open from a background thread.

    Positions count visits over the cycle (position % len(cycle) is the graph). `_want` is the position the
    caller needs next; the thread works, in this order: release every context behind `_want`; open the first
    position of the window [_want, _want + K) that has none (reading its file first); read the file of the
    position after the window (a read needs no context, and it keeps a short cross-attention visit from
    exposing the FFN's load behind it). Nothing polls: each side notifies the condition when it changes state."""

    def __init__(self, phases: Lifecycle, cycle: list[tuple[int, str]], contexts: int):
        if contexts < 2:
            raise UserError(f"--max-contexts {contexts}: prefetching needs at least 2 contexts (1 is the serial variant)")
        self.phases = phases
        self.cycle = cycle
        self.contexts = contexts
        self._cond = threading.Condition()
        self._want: int | None = None
        self._open: dict[int, object] = {}
        self._read: dict[int, object] = {}
        self._failed: dict[int, BaseException] = {}
        self._closed = False
        self._worker: threading.Thread | None = None

    # -- the caller's side -------------------------------------------------------------------------------------
    def __call__(self, block: int, kind: str, inputs: dict) -> np.ndarray:
        entry = self.phases.entry(block, kind)
        started = time.perf_counter()
        with self._cond:
            position = self._claim(self.cycle.index((block, kind)))
            self._cond.wait_for(lambda: position in self._open or position in self._failed or self._stopped())
            if position in self._failed:
                raise self._failed.pop(position)
            if position not in self._open:
                raise Cancelled("cancelled") if not self._closed else UserError("this branch runtime was closed; open a new one")
            context = self._open[position]
        self.phases.timings.add(kind, "lifecycle_exposed", time.perf_counter() - started)
        try:
            return self.phases.run(context, entry, inputs)
        finally:
            del context  # the worker's release must drop the last reference, so it really frees the context
            with self._cond:
                self._want = position + 1
                self._cond.notify_all()

    def _claim(self, index: int) -> int:
        """Under the lock: the position of graph `index` the caller is at, and start the worker. A visit out of the
        cycle's order (a forward was abandoned half-way) skips forward to it; what lies before becomes stale."""
        n = len(self.cycle)
        if self._want is None:
            self._want = index
        elif self._want % n != index:
            self._want += (index - self._want) % n
            self._failed.clear()
        if self._worker is None and not self._closed:
            self._worker = threading.Thread(target=self._work, name="branch-prefetch", daemon=True)
            self._worker.start()
        self._cond.notify_all()
        return self._want

    def _stopped(self) -> bool:
        return self._closed or self.phases.stopped()

    def wake(self) -> None:
        """Re-evaluate every wait (the runtime calls it when it stops)."""
        with self._cond:
            self._cond.notify_all()

    def close(self) -> None:
        """Stop the thread and release every context (idempotent)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._worker is not None:
            self._worker.join()
            self._worker = None
        with self._cond:
            contexts, self._open = self._open, {}
            self._read.clear()
        for position in sorted(contexts):
            self.phases.release([contexts.pop(position)], self._entry(position), exposed=False)

    # -- the thread's side ------------------------------------------------------------------------------------------
    def _entry(self, position: int) -> GraphEntry:
        return self.phases.entry(*self.cycle[position % len(self.cycle)])

    def _stale(self) -> list[tuple[int, object]]:
        for position in [p for p in self._read if p < self._want]:
            del self._read[position]  # a file read for a position already passed: just drop it
        return [(p, self._open.pop(p)) for p in sorted(p for p in self._open if p < self._want)]

    def _next_to_open(self) -> int | None:
        """The position whose file to read or context to init next, or None when the window is full."""
        if self._want is None or self._failed or self.phases.stopped():
            return None
        for position in range(self._want, self._want + self.contexts):
            if position not in self._open:
                return position
        ahead = self._want + self.contexts
        return ahead if ahead not in self._read else None

    def _work(self) -> None:
        while True:
            with self._cond:
                # A caller may be waiting for a position this thread will not open (stopped, or an error pending):
                # wake it before idling, so it sees why.
                self._cond.notify_all()
                self._cond.wait_for(lambda: self._closed or any(p < self._want for p in self._open) or self._next_to_open() is not None)
                if self._closed:
                    return
                stale = self._stale()
                position = None if stale else self._next_to_open()
                ahead = position is not None and position >= self._want + self.contexts
                loaded = self._read.pop(position, None) if position is not None else None
            for old, context in stale:
                holder = [context]
                del context
                self.phases.release(holder, self._entry(old), exposed=False)
            if position is not None:
                try:
                    self._open_or_read(position, loaded, ahead)
                except BaseException as exc:  # handed to the caller, raised when it reaches this position
                    with self._cond:
                        self._failed[position] = exc

    def _open_or_read(self, position: int, loaded, ahead: bool) -> None:
        entry = self._entry(position)
        if loaded is None:
            loaded = self.phases.load(entry, exposed=False)
        with self._cond:
            if position < self._want:
                return  # passed while its file was read
            if ahead or len(self._open) >= self.contexts:  # keep the file until the window reaches it
                self._read[position] = loaded
                return
        context = self.phases.init(loaded, entry, exposed=False)
        with self._cond:
            self._open[position] = context


class Rendezvous:
    """Two chains (0: cond, 1: uncond) meet to run one branch on a shared runner: the first to arrive waits, the
    second runs the branch for both, batch = cond + uncond, and hands the first its half."""

    def __init__(self, runner, manifest: Manifest, stopped):
        self.runner = runner
        self.manifest = manifest
        self.stopped = stopped
        self._cond = threading.Condition()
        self._parked: dict | None = None

    def __call__(self, chain: int, block: int, kind: str, inputs: dict) -> np.ndarray:
        with self._cond:
            if self._parked is None:
                mine = self._parked = {"chain": chain, "at": (block, kind), "inputs": inputs}
                self._cond.wait_for(lambda: "out" in mine or self.stopped())
                if "out" not in mine:
                    if self._parked is mine:
                        self._parked = None
                    raise Cancelled("stopped")
                if isinstance(mine["out"], BaseException):
                    raise Cancelled("the other chain failed on the branch both needed") from mine["out"]
                return mine["out"]
            other, self._parked = self._parked, None
        if other["at"] != (block, kind):
            raise RuntimeError(f"chains out of step: {other['at']} and {(block, kind)}")
        first, second = (other["inputs"], inputs) if other["chain"] < chain else (inputs, other["inputs"])
        batched = {spec.name for spec in self.manifest.graph(block, kind).inputs if spec.batched}
        merged = {name: np.concatenate([first[name], second[name]]) if name in batched else value
                  for name, value in first.items()}
        split = len(first["h"])
        try:
            out = self.runner(block, kind, merged)
        except BaseException as exc:
            with self._cond:
                other["out"] = exc
                self._cond.notify_all()
            raise
        halves = (out[:split], out[split:])
        with self._cond:
            other["out"] = halves[other["chain"]]
            self._cond.notify_all()
        return halves[chain]

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()
