"""The branch runtime: a `run_branch(block, kind, inputs)` callable for `dit_forward` that runs each
branch graph through a backend with the board's lifecycle (load -> init -> run -> release).

Two executors:
- serial (the blog's loop): on every visit, load, init, run cond+uncond, release, in the caller's thread;
- prefetch: the visiting order is a fixed cycle (block 0 sa, ca, mlp, ..., block 27 mlp, block 0 sa, ...),
  so a background thread opens the next model while the current one runs and releases the previous one.
  At most `max_contexts` contexts are initialised at once; the file of the model after them may already
  be read (reads need no context), which keeps a short cross-attention visit from exposing the FFN's
  load + init behind it.

Every context is opened only after the memory gate lets it; the cancel event is checked at every branch
boundary, and a cancelled or closed runtime releases every context."""

import threading
import time
from pathlib import Path

import numpy as np

from anima_ui.errors import Cancelled, UserError
from anima_ui.runtime.backends import Backend, make_backend
from anima_ui.runtime.manifest import GraphEntry, Manifest
from anima_ui.runtime.memory import MemoryGate

# Additive counters in `timings` (seconds unless named *_count); a caller may diff two snapshots.
#   inference: time in the backend's run calls (NPU time on the board)
#   load / init / release: time in those phases, whichever thread did them
#   host: time between two run_branch calls, spent by the caller (AdaLN, residual, sampler, ...)
#   lifecycle_exposed: time the caller spent in, or waiting for, load/init/release
#   lifecycle_hidden: load + init + release - lifecycle_exposed (what prefetching hid)
COUNTERS = ("inference", "load", "init", "release", "host", "lifecycle_exposed", "visits", "calls")


class BranchRuntime:
    def __init__(self, backend: Backend, graphs_dir, manifest: Manifest, prefetch: bool, max_contexts: int,
                 gate: MemoryGate, cancel: threading.Event):
        if max_contexts < 1 or (prefetch and max_contexts < 2):
            raise UserError(f"max_contexts={max_contexts}: need at least 1 (serial) or 2 (prefetch)")
        self.backend = backend
        self.graphs_dir = Path(graphs_dir)
        self.manifest = manifest
        self.prefetch = prefetch
        self.max_contexts = max_contexts
        self.gate = gate
        self.cancel = cancel  # may be replaced between jobs
        self._cycle = manifest.cycle()
        self._counters = dict.fromkeys(COUNTERS, 0.0)
        self._lock = threading.Condition()
        self._open_count = 0
        self.peak_open_contexts = 0
        self._last_return = None  # end of the previous run_branch call, for host time
        self._closed = False
        # prefetch state, keyed by visit position (a counter over the cycle: position % 84 is the graph)
        self._next = None  # the position the caller needs next
        self._loaded: dict[int, object] = {}
        self._contexts: dict[int, object] = {}
        self._errors: dict[int, BaseException] = {}
        self._worker = None

    # -- what the pipeline and UI read ----------------------------------------------------------------------------
    @property
    def timings(self) -> dict[str, float]:
        with self._lock:
            t = dict(self._counters)
        lifecycle = t["load"] + t["init"] + t["release"]
        t["lifecycle"] = lifecycle
        t["lifecycle_hidden"] = max(0.0, lifecycle - t["lifecycle_exposed"])
        return t

    @property
    def open_contexts(self) -> int:
        with self._lock:
            return self._open_count

    @property
    def gate_status(self):
        return self.gate.status

    # -- run_branch -----------------------------------------------------------------------------------------------
    def __call__(self, block: int, kind: str, inputs: dict) -> np.ndarray:
        if self._closed:
            raise UserError("this branch runtime was closed; open a new one")
        self._check_cancel()
        self._account_host_gap()
        entry = self.manifest.graph(block, kind)
        if self.prefetch:
            position, context = self._acquire_prefetched(block, kind)
            try:
                out = self._run(context, entry, inputs)
            finally:
                del context  # the worker's release must be the last reference, so it really frees the context
                with self._lock:
                    self._next = position + 1
                    self._lock.notify_all()
        else:
            holder = [self._open(entry, exposed=True)]
            try:
                out = self._run(holder[0], entry, inputs)
            finally:
                self._release(holder, entry, exposed=True)
        self._count("visits", 1)
        self._check_cancel()
        self._last_return = time.perf_counter()
        return out

    def close(self) -> None:
        """Stop prefetching and release every context (idempotent)."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        if self._worker is not None:
            self._worker.join()
            self._worker = None
        with self._lock:
            contexts, self._contexts = self._contexts, {}
            self._loaded.clear()
        for position in sorted(contexts):
            self._release([contexts.pop(position)], self._entry_at(position), exposed=False)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- phases -----------------------------------------------------------------------------------------------------
    def _stopped(self) -> bool:
        return self._closed or (self.cancel is not None and self.cancel.is_set())

    def _check_cancel(self) -> None:
        if self.cancel is not None and self.cancel.is_set():
            self.close()
            raise Cancelled("cancelled")

    def _account_host_gap(self) -> None:
        if self._last_return is None:
            return
        # The simulated board also charges the board's host work (AdaLN, residual, ... on the A76 cores).
        self.backend.simulate_host(time.perf_counter() - self._last_return)
        self._count("host", time.perf_counter() - self._last_return)

    def _count(self, name: str, value: float) -> None:
        with self._lock:
            self._counters[name] += value

    def _timed(self, phase: str, exposed: bool, fn, *args):
        started = time.perf_counter()
        result = fn(*args)
        elapsed = time.perf_counter() - started
        with self._lock:
            self._counters[phase] += elapsed
            if exposed:
                self._counters["lifecycle_exposed"] += elapsed
        return result

    def _open(self, entry: GraphEntry, exposed: bool):
        return self._init(self._load(entry, exposed), entry, exposed)

    def _load(self, entry: GraphEntry, exposed: bool):
        self.gate.wait_until_open(self._stopped)
        return self._timed("load", exposed, self.backend.load, self.graphs_dir, entry)

    def _init(self, loaded, entry: GraphEntry, exposed: bool):
        self.gate.wait_until_open(self._stopped)
        context = self._timed("init", exposed, self.backend.init, loaded, entry)
        with self._lock:
            self._open_count += 1
            self.peak_open_contexts = max(self.peak_open_contexts, self._open_count)
        return context

    def _release(self, holder: list, entry: GraphEntry, exposed: bool) -> None:
        """Release the context in the one-element `holder`, which holds its last reference: the object
        is freed inside the timed phase, not whenever a caller's variable goes out of scope."""
        started = time.perf_counter()
        self.backend.release(holder.pop(), entry)
        elapsed = time.perf_counter() - started
        with self._lock:
            self._counters["release"] += elapsed
            if exposed:
                self._counters["lifecycle_exposed"] += elapsed
        with self._lock:
            self._open_count -= 1
            self._lock.notify_all()

    def _run(self, context, entry: GraphEntry, inputs: dict) -> np.ndarray:
        arrays = [self._input(entry, i, inputs) for i in range(len(entry.inputs))]
        batched = [i for i, spec in enumerate(entry.inputs) if spec.batched]
        batch = arrays[batched[0]].shape[0]
        graph_batch = entry.inputs[batched[0]].shape[0]
        if batch == graph_batch:
            return self._call(context, entry, arrays)
        if graph_batch == 1:
            # CFG on a batch-1 graph: cond and uncond as two calls on the one loaded context.
            parts = [self._call(context, entry, [a[b:b + 1] if i in batched else a for i, a in enumerate(arrays)])
                     for b in range(batch)]
            return np.concatenate(parts, axis=0)
        if batch < graph_batch:
            # A batch-2 graph asked for one image (cfg 1): fill the batch, keep what was asked for.
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
                f"{entry.file} input {spec.name} has shape {tuple(expected)}, got {tuple(got)}: the graphs in {self.graphs_dir} "
                f"are for {m.width}x{m.height}; export graphs for this size"
            )
        return np.ascontiguousarray(array, dtype=self.backend.input_dtype(entry, index))

    def _call(self, context, entry: GraphEntry, arrays: list) -> np.ndarray:
        started = time.perf_counter()
        out = self.backend.run(context, entry, arrays)
        with self._lock:
            self._counters["inference"] += time.perf_counter() - started
            self._counters["calls"] += 1
        return np.asarray(out, dtype=np.float32)

    def _entry_at(self, position: int) -> GraphEntry:
        return self.manifest.graph(*self._cycle[position % len(self._cycle)])

    # -- prefetching --------------------------------------------------------------------------------------------
    def _acquire_prefetched(self, block: int, kind: str):
        index = self._cycle.index((block, kind))
        n = len(self._cycle)
        started = time.perf_counter()
        with self._lock:
            if self._next is None:
                self._next = index
            elif self._next % n != index:
                # Visited out of the cycle's order (a forward was abandoned): skip forward to this graph;
                # everything before it becomes stale and the worker releases it.
                self._next += (index - self._next) % n
                self._errors.clear()
            position = self._next
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name="branch-prefetch", daemon=True)
                self._worker.start()
            self._lock.notify_all()
            while position not in self._contexts:
                if position in self._errors:
                    raise self._errors.pop(position)
                if self._stopped():
                    break
                self._lock.wait(0.05)
            context = self._contexts.get(position)
        if context is None:
            self._check_cancel()
            raise UserError("this branch runtime was closed while a branch waited for its model")
        self._count("lifecycle_exposed", time.perf_counter() - started)
        return position, context

    def _work(self) -> None:
        while True:
            with self._lock:
                action = self._next_action()
                while action is None:
                    if self._closed:
                        return
                    self._lock.wait()
                    action = self._next_action()
                if action[0] == "stop":
                    return
            name, position, payload = action
            del action
            entry = self._entry_at(position)
            try:
                if name == "release":
                    self._release(payload, entry, exposed=False)
                elif name == "load":
                    loaded = self._load(entry, exposed=False)
                    with self._lock:
                        self._loaded[position] = loaded
                else:
                    context = self._init(payload, entry, exposed=False)
                    with self._lock:
                        self._contexts[position] = context
            except BaseException as exc:  # handed to the caller, raised when it reaches this position
                with self._lock:
                    self._errors[position] = exc
            with self._lock:
                self._lock.notify_all()

    def _next_action(self):
        """Under the lock: the worker's next job. Releases first (they free memory), then the init or load of
        the first position in the window [next, next + K) that has no context, then reading one file ahead."""
        if self._closed:
            return ("stop", None, None)
        if self._next is None:
            return None
        for position in sorted(p for p in self._loaded if p < self._next):
            del self._loaded[position]  # a read file of a stale position: just drop it
        stale = [p for p in self._contexts if p < self._next]
        if stale:
            position = min(stale)
            return ("release", position, [self._contexts.pop(position)])
        if self._errors or (self.cancel is not None and self.cancel.is_set()):
            return None
        for position in range(self._next, self._next + self.max_contexts):
            if position in self._contexts:
                continue
            if position in self._loaded:
                if self._open_count < self.max_contexts:
                    return ("init", position, self._loaded.pop(position))
                return None
            return ("load", position, None)
        ahead = self._next + self.max_contexts
        if ahead not in self._loaded:
            return ("load", ahead, None)
        return None


def open_runtime(backend, graphs_dir, prefetch: bool = True, max_contexts: int = 2, mem_floor_gib: float = 1.5,
                 cancel: threading.Event | None = None, time_scale: float = 1.0, core_mask: str = "auto",
                 gate_wait_seconds: float = 30.0, threads: int = 0, keep_sessions: bool = False) -> BranchRuntime:
    """A run_branch callable over the graphs in `graphs_dir` (an exported ONNX folder for onnx/sim, a
    converted RKNN folder for rknn). `backend` is "onnx" | "sim" | "rknn" or a Backend instance.
    time_scale and keep_sessions are the simulated board's, core_mask the RKNN-Lite one's."""
    if isinstance(backend, str):
        backend = make_backend(backend, time_scale=time_scale, core_mask=core_mask, threads=threads, keep_sessions=keep_sessions)
    manifest = Manifest.read(graphs_dir)
    if manifest.format != backend.graph_format:
        raise UserError(
            f"{graphs_dir} holds {manifest.format} graphs but the {backend.name} backend runs {backend.graph_format}; "
            + ("convert them with `anima-ui convert-rknn`" if backend.graph_format == "rknn" else "point it at an exported folder")
        )
    gate = MemoryGate(floor_gib=mem_floor_gib, wait_seconds=gate_wait_seconds)
    return BranchRuntime(backend, graphs_dir, manifest, prefetch, max_contexts, gate, cancel or threading.Event())
