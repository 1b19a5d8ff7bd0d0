"""The job engine: one worker thread owns the pipeline (the NPU) and runs jobs one at a time, in submission order.

Gradio events never run a generation themselves. They submit a job, watch it and cancel it by id, so a phone that
drops its connection only loses a watcher: the job goes on and a reloaded page re-attaches by the id it kept.
(Measured with Gradio 6.31: a disconnect closes a generator event at its next yield, and Stop frees the event's
concurrency slot while the running step is still running, so a generation that lived inside an event would die
with the phone's connection, and a second one could start beside it.)

The queue takes in what `QueueLimits` allow (jobs in line, jobs in line per device, the size of one job), so one
client cannot fill it. Watchers wait for changes without holding a thread: `changed` is awaited on the event loop,
and one future per loop, resolved by the worker, wakes all of them.
"""

import asyncio
import logging
import queue
import shutil
import statistics
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from anima_ui.errors import Cancelled, UserError
from anima_ui.history import History, HistoryItem
from anima_ui.pipeline import PhaseEvent, ResultEvent, StepEvent
from anima_ui.request import GenerationRequest
from anima_ui.vae.preview import preview_image

log = logging.getLogger(__name__)

FINISHED = ("done", "cancelled", "error")
KEEP_FINISHED_JOBS = 200  # finished jobs stay watchable (re-attach after a long sleep) up to this many
KEEP_PREVIEW_DIRS = 20  # preview JPEGs of older jobs are deleted

# The largest job (width x height x steps) a backend takes, about what it finishes in reasonable time: on the board
# (rknn, and sim, which plays the board) 1024x1024 at 30 steps is 10-40 minutes; a PC's onnx or torch does more.
PIXEL_STEP_BUDGETS = {"rknn": 1024 * 1024 * 30, "sim": 1024 * 1024 * 30, "onnx": 1024 * 1024 * 60,
                      "torch": 1024 * 1024 * 60}


@dataclass(frozen=True)
class QueueLimits:
    """What the queue takes in; None is no limit. A refusal names the limit it hit."""

    max_jobs: int | None = 20  # jobs in line, the running one included
    max_jobs_per_client: int | None = 2  # jobs in line from one device (client address)
    max_pixel_steps: int | None = None  # width x height x steps of one job

    @classmethod
    def for_backend(cls, backend: str, **overrides) -> "QueueLimits":
        """The defaults, with the backend's budget; `overrides` set any of the three (None: no limit)."""
        return cls(**{"max_pixel_steps": PIXEL_STEP_BUDGETS.get(backend), **overrides})


@dataclass
class Job:
    id: str
    request: GenerationRequest
    preview_method: str = "projection"
    state: str = "queued"  # queued | running | done | cancelled | error
    phase: str | None = None  # export | text | denoise | decode while running
    step: int = 0  # steps done (the last StepEvent's step)
    computed: bool | None = None  # whether the last step was computed (False: forecast by Spectrum)
    denoise_seconds: float = 0.0  # the steps' seconds, summed: the ETA's measure
    preview_path: Path | None = None
    item: HistoryItem | None = None
    error: str | None = None
    submitted: float = field(default_factory=time.time)
    started: float | None = None
    finished: float | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    owner: str | None = None  # the submitting device's address (None: the command line, a test)

    @property
    def total(self) -> int:
        return self.request.steps

    @property
    def elapsed(self) -> float:
        if self.started is None:
            return 0.0
        return (self.finished or time.time()) - self.started


class JobManager:
    def __init__(self, load_pipeline, history: History, previews_dir: Path, preview_size: int = 384,
                 limits: QueueLimits = QueueLimits()):
        """load_pipeline() -> Pipeline is called in the worker thread, at start and again after a failed load,
        so a missing model file shows up as a failed job, not as a dead app."""
        self._load_pipeline = load_pipeline
        self.pipeline = None
        self.load_error: str | None = None
        self.history = history
        self.previews_dir = Path(previews_dir)
        self.preview_size = preview_size
        self.limits = limits
        # Every job id starts with this run's prefix, so an id this run made and forgot reads as expired, and any
        # other as made before a restart (the random rest keeps ids unguessable: a session is only a list of ids).
        self.run_prefix = uuid.uuid4().hex[:4]
        self._jobs: dict[str, Job] = {}
        self._order: list[str] = []  # submission order, for queue positions
        self._queue: queue.Queue = queue.Queue()
        self._changed = threading.Condition()
        self._loop_waiters: dict[asyncio.AbstractEventLoop, asyncio.Future] = {}
        self.version = 0  # bumped on every change any watcher may care about
        self._worker = threading.Thread(target=self._work, name="anima-npu-worker", daemon=True)
        self._worker.start()

    # -- called from Gradio events (any thread) ----------------------------------------------------------------------
    def submit(self, request: GenerationRequest, preview_method: str = "projection", owner: str | None = None) -> Job:
        return self.submit_all([request], preview_method, owner)[0]

    def submit_all(self, requests: list[GenerationRequest], preview_method: str = "projection",
                   owner: str | None = None) -> list[Job]:
        """Queue every request or none (an A/B pair is two): UserError naming the limit the jobs would break."""
        jobs = [Job(id=self.run_prefix + uuid.uuid4().hex[:8], request=r, preview_method=preview_method, owner=owner)
                for r in requests]
        with self._changed:
            self._admit(requests, owner)
            for job in jobs:
                self._jobs[job.id] = job
                self._order.append(job.id)
            self._bump()
        for job in jobs:
            self._queue.put(job)
        return jobs

    def _admit(self, requests: list[GenerationRequest], owner: str | None) -> None:
        """Called under the lock, so two devices cannot both take the last place in line."""
        limits = self.limits
        for r in requests:
            if limits.max_pixel_steps is not None and r.width * r.height * r.steps > limits.max_pixel_steps:
                raise UserError(
                    f"{r.width}x{r.height} at {r.steps} steps is more than this board takes in one job: the limit is "
                    f"{limits.max_pixel_steps / 2**20:g} megapixel-steps (width x height x steps; 1024x1024 at 30 "
                    "steps is 30): use a smaller size or fewer steps")
        line = [job for job in map(self._jobs.get, self._order) if job.state in ("queued", "running")]
        if limits.max_jobs is not None and len(line) + len(requests) > limits.max_jobs:
            raise UserError(f"the queue is full: {limits.max_jobs} jobs at most, and {len(line)} are in line; "
                            "try again when one finishes")
        mine = sum(job.owner == owner for job in line) if owner is not None else 0
        per_client = limits.max_jobs_per_client
        if owner is not None and per_client is not None and mine + len(requests) > per_client:
            raise UserError(f"a device may have {per_client} jobs in line and this one has {mine}: wait for one to "
                            "finish, or press Stop")

    def get(self, job_id) -> Job | None:
        return self._jobs.get(job_id) if isinstance(job_id, str) else None

    def expired(self, job_id) -> bool:
        """True when `job_id` is one this run made and has since forgotten (see KEEP_FINISHED_JOBS)."""
        return isinstance(job_id, str) and job_id.startswith(self.run_prefix) and job_id not in self._jobs

    def cancel(self, job_id) -> Job | None:
        """Takes effect at the next branch boundary of a running job; a queued job never starts."""
        job = self.get(job_id)
        if job is not None and job.state not in FINISHED:
            job.cancel.set()
            if job.state == "queued":
                self._finish(job, "cancelled")
        return job

    def wait_for_change(self, version: int, timeout: float) -> int:
        with self._changed:
            self._changed.wait_for(lambda: self.version != version, timeout=timeout)
            return self.version

    async def changed(self, version: int, timeout: float) -> int:
        """wait_for_change for coroutines: it holds no thread while it waits. All waiters on one event loop share
        one future, which the next change resolves (one hop into the loop, however many watch)."""
        loop = asyncio.get_running_loop()
        with self._changed:
            if self.version != version:
                return self.version
            future = self._loop_waiters.get(loop)
            if future is None:
                future = self._loop_waiters[loop] = loop.create_future()
        try:
            await asyncio.wait_for(asyncio.shield(future), timeout)
        except TimeoutError:
            pass
        return self.version

    def running(self) -> Job | None:
        return next((job for job in self.line() if job.state == "running"), None)

    def line(self) -> list[Job]:
        """Unfinished jobs in the order they will run; the running one first."""
        with self._changed:  # the worker forgets old jobs under this lock
            return [self._jobs[i] for i in self._order if self._jobs[i].state in ("queued", "running")]

    def position(self, job: Job) -> int | None:
        """0 while running, n when n-1 jobs are ahead in line, None when finished."""
        line = self.line()
        return line.index(job) if job in line else None

    def eta_seconds(self, job: Job) -> float | None:
        """Seconds until `job` finishes, from measured step times; None before anything was measured."""
        line = self.line()
        if job not in line:
            return 0.0
        total = 0.0
        for ahead in line[: line.index(job) + 1]:
            remaining = self._remaining_seconds(ahead)
            if remaining is None:
                return None
            total += remaining
        return total

    def close(self) -> None:
        for job in self.line():
            job.cancel.set()
        self._queue.put(None)
        self._worker.join(timeout=30)

    # -- estimates ---------------------------------------------------------------------------------------------------
    def _remaining_seconds(self, job: Job) -> float | None:
        per_step = self._seconds_per_step(job)
        if per_step is None:
            return None
        overhead = self._overhead_seconds(job)
        if job.state == "running":
            overhead = overhead if job.phase in (None, "export", "text", "denoise") else overhead / 2
            return (job.total - job.step) * per_step + overhead
        return job.total * per_step + overhead

    def _seconds_per_step(self, job: Job) -> float | None:
        """The job's own steps once it has some, else recent jobs of the same cost. A mean, not a median: with
        Spectrum, forecast steps cost almost nothing and the mean carries their share."""
        if job.step:
            return job.denoise_seconds / job.step
        similar = [j for j in self._recent_finished() if _same_cost(j.request, job.request) and j.step]
        if not similar:
            return None
        return sum(j.denoise_seconds for j in similar) / sum(j.step for j in similar)

    def _overhead_seconds(self, job: Job) -> float:
        """Text encoding and decode, measured on recent jobs of the same size."""
        overheads = [j.elapsed - j.denoise_seconds for j in self._recent_finished()
                     if j.state == "done" and _same_cost(j.request, job.request)]
        return statistics.median(overheads) if overheads else 0.0

    def _recent_finished(self) -> list[Job]:
        with self._changed:
            return [self._jobs[i] for i in self._order[-50:] if self._jobs[i].state in FINISHED]

    # -- the worker --------------------------------------------------------------------------------------------------
    def _work(self) -> None:
        self._ensure_pipeline()
        while True:
            job = self._queue.get()
            if job is None:
                return
            if job.cancel.is_set():
                self._finish(job, "cancelled")
                continue
            self._run(job)

    def _ensure_pipeline(self) -> bool:
        if self.pipeline is not None:
            return True
        try:
            self.pipeline = self._load_pipeline()
            self.load_error = None
        except UserError as exc:
            self.load_error = str(exc)
        with self._changed:
            self._bump()
        return self.pipeline is not None

    def _run(self, job: Job) -> None:
        job.state, job.started = "running", time.time()
        self._delete_old_previews()
        with self._changed:
            self._bump()
        if not self._ensure_pipeline():
            job.error = self.load_error
            self._finish(job, "error")
            return
        try:
            for event in self.pipeline.generate(job.request, job.cancel):
                self._handle(job, event)
            state = "done"
        except Cancelled:
            state = "cancelled"
        except UserError as exc:
            job.error, state = str(exc), "error"
        except Exception as exc:  # noqa: BLE001 -- the worker must outlive a bug in one job; the job shows it
            log.exception("job %s failed", job.id)
            job.error, state = f"internal error: {type(exc).__name__}: {exc}", "error"
        self._finish(job, state)

    def _handle(self, job: Job, event) -> None:
        if isinstance(event, PhaseEvent):
            job.phase = event.phase
        elif isinstance(event, StepEvent):
            job.preview_path = self._write_preview(job, event)
            job.step, job.computed = event.step, event.info.computed
            job.denoise_seconds += event.seconds
        elif isinstance(event, ResultEvent):
            summary = dict(event.summary, model=self.model_name)
            # Saved before the job reads as done, so "done" always has its PNG; a failure above saves nothing.
            job.item = self.history.save(event.image, job.request, summary)
        with self._changed:
            self._bump()

    def _write_preview(self, job: Job, event: StepEvent) -> Path:
        folder = self.previews_dir / job.id
        folder.mkdir(parents=True, exist_ok=True)
        # One file per step: a browser still fetching step n never reads a file being rewritten for step n+1.
        path = folder / f"{event.step:04d}.jpg"
        image = preview_image(event.info.x0, self.preview_size, **self._preview_options(job))
        image.convert("RGB").save(path, format="JPEG", quality=80)
        return path

    def _preview_options(self, job: Job) -> dict:
        if job.preview_method == "taew2_1" and self.pipeline.paths.taesd is not None:
            return {"taesd_path": self.pipeline.paths.taesd}
        return {}

    @property
    def model_name(self) -> str | None:
        return self.pipeline.paths.dit.stem if self.pipeline is not None else None

    def _finish(self, job: Job, state: str) -> None:
        with self._changed:
            job.state, job.finished, job.phase = state, time.time(), None
            self._forget_old_jobs()
            self._bump()

    def _forget_old_jobs(self) -> None:
        finished = [i for i in self._order if self._jobs[i].state in FINISHED]
        for job_id in finished[:-KEEP_FINISHED_JOBS]:
            self._order.remove(job_id)
            del self._jobs[job_id]

    def _delete_old_previews(self) -> None:
        if not self.previews_dir.is_dir():
            return
        folders = sorted(self.previews_dir.iterdir(), key=lambda p: p.stat().st_mtime)
        for folder in folders[:-KEEP_PREVIEW_DIRS]:
            shutil.rmtree(folder, ignore_errors=True)

    def _bump(self) -> None:
        """Called under the lock, from any thread."""
        self.version += 1
        self._changed.notify_all()
        for loop, future in self._loop_waiters.items():
            try:
                loop.call_soon_threadsafe(_resolve, future)
            except RuntimeError:
                pass  # that loop is closed (the server stopped): nobody waits there any more
        self._loop_waiters.clear()


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def _same_cost(a: GenerationRequest, b: GenerationRequest) -> bool:
    return _cost_key(a) == _cost_key(b)


def _cost_key(request: GenerationRequest) -> tuple:
    """What sets the time per step: the size, the CFG batch, and how many steps Spectrum forecasts (its setting)."""
    setting = request.spectrum_params.get("setting", "on") if request.spectrum else "off"
    return request.width, request.height, request.uses_uncond, setting
