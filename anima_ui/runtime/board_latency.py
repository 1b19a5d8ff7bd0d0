"""The simulated board's latency table: what each phase of one branch model takes on a Radxa ROCK 5C 8 GB
(RK3588S2, RKNN runtime 2.3.0, FP16, 512x512 = 1024 image tokens, 512 text tokens).

Every figure is the source blog's (docs/board_facts.md lists them); the per-model numbers are derived from them
below, nothing is tuned."""

from anima_ui.model.config import BRANCH_KINDS

BLOCKS = 28

# "One 28-block forward, pure NPU: self-attn / cross-attn / FFN 12.99 / 3.92 / 21.99 s"
# (blog part 1, section 4: sums over the 28 blocks of one batch-1 forward).
NPU_SECONDS_PER_FORWARD = {"self_attn": 12.99, "cross_attn": 3.92, "mlp": 21.99}

# "Per model lifecycle, self / cross / FFN 0.423 / 0.200 / 0.510 s" (blog part 2, section 4:
# load + init + release of one model, averaged per branch kind).
LIFECYCLE_SECONDS_PER_MODEL = {"self_attn": 0.423, "cross_attn": 0.200, "mlp": 0.510}

# "One pass over 84 models: load_rknn / init_runtime / release 13.96 / 12.90 / 4.84 s"
# (blog part 2, section 4): how one lifecycle splits into its three phases.
LIFECYCLE_PASS_SECONDS = {"load": 13.96, "init": 12.90, "release": 4.84}

# Host work per CFG step: the blog's 20-step CFG denoise took 120.40 s per step, of which 76.21 s pure NPU and
# 31.71 s the lifecycle pass, leaving 12.48 s on the CPU (AdaLN, gates, residual, fp32<->fp16 conversion, Python).
HOST_SECONDS_PER_STEP = 120.40 - 76.21 - sum(LIFECYCLE_PASS_SECONDS.values())

# Not a blog figure: no board has run a batch-2 graph. Two concurrent LCM-UNet sessions on two RK3588
# cores gave 1.78x throughput (GitHub jaylfc/taOS#59); the simulator uses it for --batch 2 graphs
# and every table that shows it says it is an assumption.
ASSUMED_BATCH2_SPEEDUP = 1.78


def phase_seconds(kind: str) -> dict[str, float]:
    """Seconds of each phase of one model of `kind`: load, init, release, and inference per batch-1 call."""
    lifecycle = LIFECYCLE_SECONDS_PER_MODEL[kind]
    pass_total = sum(LIFECYCLE_PASS_SECONDS.values())
    seconds = {phase: lifecycle * s / pass_total for phase, s in LIFECYCLE_PASS_SECONDS.items()}
    seconds["inference"] = NPU_SECONDS_PER_FORWARD[kind] / BLOCKS
    return seconds


def host_seconds_per_visit() -> float:
    """Host work between two branch visits (one visit = one model, cond and uncond): the step's host time
    spread evenly over its 84 visits."""
    return HOST_SECONDS_PER_STEP / (BLOCKS * len(BRANCH_KINDS))


def serial_seconds_per_step() -> float:
    """What the blog's serial loop costs per CFG step in this model: 2 forwards of NPU time, one lifecycle
    pass, host work. (122.0 s; the blog measured 120.40, its whole-step NPU time being 76.21 rather than
    2 x 38.90 = 77.80 from the separate one-forward measurement.)"""
    npu = 2 * sum(NPU_SECONDS_PER_FORWARD.values())
    lifecycle = BLOCKS * sum(LIFECYCLE_SECONDS_PER_MODEL.values())
    return npu + lifecycle + HOST_SECONDS_PER_STEP
