"""The simulated RK3588: onnxruntime computes the numbers, and every phase lasts what the board would take
(board_latency.py) times `time_scale`, sharing the board's hardware with whatever else runs at that moment.

The hardware is three kinds of shared resource, each a fluid model (a job holds an amount of work in scaled
board seconds and progresses at a rate set by the other jobs running at the same time):
- the three NPU cores: a context runs on the cores of its core mask, one context per core at a time (a call
  waits until its cores are free). A call alone on the NPU progresses at rate 1; while another context works
  on another core it progresses at 1 / contention (board_latency.CONTENTION: "none" or the "1.78x" of two
  UNets on two cores);
- storage: load reads the file; n loads at once progress at 1/n each;
- the host's big cores: host ops between visits, init and release; n such jobs progress at min(1, cores / n).

A thread waits for its job on a condition that is notified whenever a job starts or ends (the rates change only
then). Scaled runs keep a debt per thread: when a wait wakes late, or real work outlasts its phase, the excess is
taken off the thread's next job, so totals stay on the board's schedule on a busy machine."""

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

from anima_ui.runtime import board_latency
from anima_ui.runtime.backends import OnnxBackend, mask_cores


@dataclass(eq=False)
class _Job:
    resource: str  # "npu" | "disk" | "host"
    cores: frozenset
    remaining: float  # real seconds of work left at the board's speed (scaled)
    rate: float = 1.0
    done_at: float | None = None


class Board:
    """The shared hardware of one simulated board (one per backend; two chains share it)."""

    def __init__(self, contention: float = 1.0, host_cores: int = board_latency.HOST_CORES):
        self.contention = contention
        self.host_cores = host_cores
        self._cond = threading.Condition()
        self._jobs: list[_Job] = []
        self._updated = time.perf_counter()
        self._debt = threading.local()

    @contextmanager
    def job(self, resource: str, seconds: float, cores: frozenset = frozenset()):
        """Hold `seconds` of `resource` work: the body (the real computation) runs inside the job's time, and the
        context exits once the work is done at the rates the other jobs left it."""
        with self._cond:
            if resource == "npu":
                self._cond.wait_for(lambda: not any(j.cores & cores for j in self._jobs))
            job = _Job(resource, cores, seconds - getattr(self._debt, "owed", 0.0))
            self._change(add=job)
        try:
            yield
        except BaseException:
            with self._cond:
                self._change(remove=job)
            raise
        with self._cond:
            while True:
                self._advance()
                if job.done_at is not None:
                    break
                self._cond.wait(job.remaining / job.rate)
            self._debt.owed = time.perf_counter() - job.done_at
            self._change(remove=job)

    def _change(self, add: _Job | None = None, remove: _Job | None = None) -> None:
        self._advance()
        if add is not None:
            self._jobs.append(add)
        if remove is not None:
            self._jobs.remove(remove)
        for job in self._jobs:
            job.rate = self._rate(job)
        for job in self._jobs:
            if job.done_at is None and job.remaining <= 0:
                job.done_at = time.perf_counter() + job.remaining / job.rate
        self._cond.notify_all()

    def _advance(self) -> None:
        """Progress every job up to now at the rates set at the last change."""
        now = time.perf_counter()
        elapsed, self._updated = now - self._updated, now
        for job in self._jobs:
            if job.done_at is None:
                job.remaining -= elapsed * job.rate
                if job.remaining <= 0:
                    job.done_at = now + job.remaining / job.rate  # when it ran out, in the elapsed interval

    def _rate(self, job: _Job) -> float:
        same = [j for j in self._jobs if j.resource == job.resource]
        if job.resource == "npu":
            return 1.0 / self.contention if any(not (j.cores & job.cores) for j in same) else 1.0
        if job.resource == "disk":
            return 1.0 / len(same)
        return min(1.0, self.host_cores / len(same))


@dataclass
class SimContext:
    session: object
    cores: frozenset


class SimulatedBoard(OnnxBackend):
    """onnxruntime numbers at RK3588 speed on a simulated board (see the module docstring)."""

    name = "sim"

    def __init__(self, time_scale: float = 1.0, threads: int = 0, resident=frozenset(), contention: str = "none"):
        super().__init__(threads, resident)
        self.time_scale = time_scale
        self.board = Board(board_latency.CONTENTION[contention])

    def _scaled(self, seconds: float) -> float:
        return seconds * self.time_scale

    def host_gap(self, seconds, batch):
        # The host work already happened here for `seconds`; the board's host takes the rest of its share.
        with self.board.job("host", self._scaled(board_latency.host_seconds_per_visit(batch)) - seconds):
            pass

    def load(self, path, entry):
        with self.board.job("disk", self._scaled(board_latency.graph_phase_seconds(entry)["load"])):
            return super().load(path, entry)

    def init(self, loaded, entry, core_mask):
        with self.board.job("host", self._scaled(board_latency.graph_phase_seconds(entry)["init"])):
            return SimContext(super().init(loaded, entry, core_mask), mask_cores(core_mask))

    def run(self, context, entry, arrays):
        seconds = board_latency.graph_phase_seconds(entry, len(context.cores))["inference"]
        with self.board.job("npu", self._scaled(seconds), context.cores):
            return super().run(context.session, entry, arrays)

    def release(self, context, entry):
        with self.board.job("host", self._scaled(board_latency.graph_phase_seconds(entry)["release"])):
            super().release(context.session, entry)
