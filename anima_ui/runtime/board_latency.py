"""The simulated board's latency table: what each phase of one branch model takes on a Radxa ROCK 5C 8 GB
(RK3588S2, RKNN runtime 2.3.0, FP16, 512x512 = 1024 image tokens, 512 text tokens), and the assumptions the
simulator adds for what nobody has measured on a board (several NPU cores, host cores, storage; docs/runtime.md).

Every figure is the source blog's (docs/board_facts.md lists them); the per-model numbers are derived from them
below, nothing is tuned."""

from anima_ui.model.config import BRANCH_KINDS
from anima_ui.runtime.quantized_ffn import RUNS_QUANTIZED

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

# -- assumptions beyond the blog (no board has measured these; every table that uses them says so) ------------------

# Two NPU cores working at once, each on its own context: how much longer each call takes than alone.
# "none": the cores do not slow each other (2x throughput). "1.78x": two LCM-UNet sessions on cores 0 and 1 gave
# 1.78x the throughput of one (jaylfc/taOS#59), i.e. each call takes 2 / 1.78 = 1.124x as long (shared DDR).
CONTENTION = {"none": 1.0, "1.78x": 2 / 1.78}

# One context on several cores (core_mask 0_1, 0_1_2) splits only Conv/Add/Mul across them; exSDPAttention,
# exGelu, exNorm and Transpose stay on one core (RKNN compiler op list v2.3.0, RK3588 multi-core support). The only
# figure: a whole UNet on 3 cores ran 1.26x faster (taOS#59, tp_mode='all'). For 2 cores there is none; half that
# gain is assumed. The gain applies to the branch's conv share, from its FLOPs at 512x512 (docs/runtime.md):
# self-attention QKV + out 34.4 of 42.9 GFLOP, cross-attention (host K/V) Q + out 17.2 of 21.5, FFN all.
TENSOR_PARALLEL_SPEEDUP = {2: 1.13, 3: 1.26}  # by number of cores
CONV_SHARE = {"self_attn": 34.4 / 42.9, "cross_attn": 17.2 / 21.5, "mlp": 1.0}

# A batch-2 graph on one core does twice the work of a batch-1 call and is assumed to take twice as long.
BATCH2_WORK = 2.0

# The host: host ops and the lifecycle's CPU work (init_runtime, release) share the RK3588's 4 Cortex-A76 cores;
# more such threads at once share them evenly. load_rknn reads the file (the blog's figure is disk-bound,
# ~260 MB/s): loads share one storage stream, two at once take twice as long each (no page-cache hits assumed).
HOST_CORES = 4

# A W8A8 + FP16 low-rank FFN graph (docs/quantized_ffn.md) in place of the FP16 one. The blog measured its plain
# W8A8 FFNs (GELU and outputs FP16) at 1.90x the FP16 FFNs' NPU time (44.76 -> 23.57 s per step); the compiler's
# cycle model puts the low-rank hybrid at 35.5 M cycles against plain W8A8's 33.6 M at full size (`anima-ui bench
# quant --fullsize`), so it is assumed 1.90 x 33.6 / 35.5 = 1.80x faster than FP16. Its file is 36.0 of the FP16
# graph's 68.2 MB, and loading reads it at the same rate; init and release are assumed unchanged.
QUANTIZED_FFN_SPEEDUP = 1.90 * 33.6 / 35.5
QUANTIZED_FFN_LOAD_SHARE = 36.0 / 68.2

# The parts of a 20-step Spectrum image at 512x512 that are not the denoise.
DECODE_SECONDS = 155.04  # the blog's stable-diffusion.cpp tiled decode on the board's CPU
# Not a blog figure (the blog left prompt encoding out): the Qwen3-0.6B file (1.19 GB bf16) read at the blog's
# ~260 MB/s load rate, 4.6 s, plus both prompts encoded; stable-diffusion.cpp does that in 0.15-0.4 s on a 2-core
# x86 PC, assumed 3x slower on the A76 cores: ~1.2 s.
TEXT_SECONDS = 5.8
BLOG_SECONDS_PER_STEP = 120.40
BLOG_SPECTRUM_IMAGE_SECONDS = 1512.04


# The VAE decoder graphs (--decoder npu): no board has run them, so this is an estimate. Inference = the
# graph's GFLOP (in its manifest entry) at 0.23 TFLOPS, the middle of the 0.20-0.26 TFLOPS that published
# SD1.5 VAE decodes reach on one RK3588 NPU core (radxa-docs 256x256 in 3.15 s; happyme531's RK3588 SD
# models 384x384 in 5.48 s and 512x512 in 11.13 s). A batch-of-tiles graph spreads over the 3 cores at
# 2.5/3 of a core each (3 concurrent contexts measured 2.5x one on an RK3588, suharvest/rkvoice-stream#5),
# in rounds of 3 tiles. Load, init and release as a DiT FFN graph's (a .rknn of similar size: 67 MB of FP16
# weights there, 50-85 MB for the decoder graphs at full width).
VAE_TFLOPS_PER_CORE = 0.23
VAE_CORES, VAE_CORES_SPEEDUP = 3, 2.5


def graph_phase_seconds(entry, cores: int = 1) -> dict[str, float]:
    """Seconds of each phase of one graph (a manifest entry), inference per call with the graph's batch on a
    context spread over `cores` NPU cores."""
    batch = entry.outputs[0].shape[0]
    if entry.kind.startswith("vae_"):
        per_tile = entry.extra["gflop"] / batch / (VAE_TFLOPS_PER_CORE * 1e3)
        inference = per_tile if batch == 1 else \
            -(-batch // VAE_CORES) * per_tile * VAE_CORES / VAE_CORES_SPEEDUP
        return {**phase_seconds("mlp"), "inference": inference}
    seconds = {**phase_seconds(entry.kind), "inference": inference_seconds(entry.kind, batch, cores)}
    if entry.extra.get(RUNS_QUANTIZED):
        seconds["inference"] /= QUANTIZED_FFN_SPEEDUP
        seconds["load"] *= QUANTIZED_FFN_LOAD_SHARE
    return seconds


def phase_seconds(kind: str) -> dict[str, float]:
    """Seconds of each phase of one model of `kind`: load, init, release, and inference per batch-1 call."""
    lifecycle = LIFECYCLE_SECONDS_PER_MODEL[kind]
    pass_total = sum(LIFECYCLE_PASS_SECONDS.values())
    seconds = {phase: lifecycle * s / pass_total for phase, s in LIFECYCLE_PASS_SECONDS.items()}
    seconds["inference"] = NPU_SECONDS_PER_FORWARD[kind] / BLOCKS
    return seconds


def inference_seconds(kind: str, batch: int, cores: int) -> float:
    """NPU seconds of one call of a `kind` graph with a batch of `batch` on one context spread over `cores` cores,
    alone on the NPU (Amdahl on the conv share for several cores)."""
    seconds = phase_seconds(kind)["inference"] * (BATCH2_WORK if batch == 2 else 1.0)
    if cores > 1:
        share = CONV_SHARE[kind]
        seconds *= (1 - share) + share / TENSOR_PARALLEL_SPEEDUP[cores]
    return seconds


def host_seconds_per_visit(batch: int = 2) -> float:
    """Host work between two branch visits of a forward over `batch` images (cond and uncond: 2): the step's
    host time spread evenly over its 84 visits, and halved for a chain that carries one of the two."""
    return HOST_SECONDS_PER_STEP / (BLOCKS * len(BRANCH_KINDS)) * batch / 2


def serial_seconds_per_step() -> float:
    """What the blog's serial loop costs per CFG step in this model: 2 forwards of NPU time, one lifecycle
    pass, host work. (122.0 s; the blog measured 120.40, its whole-step NPU time being 76.21 rather than
    2 x 38.90 = 77.80 from the separate one-forward measurement.)"""
    npu = 2 * sum(NPU_SECONDS_PER_FORWARD.values())
    lifecycle = BLOCKS * sum(LIFECYCLE_SECONDS_PER_MODEL.values())
    return npu + lifecycle + HOST_SECONDS_PER_STEP
