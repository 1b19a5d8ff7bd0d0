"""The end-to-end gate: whole generations with emulated FFNs, compared with the FP16 pipeline.

Three pipelines share the attention branches (`run_branch` as given: torch or fp32 onnx graphs) and differ in
the FFN, which is computed on the host from the block's weights:
- fp32: the float FFN (the reference the FP16 pipeline itself is judged against);
- fp16: the FP16 FFN graph's arithmetic (the pipeline the board runs today);
- quant: the W8A8 + low-rank emulator for the blocks that passed their gate, FP16 for the others.
Each (prompt, seed) samples all three; the quant run is compared with the fp16 run (final-latent cosine,
decoded PSNR and SSIM), and two scales put those numbers in context: fp16 against fp32 (FP16's own precision
noise, which the board already accepts) and fp16 seed A against fp16 seed B (two different images)."""

from dataclasses import dataclass, field
from functools import partial

import numpy as np

from anima_ui.model.forward import prepare_kv, prepare_rope
from anima_ui.quant.ffn import QuantizedFfn, emulate
from anima_ui.quant.gate import cosine
from anima_ui.quant.numerics import ffn_fp16, ffn_fp32
from anima_ui.quant.sampling import cfg_sample
from anima_ui.sampling.noise import initial_noise
from anima_ui.sampling.schedule import simple_sigmas
from anima_ui.metrics import psnr, ssim

PROMPTS = (
    "1girl, solo, long silver hair, red eyes, school uniform, cherry blossoms, smiling, masterpiece, best quality",
    "a lighthouse on a rocky coast at dusk, crashing waves, dramatic clouds, painterly",
    "futuristic city street at night, neon signs, reflections on wet asphalt, crowd, cyberpunk",
    "a small red fox sleeping in the snow under pine trees, watercolor",
)
SEEDS = (20260812, 1)  # the blog's seed and another
# quant vs fp16 may differ by at most this share of how much two seeds' FP16 images differ (the smallest
# spread over the prompts), in each measure's error: 1 − cosine, MSE (so PSNR ≥ the seeds' PSNR + 20 dB),
# 1 − SSIM. Floors below: the blog accepted 31.4 dB / 0.961 for its VAE swap.
SEED_SPREAD_SHARE = 0.01
MIN_PSNR_DB = 30.0
MIN_SSIM = 0.95


def ffn_branch(run_branch, ffn_weights: dict[int, tuple[np.ndarray, np.ndarray]], mode: str, emulators: dict | None = None):
    """run_branch with the FFN replaced: mode "fp32" | "fp16" | "quant" (emulators[block](h) where given, else FP16)."""
    emulators = emulators or {}

    def run(block: int, kind: str, inputs: dict) -> np.ndarray:
        if kind != "mlp":
            return run_branch(block, kind, inputs)
        h = inputs["h"]
        if mode == "quant" and block in emulators:
            return emulators[block](h)
        w1, w2 = ffn_weights[block]
        return ffn_fp32(h, w1, w2) if mode == "fp32" else ffn_fp16(h, w1, w2)

    return run


@dataclass
class EndToEnd:
    rows: list[dict] = field(default_factory=list)  # per (prompt, seed): the measures below
    seed_spread: list[dict] = field(default_factory=list)  # per prompt: fp16 seed A vs seed B

    def thresholds(self) -> dict:
        spread = self.seed_spread
        return {
            "min_latent_cosine": 1.0 - SEED_SPREAD_SHARE * min(1.0 - r["latent_cosine"] for r in spread),
            "min_psnr_db": max(MIN_PSNR_DB, max(r["psnr_db"] for r in spread) - 10.0 * np.log10(SEED_SPREAD_SHARE)),
            "min_ssim": max(MIN_SSIM, 1.0 - SEED_SPREAD_SHARE * min(1.0 - r["ssim"] for r in spread)),
        }

    def failures(self) -> list[str]:
        t = self.thresholds()
        problems = []
        for r in self.rows:
            m = r["quant_vs_fp16"]
            for key, limit in (("latent_cosine", t["min_latent_cosine"]), ("psnr_db", t["min_psnr_db"]), ("ssim", t["min_ssim"])):
                if not m[key] >= limit:
                    problems.append(f"{r['prompt'][:30]!r} seed {r['seed']}: {key} {m[key]:.5g} < {limit:.5g}")
        return problems

    @property
    def passed(self) -> bool:
        return bool(self.rows) and not self.failures()


def compare(latent_a, image_a, latent_b, image_b) -> dict:
    """Two runs' final latents and decoded uint8 images."""
    return {"latent_cosine": cosine(latent_a, latent_b), "psnr_db": psnr(image_a, image_b, peak=255.0), "ssim": ssim(image_a, image_b)}


def emulators_of(quantized: dict[int, QuantizedFfn]) -> tuple[dict, dict]:
    """(block -> emulated graph, block -> λ1 for dit_forward's AdaLN fold)."""
    return {b: partial(emulate, q) for b, q in quantized.items()}, {b: q.smooth_in for b, q in quantized.items()}


def end_to_end(weights: dict, config, run_branch, encode, decode, ffn_weights: dict, emulators: tuple[dict, dict],
               prompts=PROMPTS, seeds=SEEDS, steps: int = 20, cfg: float = 4.0, width: int = 512, height: int = 512,
               negative: str = "", progress=None) -> EndToEnd:
    """decode(latent) -> uint8 image [H, W, 3]; ffn_weights: block -> (w1 [D, F], w2 [F, D]); emulators: the
    emulated quantized graphs and their input scales (`emulators_of`), which the host folds into AdaLN as on the board."""
    graphs, input_scales = emulators
    rope = prepare_rope(config, height // 8, width // 8)
    sigmas = simple_sigmas(steps)
    uncond = encode(negative)
    result = EndToEnd()
    for prompt in prompts:
        kv = prepare_kv(weights, np.concatenate([encode(prompt), uncond], axis=0))
        fp16_runs = {}
        for seed in seeds:
            noise = initial_noise(seed, height, width)
            runs = {}
            for mode in ("fp32", "fp16", "quant"):
                scales = input_scales if mode == "quant" else None
                latent = cfg_sample(weights, ffn_branch(run_branch, ffn_weights, mode, graphs), kv, rope, noise, sigmas, cfg,
                                    ffn_input_scales=scales)
                runs[mode] = (latent, decode(latent))
            fp16_runs[seed] = runs["fp16"]
            result.rows.append({"prompt": prompt, "seed": seed, "quant_vs_fp16": compare(*runs["quant"], *runs["fp16"]),
                                "fp16_vs_fp32": compare(*runs["fp16"], *runs["fp32"])})
            if progress:
                m = result.rows[-1]["quant_vs_fp16"]
                progress(f"{prompt[:40]!r} seed {seed}: quant vs FP16 latent cosine {m['latent_cosine']:.6f}, "
                         f"PSNR {m['psnr_db']:.2f} dB, SSIM {m['ssim']:.5f}")
        first, second = seeds[0], seeds[1]
        result.seed_spread.append({"prompt": prompt, **compare(*fp16_runs[first], *fp16_runs[second])})
    return result
