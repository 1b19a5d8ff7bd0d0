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


# The VAE decoder graphs (--decoder npu): no board has run them, so this is an estimate. Inference = the
# graph's GFLOP (in its manifest entry) at 0.23 TFLOPS, the middle of the 0.20-0.26 TFLOPS that published
# SD1.5 VAE decodes reach on one RK3588 NPU core (radxa-docs 256x256 in 3.15 s; happyme531's RK3588 SD
# models 384x384 in 5.48 s and 512x512 in 11.13 s). A batch-of-tiles graph spreads over the 3 cores at
# 2.5/3 of a core each (3 concurrent contexts measured 2.5x one on an RK3588, suharvest/rkvoice-stream#5),
# in rounds of 3 tiles. Load, init and release as a DiT FFN graph's (a .rknn of similar size: 67 MB of FP16
# weights there, 50-85 MB for the decoder graphs at full width).
VAE_TFLOPS_PER_CORE = 0.23
VAE_CORES, VAE_CORES_SPEEDUP = 3, 2.5


def graph_phase_seconds(entry) -> dict[str, float]:
    """Seconds of each phase of one graph (a manifest entry), inference per call with the graph's batch."""
    batch = entry.outputs[0].shape[0]
    if entry.kind.startswith("vae_"):
        per_tile = entry.extra["gflop"] / batch / (VAE_TFLOPS_PER_CORE * 1e3)
        inference = per_tile if batch == 1 else \
            -(-batch // VAE_CORES) * per_tile * VAE_CORES / VAE_CORES_SPEEDUP
        return {**phase_seconds("mlp"), "inference": inference}
    seconds = phase_seconds(entry.kind)
    if batch > 1:
        seconds["inference"] *= batch / ASSUMED_BATCH2_SPEEDUP
    return seconds


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
