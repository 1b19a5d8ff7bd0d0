"""Which variant runs each branch kind fastest here, measured on a sample of blocks and checked against serial.

For every variant, the sample's cycle (block 0 self-attention, cross-attention, FFN, block 1 ...) runs `rounds`
times with the same batch-2 inputs (cond and uncond) under that variant on every kind; each kind's time is the
wall time the caller spent in its visits, per visit (waiting for contexts, inference, both chains), the median over
the rounds after the first (the first opens every context cold). A variant is dropped, with the reason, when it
raises, or when any of its outputs has NaN/Inf, a cosine under MIN_COSINE or a norm off by more than
MAX_NORM_RATIO_ERROR against the serial output of the same visit. Each kind then takes its fastest kept variant; the mix runs once more, checked the same way."""

import statistics
from dataclasses import dataclass, field

import numpy as np

from anima_ui.errors import Cancelled, UserError
from anima_ui.model.config import BRANCH_KINDS
from anima_ui.runtime.executor import open_runtime, read_graph_sets
from anima_ui.runtime.manifest import Manifest
from anima_ui.runtime.quantized_ffn import board_check, quantized_blocks, with_quantized_ffns
from anima_ui.runtime.variants import VARIANTS, Plan

MIN_COSINE = 0.99999
MAX_NORM_RATIO_ERROR = 1e-3  # cosine cannot see a wrong scale; FP16 graphs keep the norm far closer than this
# A quantized FFN against the FP16 one on the sample's inputs: their quality gates ran at `prepare`, on real
# activations; here random inputs only catch a wrong graph, block or λ1, which lands far below this.
QUANTIZED_MIN_COSINE = 0.99
MAX_QUANTIZED_NORM_RATIO_ERROR = 0.05


@dataclass
class Outcome:
    variant: str
    seconds: dict[str, list[float]] = field(default_factory=dict)  # kind -> wall seconds per visit, per round
    dropped: str | None = None

    def median(self, kind: str) -> float:
        rounds = self.seconds[kind]
        return statistics.median(rounds[1:] or rounds)


def sample_inputs(manifest: Manifest, seed: int = 0) -> dict[tuple[int, str], dict]:
    """Batch-2 inputs at the scale the graphs see: AdaLN outputs and k/v about unit RMS, RoPE as cos/sin of real
    rotations (the two halves of a head share an angle)."""
    rng = np.random.default_rng(seed)
    inputs = {}
    for block, kind in manifest.cycle():
        arrays = {}
        for spec in manifest.graph(block, kind).inputs:
            shape = (2, *spec.shape[1:]) if spec.batched else spec.shape
            if spec.name in ("rope_cos", "rope_sin"):
                angles = rng.uniform(0, 2 * np.pi, (shape[0], shape[1] // 2))
                angles = np.concatenate([angles, angles], axis=1)
                arrays[spec.name] = (np.cos(angles) if spec.name == "rope_cos" else np.sin(angles)).astype(np.float32)
            else:
                arrays[spec.name] = rng.standard_normal(shape).astype(np.float32)
        inputs[(block, kind)] = arrays
    return inputs


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-300))


def run_plan(make_backend, graphs, plan: Plan, blocks: int, rounds: int, inputs: dict, options: dict,
             ffn: str = "fp16") -> tuple[dict, dict]:
    """Run the sample's cycle `rounds` times: (outputs of the first round per visit, kind -> seconds per visit per round).
    The variants are compared on the FP16 FFNs (quantized ones differ from serial by their quantization error, and
    exist for batch-1 graphs only); measure_quantized_ffn runs the quantized ones."""
    seconds = {kind: [] for kind in BRANCH_KINDS}
    outputs = {}
    with open_runtime(make_backend(), graphs, plan, blocks=blocks, **{**options, "ffn": ffn}) as runtime:
        cycle = runtime.manifest.cycle()
        for round_index in range(rounds):
            before = runtime.timings["per_kind"]
            for block, kind in cycle:
                out = runtime(block, kind, inputs[(block, kind)])
                if round_index == 0:
                    outputs[(block, kind)] = out
            after = runtime.timings["per_kind"]
            for kind in BRANCH_KINDS:
                visits = after[kind]["visits"] - before[kind]["visits"]
                seconds[kind].append((after[kind]["wall"] - before[kind]["wall"]) / max(visits, 1))
    return outputs, seconds


def compare(out: np.ndarray, expected: np.ndarray) -> tuple[bool, float, float]:
    """(all finite, cosine, norm ratio) of one output against the reference's for the same visit."""
    return bool(np.all(np.isfinite(out))), cosine(out, expected), float(np.linalg.norm(out) / np.linalg.norm(expected))


def disagreement(outputs: dict, reference: dict) -> str | None:
    for (block, kind), out in outputs.items():
        finite, c, ratio = compare(out, reference[(block, kind)])
        if not finite:
            return f"NaN/Inf in block {block} {kind}"
        if not c >= MIN_COSINE:
            return f"disagrees with serial: cosine {c:.7f} < {MIN_COSINE} at block {block} {kind}"
        if not abs(ratio - 1) <= MAX_NORM_RATIO_ERROR:
            return f"disagrees with serial: norm {ratio:.5f} x serial's at block {block} {kind}"
    return None


def measure(make_backend, graphs: dict, variants: list[str], blocks: int, rounds: int, contexts: int = 2,
            core_mask: str = "auto", wait_for_inference: bool = False, options: dict | None = None, progress=None):
    """Measure `variants` over the sample; returns (serial outcome, {variant: Outcome}). `graphs` maps graph batch
    to folder; a variant whose graph set is missing is dropped saying so. `make_backend()` makes a fresh backend."""
    options = options or {}
    progress = progress or (lambda line: None)
    sets = read_graph_sets(graphs, blocks)
    inputs = sample_inputs(sets[1][1])
    plan = lambda name: Plan.uniform(name, contexts=contexts, core_mask=core_mask, wait_for_inference=wait_for_inference)
    try:
        reference, serial_seconds = run_plan(make_backend, graphs, plan("serial"), blocks, rounds, inputs, options)
    except Cancelled:
        raise
    except Exception as exc:
        raise UserError(f"the serial variant failed on the sample ({type(exc).__name__}: {exc}); run `anima-ui verify` first") from exc
    serial = Outcome("serial", serial_seconds)
    outcomes = {"serial": serial}
    progress(_line(serial))
    for name in variants:
        if name == "serial":
            continue
        outcome = Outcome(name)
        if VARIANTS[name].graph_batch not in sets:
            outcome.dropped = f"no batch-{VARIANTS[name].graph_batch} graphs"
        else:
            try:
                outputs, outcome.seconds = run_plan(make_backend, graphs, plan(name), blocks, rounds, inputs, options)
                outcome.dropped = disagreement(outputs, reference)
            except Cancelled:
                raise
            except Exception as exc:
                outcome.dropped = f"failed: {type(exc).__name__}: {exc}"
        outcomes[name] = outcome
        progress(_line(outcome))
    return reference, outcomes


def choose(outcomes: dict[str, "Outcome"]) -> dict[str, str]:
    """Each kind's fastest variant among those kept."""
    kept = [o for o in outcomes.values() if o.dropped is None]
    return {kind: min(kept, key=lambda o: o.median(kind)).variant for kind in BRANCH_KINDS}


def check_choice(make_backend, graphs: dict, choice: dict, blocks: int, rounds: int, reference: dict, contexts: int = 2,
                 core_mask: str = "auto", wait_for_inference: bool = False, options: dict | None = None) -> Outcome:
    """Run the chosen mix over the sample once more, checked against serial like every variant."""
    outcome = Outcome("chosen")
    plan = Plan(dict(choice), contexts=contexts, core_mask=core_mask, wait_for_inference=wait_for_inference)
    sets = read_graph_sets(graphs, blocks)
    outputs, outcome.seconds = run_plan(make_backend, graphs, plan, blocks, rounds, sample_inputs(sets[1][1]), options or {})
    outcome.dropped = disagreement(outputs, reference)
    return outcome


def _line(outcome: Outcome) -> str:
    if outcome.dropped:
        return f"{outcome.variant:<14} dropped: {outcome.dropped}"
    return f"{outcome.variant:<14} " + "  ".join(f"{kind} {outcome.median(kind):.4f} s" for kind in BRANCH_KINDS) + "  (per visit, median)"


@dataclass
class FfnOutcome:
    """FP16 against quantized FFNs: the FP16 FFN's variant (the kind's choice) and its time per FFN visit, the
    batch-1 variant the quantized FFNs ran with and theirs, or why they were dropped; the verdict."""
    blocks: list[int]
    fp16_variant: str
    fp16_seconds: float
    variant: str | None = None
    seconds: list[float] = field(default_factory=list)
    dropped: str | None = None
    board_check: list[dict] = field(default_factory=list)

    @property
    def median(self) -> float | None:
        return statistics.median(self.seconds[1:] or self.seconds) if self.seconds else None

    @property
    def chosen(self) -> str:
        return "w8a8-lowrank" if not self.dropped and self.median < self.fp16_seconds else "fp16"


def measure_quantized_ffn(make_backend, graphs: dict, choice: dict, outcomes: dict, blocks: int, rounds: int,
                          reference: dict, board_backend=None, contexts: int = 2, core_mask: str = "auto",
                          wait_for_inference: bool = False, options: dict | None = None) -> FfnOutcome | None:
    """When the batch-1 graphs have quantized FFNs (`prepare --ffn w8a8-lowrank` installed them after their gates):
    run the chosen mix with them, the FFN on the fastest kept batch-1 variant, and time the FFN visits against the
    FP16 choice's. Dropped when a run fails, an output is not finite or the other kinds disagree with serial, when
    a quantized FFN is far from the FP16 one on the sample (QUANTIZED_MIN_COSINE), or when `board_backend` (the
    board's: NPU against the simulator's saved outputs) fails a block. None when nothing is installed."""
    folder = graphs[1]
    manifest = Manifest.read(folder)
    installed = quantized_blocks(manifest)
    if not installed:
        return None
    fp16_variant = choice["mlp"]
    outcome = FfnOutcome(installed, fp16_variant, outcomes[fp16_variant].median("mlp"))
    batch1 = [o for o in outcomes.values() if o.dropped is None and VARIANTS[o.variant].graph_batch == 1]
    outcome.variant = min(batch1, key=lambda o: o.median("mlp")).variant
    sample = manifest.first_blocks(blocks)
    if not quantized_blocks(sample):
        outcome.dropped = (f"no quantized FFN among the sample's blocks 0..{blocks - 1} (installed: blocks "
                           f"{','.join(map(str, installed))}); tune with --blocks {installed[0] + 1}")
        return outcome
    if board_backend is not None:
        outcome.board_check = board_check(folder, manifest, board_backend, core_mask)
        failed = [row for row in outcome.board_check if not row["passed"]]
        if failed:
            row = failed[0]
            outcome.dropped = (f"block {row['block']}'s quantized FFN on the NPU differs from the simulator: cosine "
                               f"{row['cosine']:.6f}, {row['nonfinite']} NaN/Inf (`anima-ui verify` shows every block)")
            return outcome
    _, scales = with_quantized_ffns(sample, folder)
    inputs = sample_inputs(sample)
    for block, scale in scales.items():  # the host folds 1/λ1 into the modulation: the graph takes x/λ1
        name = sample.graph(block, "mlp").inputs[0].name
        inputs[(block, "mlp")] = {**inputs[(block, "mlp")], name: inputs[(block, "mlp")][name] / scale}
    plan = Plan({**choice, "mlp": outcome.variant}, contexts=contexts, core_mask=core_mask, wait_for_inference=wait_for_inference)
    try:
        outputs, seconds = run_plan(make_backend, graphs, plan, blocks, rounds, inputs, options or {}, ffn="w8a8-lowrank")
    except Cancelled:
        raise
    except Exception as exc:
        outcome.dropped = f"failed: {type(exc).__name__}: {exc}"
        return outcome
    outcome.seconds = seconds["mlp"]
    quantized = {visit: out for visit, out in outputs.items() if visit[1] == "mlp" and visit[0] in scales}
    outcome.dropped = (disagreement({v: o for v, o in outputs.items() if v not in quantized}, reference)
                       or quantized_disagreement(quantized, reference))
    return outcome


def quantized_disagreement(outputs: dict, reference: dict) -> str | None:
    for (block, kind), out in outputs.items():
        finite, c, ratio = compare(out, reference[(block, kind)])
        if not finite:
            return f"NaN/Inf in block {block}'s quantized FFN"
        if not (c >= QUANTIZED_MIN_COSINE and abs(ratio - 1) <= MAX_QUANTIZED_NORM_RATIO_ERROR):
            return (f"block {block}'s quantized FFN is far from the FP16 one on the sample: cosine {c:.5f} (>= "
                    f"{QUANTIZED_MIN_COSINE} expected), norm {ratio:.4f} x; run `anima-ui prepare --ffn w8a8-lowrank` again")
    return None
