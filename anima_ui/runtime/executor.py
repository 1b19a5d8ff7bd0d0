"""The branch runtime: the DiT's branch graphs run by the runners a plan asks for (runners.py, variants.py).

`runtime.forward(weights, x, sigma, kv, rope)` is one DiT forward over the CFG batch (cond, uncond):
- when no branch kind runs on two chains, it is `dit_forward` in the caller's thread with the runtime as its
  `run_branch`: each visit carries the whole batch to the kind's runner;
- when some kind runs on two chains, cond and uncond are two forwards in two threads (each its own host ops),
  meeting at the CFG combine after the forward. A two-chain kind runs on the chain's own runner (cond on core 0,
  uncond on core 1); any other kind runs where the two chains meet (a Rendezvous) on the kind's shared runner.
`runtime(block, kind, inputs)` is a single visit (verify, tune and tests drive visits directly): a two-chain kind
runs its two halves at once on the two chains.

Cancel is checked at every branch boundary of every chain. A cancelled or failed forward stops every chain
(each within the branch it is in), joins them and releases every context; so does close()."""

import threading
import time
from pathlib import Path

import numpy as np

from anima_ui.errors import Cancelled, UserError
from anima_ui.model.config import BRANCH_KINDS
from anima_ui.model.forward import dit_forward
from anima_ui.runtime import quantized_ffn
from anima_ui.runtime.backends import Backend, OnnxBackend, RknnLiteBackend, choose_resident
from anima_ui.runtime.manifest import Manifest
from anima_ui.runtime.memory import GIB, MemoryGate, read_meminfo
from anima_ui.runtime.runners import Lifecycle, NpuGuard, PhaseTimings, PrefetchRunner, Rendezvous, SerialRunner
from anima_ui.runtime.sim import SimulatedBoard
from anima_ui.runtime.variants import VARIANTS, Plan

# What resident onnxruntime sessions leave free beside the memory floor: activations, the host's arrays, other programs.
RESIDENT_HEADROOM_GIB = 1.0


class BranchRuntime:
    def __init__(self, backend: Backend, graph_sets: dict[int, tuple[Path, Manifest]], plan: Plan, gate: MemoryGate,
                 cancel: threading.Event, ffn_input_scales: dict | None = None, ffn: str = "fp16"):
        self.backend = backend
        self.graph_sets = graph_sets
        self.plan = plan
        # λ1 per block whose FFN graph is a W8A8 + low-rank one (its input is x/λ1: every chain's dit_forward folds
        # that into the block's modulation); ffn says which FFNs run, for the PNG parameters and status panel
        self.ffn_input_scales = ffn_input_scales or {}
        self.ffn = ffn
        self.gate = gate
        self.cancel = cancel  # may be replaced between jobs
        self._closing = threading.Event()  # stopping: every wait ends, every chain raises at its next boundary
        self._closed = False
        self._timings = PhaseTimings()
        guard = NpuGuard(plan.wait_for_inference)
        self._lifecycles: list[Lifecycle] = []
        self._runners: list = []
        self._waiters: list = []  # runners and rendezvous to wake when the runtime stops
        # kind -> ("chains", (runner0, runner1)) | ("shared", runner, rendezvous)
        self._routes: dict[str, tuple] = {}
        cycle = self.manifest.cycle()
        for name in dict.fromkeys(plan.variants.values()):
            variant = VARIANTS[name]
            kinds = [kind for kind in BRANCH_KINDS if plan.variants[kind] == name]
            folder, manifest = graph_sets[variant.graph_batch]
            masks = variant.core_masks or (plan.core_mask,)
            runners = []
            for chain in range(variant.chains):
                phases = Lifecycle(backend, folder, manifest, masks[chain], gate, guard, self._timings, self._stopped)
                self._lifecycles.append(phases)
                kind_cycle = [(block, kind) for block, kind in cycle if kind in kinds]
                runners.append(PrefetchRunner(phases, kind_cycle, plan.contexts) if variant.prefetch else SerialRunner(phases))
            self._runners += runners
            self._waiters += runners
            if variant.chains == 2:
                route = ("chains", tuple(runners))
            else:
                rendezvous = Rendezvous(runners[0], manifest, self._stopped)
                self._waiters.append(rendezvous)
                route = ("shared", runners[0], rendezvous)
            self._routes.update(dict.fromkeys(kinds, route))
        self._last_return: dict[int, float] = {}  # per chain (0 for a single-thread forward): end of its last visit

    # -- what the pipeline and UI read ---------------------------------------------------------------------------------
    @property
    def manifest(self) -> Manifest:
        return self.graph_sets[min(self.graph_sets)][1]

    @property
    def graphs_dir(self) -> Path:
        return self.graph_sets[min(self.graph_sets)][0]

    @property
    def timings(self) -> dict:
        return self._timings.snapshot()

    @property
    def open_contexts(self) -> int:
        return sum(phases.open_contexts for phases in self._lifecycles)

    @property
    def gate_status(self):
        return self.gate.status

    # -- running -------------------------------------------------------------------------------------------------------
    def forward(self, weights, x, sigma, kv, rope, on_block=None) -> np.ndarray:
        """One DiT forward (velocity) over the batch in x; see the module docstring for how it splits."""
        self._check()
        if not self.plan.has_chains() or len(x) != 2:
            return dit_forward(weights, self, x, sigma, kv, rope, on_block, self.ffn_input_scales)
        velocities, residuals = [None, None], ([], [])

        def chain(i):
            run_branch = lambda block, kind, inputs: self._chain_visit(i, block, kind, inputs)
            keep = (lambda block, r: residuals[i].append(r.copy())) if on_block else None
            half_kv = [(k[i:i + 1], v[i:i + 1]) for k, v in kv]
            velocities[i] = dit_forward(weights, run_branch, x[i:i + 1], sigma[i:i + 1], half_kv, rope, keep,
                                        self.ffn_input_scales)

        self._both(lambda: chain(0), lambda: chain(1))
        for block, (cond, uncond) in enumerate(zip(*residuals)):
            on_block(block, np.concatenate([cond, uncond]))
        return np.concatenate(velocities)

    def __call__(self, block: int, kind: str, inputs: dict) -> np.ndarray:
        """One visit with the whole batch (the run_branch of a single-thread forward)."""
        try:
            self._check()
            self._host_gap(0, inputs)
            started = time.perf_counter()
            route = self._routes[kind]
            if route[0] == "shared":
                out = route[1](block, kind, inputs)
            elif len(inputs["h"]) == 1:
                out = route[1][0](block, kind, inputs)
            else:
                halves = [None, None]
                manifest = self.graph_sets[1][1]

                def half(i):
                    halves[i] = route[1][i](block, kind, _half(manifest, block, kind, inputs, i))

                self._both(lambda: half(0), lambda: half(1))
                out = np.concatenate(halves)
            self._visited(0, kind, started)
            return out
        except Cancelled:
            self.close()
            raise

    def _chain_visit(self, chain: int, block: int, kind: str, inputs: dict) -> np.ndarray:
        self._check()
        self._host_gap(chain, inputs)
        started = time.perf_counter()
        route = self._routes[kind]
        out = route[1][chain](block, kind, inputs) if route[0] == "chains" else route[2](chain, block, kind, inputs)
        self._visited(chain, kind, started)
        return out

    def _both(self, first, second) -> None:
        """Run `second` in a new thread and `first` here. If either fails, stop every chain, join, release every
        context and raise the failure (a Cancelled that only reports the stop gives way to its cause)."""
        errors = []

        def guarded(fn):
            try:
                fn()
            except BaseException as exc:
                errors.append(exc)
                self._stop()

        thread = threading.Thread(target=guarded, args=(second,), name="branch-chain-1", daemon=True)
        thread.start()
        guarded(first)
        thread.join()
        if errors:
            self.close()
            raise next((e for e in errors if not isinstance(e, Cancelled)), errors[0])

    def _check(self) -> None:
        if self._closed:
            raise UserError("this branch runtime was closed; open a new one")
        if self._stopped():
            raise Cancelled("cancelled" if self.cancel is not None and self.cancel.is_set() else "stopped")

    def _host_gap(self, chain: int, inputs: dict) -> None:
        last = self._last_return.get(chain)
        if last is not None:
            self.backend.host_gap(time.perf_counter() - last, len(inputs["h"]))

    def _visited(self, chain: int, kind: str, started: float) -> None:
        now = time.perf_counter()
        last = self._last_return.get(chain)
        if last is not None:
            self._timings.add(kind, "host", started - last)
        if chain == 0:  # a visit of a two-chain forward is counted once (chain 0), like a batch-2 visit
            self._timings.add(kind, "wall", now - started)
            self._timings.add(kind, "visits")
        self._check()
        self._last_return[chain] = time.perf_counter()

    def _stopped(self) -> bool:
        return self._closing.is_set() or (self.cancel is not None and self.cancel.is_set())

    def _stop(self) -> None:
        self._closing.set()
        for waiter in self._waiters:
            waiter.wake()

    def close(self) -> None:
        """Stop every chain and release every context (idempotent). Call it from the thread that drives the runtime
        (or once nothing runs on it): a context an inference is using in another thread would be released under it."""
        self._closed = True
        self._stop()
        for runner in self._runners:
            runner.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _half(manifest: Manifest, block: int, kind: str, inputs: dict, i: int) -> dict:
    batched = {spec.name for spec in manifest.graph(block, kind).inputs if spec.batched}
    return {name: value[i:i + 1] if name in batched else value for name, value in inputs.items()}


def read_graph_sets(graphs, blocks: int | None = None) -> dict[int, tuple[Path, Manifest]]:
    """{graph batch: (folder, manifest)} from one folder or several (a dict or list of folders); with `blocks`, only
    the graphs of the first `blocks` blocks."""
    folders = graphs.values() if isinstance(graphs, dict) else graphs if isinstance(graphs, (list, tuple)) else [graphs]
    sets = {}
    for folder in folders:
        manifest = Manifest.read(folder)
        sets[manifest.batch] = (Path(folder), manifest.first_blocks(blocks) if blocks else manifest)
    return sets


def make_backend(name: str, files: list[Path] = (), mem_floor_gib: float = 1.5, time_scale: float = 1.0, threads: int = 0,
                 resident: str | None = None, contention: str = "none") -> Backend:
    """files: the graphs the backend will run (the candidates for resident sessions). resident: which onnxruntime sessions stay open between visits: "auto" (as many as MemAvailable allows
    beside the floor; the onnx backend's default), "all", or "none" (the sim's default: it holds what the
    board's host holds)."""
    if name not in ("onnx", "sim", "rknn"):
        raise UserError(f"unknown runtime backend {name!r}: choose onnx, sim or rknn")
    if name == "rknn":
        return RknnLiteBackend()
    resident = resident or ("auto" if name == "onnx" else "none")
    if resident not in ("auto", "all", "none"):
        raise UserError(f"resident sessions {resident!r}: choose auto, all or none")
    budget = {"all": float("inf"), "none": 0.0}.get(resident)
    if budget is None:
        budget = read_meminfo()["MemAvailable"] - (mem_floor_gib + RESIDENT_HEADROOM_GIB) * GIB
    kept = choose_resident(files, budget)
    if name == "onnx":
        return OnnxBackend(threads, kept)
    return SimulatedBoard(time_scale, threads, kept, contention)


def open_runtime(backend, graphs, plan: Plan | None = None, *, prefetch: bool = True, max_contexts: int = 2,
                 core_mask: str = "auto", wait_for_inference: bool = False, cancel: threading.Event | None = None,
                 mem_floor_gib: float = 1.5, swap_policy: str = "wait", gate_wait_seconds: float = 30.0,
                 time_scale: float = 1.0, threads: int = 0, resident: str | None = None, contention: str = "none",
                 blocks: int | None = None, ffn: str = "auto") -> BranchRuntime:
    """A runtime over the graphs in `graphs` (one folder, or one per graph batch: exported ONNX for onnx/sim,
    converted RKNN for rknn). `backend` is "onnx" | "sim" | "rknn" or a Backend instance. Without a plan, every
    kind runs prefetch (or serial with prefetch=False) with max_contexts, core_mask and wait_for_inference.
    time_scale and contention are the simulated board's, threads and resident the onnxruntime sessions'.
    blocks: run only the first `blocks` blocks' graphs (a sample, visited as a cycle of its own).
    ffn: "fp16", "w8a8-lowrank" (the quantized FFN graphs installed in the folder the FFN's variant runs) or "auto"
    (those when that folder has any)."""
    graph_sets = read_graph_sets(graphs, blocks)
    plan = plan or Plan.uniform("prefetch" if prefetch else "serial", contexts=max_contexts, core_mask=core_mask,
                                wait_for_inference=wait_for_inference)
    for batch in sorted(plan.graph_batches() - graph_sets.keys()):
        kinds = [kind for kind in BRANCH_KINDS if plan.variant(kind).graph_batch == batch]
        have = ", ".join(f"batch-{b} graphs in {folder}" for b, (folder, _) in graph_sets.items())
        raise UserError(f"the variant for {', '.join(kinds)} runs batch-{batch} graphs, and there are only {have}; "
                        f"export them with `anima-ui export --batch {batch}` or choose another --variant")
    graph_sets, scales, described = quantized_ffn.swap_in(graph_sets, plan.variant("mlp"), ffn)
    gate = MemoryGate(floor_gib=mem_floor_gib, swap_policy=swap_policy, wait_seconds=gate_wait_seconds)
    if isinstance(backend, str):
        files = [graph_sets[plan.variant(kind).graph_batch][0] / graph_sets[plan.variant(kind).graph_batch][1].graph(block, kind).file
                 for block, kind in next(iter(graph_sets.values()))[1].cycle()]
        backend = make_backend(backend, files, mem_floor_gib, time_scale, threads, resident, contention)
    for folder, manifest in graph_sets.values():
        if manifest.format != backend.graph_format:
            raise UserError(
                f"{folder} holds {manifest.format} graphs but the {backend.name} backend runs {backend.graph_format}; "
                + ("convert them with `anima-ui convert-rknn`" if backend.graph_format == "rknn" else "point it at an exported folder")
            )
    return BranchRuntime(backend, graph_sets, plan, gate, cancel or threading.Event(), scales, described)
