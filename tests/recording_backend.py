"""A backend that wraps a real one and records what the runtime asks of it, so tests observe contexts (per chain,
i.e. per core mask) and phase timing from outside the product code."""

import threading
import time
from collections import Counter

from anima_ui.runtime.backends import Backend


class RecordingBackend(Backend):
    def __init__(self, inner: Backend, fail=None, alter=None):
        """fail(entry, core_mask) -> exception or None: raised by init instead of opening a context.
        alter(entry, core_mask, out) -> out: changes a result (to make a variant disagree)."""
        self.inner = inner
        self.name = inner.name
        self.graph_format = inner.graph_format
        self.fail = fail
        self.alter = alter
        self.lock = threading.Lock()
        self.open = Counter()  # core mask -> contexts initialised and not released
        self.peak = Counter()
        self.inits = Counter()
        self.intervals = []  # (phase, core_mask, start, end)

    def host_gap(self, seconds, batch):
        self.inner.host_gap(seconds, batch)

    def input_dtype(self, entry, index):
        return self.inner.input_dtype(entry, index)

    def load(self, path, entry):
        return self.inner.load(path, entry)

    def init(self, loaded, entry, core_mask):
        error = self.fail(entry, core_mask) if self.fail else None
        if error is not None:
            raise error
        started = time.perf_counter()
        context = self.inner.init(loaded, entry, core_mask)
        with self.lock:
            self.intervals.append(("init", core_mask, started, time.perf_counter()))
            self.open[core_mask] += 1
            self.inits[core_mask] += 1
            self.peak[core_mask] = max(self.peak[core_mask], self.open[core_mask])
        return context, core_mask

    def run(self, context, entry, arrays):
        started = time.perf_counter()
        out = self.inner.run(context[0], entry, arrays)
        with self.lock:
            self.intervals.append(("run", context[1], started, time.perf_counter()))
        return self.alter(entry, context[1], out) if self.alter else out

    def release(self, context, entry):
        started = time.perf_counter()
        self.inner.release(context[0], entry)
        with self.lock:
            self.intervals.append(("release", context[1], started, time.perf_counter()))
            self.open[context[1]] -= 1

    def total_open(self) -> int:
        with self.lock:
            return sum(self.open.values())
