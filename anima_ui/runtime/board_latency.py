"""The simulated board's latency table: what each phase of one branch model takes on a Radxa ROCK 5C 8 GB
(RK3588S2, RKNN runtime 2.3.0, FP16, 512x512 = 1024 image tokens, 512 text tokens).

Every figure is the source blog's (shared/seeds/anima_rk3588_blog_series.txt, digested in
shared/reference/board_facts.md); the per-model numbers are derived from them below, nothing is tuned."""

BLOCKS = 28
KINDS = ("self_attn", "cross_attn", "mlp")

# board_facts.md "one 28-block forward, pure NPU: self-attn / cross-attn / FFN  12.99 / 3.92 / 21.99"
# (blog part 1, section 4: sums over the 28 blocks of one batch-1 forward).
NPU_SECONDS_PER_FORWARD = {"self_attn": 12.99, "cross_attn": 3.92, "mlp": 21.99}

# board_facts.md "per model lifecycle, self / cross / FFN  0.423 / 0.200 / 0.510" (blog part 2, section 4:
# load + init + release of one model, averaged per branch kind).
LIFECYCLE_SECONDS_PER_MODEL = {"self_attn": 0.423, "cross_attn": 0.200, "mlp": 0.510}

# board_facts.md "one pass over 84 models: load_rknn / init_runtime / release  13.96 / 12.90 / 4.84"
# (blog part 2, section 4): how one lifecycle splits into its three phases.
LIFECYCLE_PASS_SECONDS = {"load": 13.96, "init": 12.90, "release": 4.84}

# Host work per CFG step: board_facts.md "20-step CFG denoise 120.40 per step", minus "pure NPU 76.21",
# minus the 31.71 s lifecycle pass = 12.48 s (AdaLN, gates, residual, fp32<->fp16, Python; rknn.md §4.3).
HOST_SECONDS_PER_STEP = 120.40 - 76.21 - sum(LIFECYCLE_PASS_SECONDS.values())

# Not a blog figure: no board has run a batch-2 graph. Two concurrent LCM-UNet sessions on two RK3588
# cores gave 1.78x throughput (jaylfc/taOS#59, rknn.md §2.2); the simulator uses it for --batch 2 graphs
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
    return HOST_SECONDS_PER_STEP / (BLOCKS * len(KINDS))


def serial_seconds_per_step() -> float:
    """What the blog's serial loop costs per CFG step in this model: 2 forwards of NPU time, one lifecycle
    pass, host work. (122.0 s; the blog measured 120.40, its whole-step NPU time being 76.21 rather than
    2 x 38.90 = 77.80 from the separate one-forward measurement.)"""
    npu = 2 * sum(NPU_SECONDS_PER_FORWARD.values())
    lifecycle = BLOCKS * sum(LIFECYCLE_SECONDS_PER_MODEL.values())
    return npu + lifecycle + HOST_SECONDS_PER_STEP
