"""`anima-ui bench spectrum`: how far Spectrum's final sample lands from the full computation, against the baseline
it has to beat — plain Euler with fewer steps and the same number of model evaluations — for sd.cpp's forecast and
the corrected variants studied here.

Part 1 is an analytic flow-matching problem with an exact x0 denoiser: the data are a Gaussian mixture in the latent
shape, so E[x0 | x_σ] for x_σ = (1 − σ)·x0 + σ·ε is closed-form. A conditional mixture (2 of the components) and an
unconditional one (all of them) make CFG act as it does in the model. Part 2 runs the real pipeline on a tiny
random-weight Anima model (its outputs mean nothing as images; it checks the same comparison through the real
sampler, CFG batch and Spectrum wiring).

Errors are measured against the full N-step run from the same seed: relative L2 of the final latent, and PSNR
between the two latents' preview images (the app's 16×3 latent→RGB projection, `latent_to_rgb`).
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from anima_ui.errors import UserError
from anima_ui.metrics import psnr
from anima_ui.sampling.cfg import cfg_combine
from anima_ui.sampling.euler import sample_euler
from anima_ui.sampling.noise import initial_noise
from anima_ui.sampling.schedule import simple_sigmas
from anima_ui.sampling.spectrum import Spectrum, plan
from anima_ui.vae.preview import latent_to_rgb

IMAGE_SIDE = 256  # → a [1, 16, 32, 32] latent


# -- the analytic problem ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GaussianMixture:
    """x0 ~ (1/K)·Σ_j N(μ_j, diag(s²)): equally weighted components sharing one diagonal covariance.

    Per component, x_σ | j ~ N((1 − σ)μ_j, diag(v)) with v = (1 − σ)²s² + σ², and E[x0 | x_σ, j] = μ_j + g·(x_σ −
    (1 − σ)μ_j) with the gain g = (1 − σ)s²/v common to all components. So E[x0 | x_σ] = m̄ + g·(x_σ − (1 − σ)m̄),
    m̄ = Σ_j r_j μ_j with r the posterior component probabilities (the |x|² term cancels out of r).
    """

    means: np.ndarray  # [K, 1, 16, h, w]
    variance: np.ndarray  # [1, 16, h, w]

    def posterior_mean(self, x: np.ndarray, sigma: float) -> np.ndarray:
        means = self.means.reshape(len(self.means), -1).astype(np.float64)
        alpha = 1.0 - sigma
        var_x = (alpha * alpha * self.variance.astype(np.float64) + sigma * sigma).ravel()
        log_r = alpha * (means @ (x.ravel() / var_x)) - 0.5 * alpha**2 * ((means**2) @ (1.0 / var_x))
        r = np.exp(log_r - log_r.max())
        r /= r.sum()
        mean = (r @ means).reshape(x.shape)
        gain = alpha * self.variance / var_x.reshape(x.shape)
        return (mean + gain * (x - alpha * mean)).astype(np.float32)


@dataclass(frozen=True)
class GuidedProblem:
    """A prompt's distribution (cond) and the distribution over all prompts (uncond), for CFG.

    Latents look image-like: a shared smooth layout, a smooth per-component variation (settled early in sampling,
    like composition) and per-element variances from 1e-3 to 1 (detail that settles only near σ = 0). The uncond
    mixture has all 8 components and twice the variance (a prompt narrows the distribution); the cond one has 2 of
    them. With these, CFG 4 moves the final sample by about 35 % of its norm relative to CFG 1.
    """

    cond: GaussianMixture
    uncond: GaussianMixture

    @classmethod
    def make(cls, seed: int = 0, components: int = 8, side: int = IMAGE_SIDE // 8) -> "GuidedProblem":
        rng = np.random.default_rng(seed)

        def smooth_field(rms: float) -> np.ndarray:
            coarse = rng.normal(size=(1, 16, side // 4, side // 4))
            return rms * np.repeat(np.repeat(coarse, 4, axis=2), 4, axis=3)

        variance = np.exp(rng.uniform(np.log(1e-3), 0.0, size=(1, 16, side, side))).astype(np.float32)
        layout = smooth_field(0.6)
        means = np.stack([layout + smooth_field(0.1) for _ in range(components)]).astype(np.float32)
        return cls(cond=GaussianMixture(means[:2], variance), uncond=GaussianMixture(means, 2 * variance))

    def denoiser(self, cfg: float):
        """predict_x0(x, σ), CFG-combined; at CFG 1 only the cond posterior is evaluated."""

        def predict_x0(x, sigma):
            x0_cond = self.cond.posterior_mean(x, float(sigma))
            if cfg == 1.0:
                return x0_cond
            return cfg_combine(x0_cond, self.uncond.posterior_mean(x, float(sigma)), cfg)

        return predict_x0


# -- the variants studied (sd.cpp's and the shipped "velocity" live in sampling/spectrum.py) -------------------------
class UnitSumSpectrum(Spectrum):
    """Chebyshev weights rescaled to sum to 1, so a constant history is forecast unchanged (no shrinkage)."""

    def weights(self) -> np.ndarray:
        weights = super().weights()
        return (weights / weights.sum()).astype(np.float32)


class NormPreservingSpectrum(Spectrum):
    """sd.cpp's forecast rescaled to the norm that the unit-sum weights forecast from the history's norms."""

    def predict(self, x=None, sigma=None) -> np.ndarray:
        weights = super().weights().astype(np.float64)
        norms = np.array([np.linalg.norm(h) for h in self.history])
        target = (1 - self.w) * (1.5 * norms[-1] - 0.5 * norms[-2]) + self.w * (weights @ norms) / weights.sum()
        forecast = super().predict(x, sigma)
        return (forecast * np.float32(target / np.linalg.norm(forecast))).astype(np.float32)


METHODS = {
    "spectrum sdcpp": lambda steps: Spectrum(steps),
    "spectrum velocity": lambda steps: Spectrum(steps, variant="velocity"),
    "spectrum unit-sum": UnitSumSpectrum,
    "spectrum norm": NormPreservingSpectrum,
}


# -- measuring ------------------------------------------------------------------------------------------------------
def errors(result: np.ndarray, reference: np.ndarray) -> tuple[float, float]:
    """(relative L2 of the latent, preview PSNR in dB)."""
    rel = float(np.linalg.norm(result - reference) / np.linalg.norm(reference))
    return rel, psnr(latent_to_rgb(result), latent_to_rgb(reference), peak=255.0)


def analytic_rows(steps_list, seeds: int, cfg: float, problem_seed: int) -> list[dict]:
    predict_x0 = GuidedProblem.make(problem_seed).denoiser(cfg)
    rows = []
    for steps in steps_list:
        evals = len(plan(steps)[0])
        sigmas, fewer_sigmas = simple_sigmas(steps), simple_sigmas(evals)
        measured = {name: [] for name in [*METHODS, f"euler {evals} steps"]}
        for seed in range(seeds):
            noise = initial_noise(seed, IMAGE_SIDE, IMAGE_SIDE)
            full = sample_euler(predict_x0, noise, sigmas)
            for name, make in METHODS.items():
                measured[name].append(errors(sample_euler(predict_x0, noise, sigmas, make(steps)), full))
            measured[f"euler {evals} steps"].append(errors(sample_euler(predict_x0, noise, fewer_sigmas), full))
        rows += [{"steps": steps, "method": name, "evals": evals, "errors": values} for name, values in measured.items()]
    return rows


def tiny_model_rows(models_dir: Path, steps: int, seeds: int, cfg: float) -> list[dict]:
    from anima_ui.pipeline import Pipeline
    from anima_ui.request import GenerationRequest

    pipeline = Pipeline.load(models_dir, backend="torch")
    evals = len(plan(steps)[0])

    def latent(seed, n, spectrum_params=None):
        request = GenerationRequest(
            "a lighthouse on a cliff at dusk", "", seed=seed, steps=n, cfg=cfg, width=64, height=64,
            spectrum=spectrum_params is not None, spectrum_params=spectrum_params or {}, decode=False,
        )
        return list(pipeline.generate(request))[-1].latent

    measured = {"spectrum sdcpp": [], "spectrum velocity": [], f"euler {evals} steps": []}
    for seed in range(seeds):
        full = latent(seed, steps)
        measured["spectrum sdcpp"].append(errors(latent(seed, steps, {}), full))
        measured["spectrum velocity"].append(errors(latent(seed, steps, {"variant": "velocity"}), full))
        measured[f"euler {evals} steps"].append(errors(latent(seed, evals), full))
    return [{"steps": steps, "method": name, "evals": evals, "errors": values} for name, values in measured.items()]


def summary(values) -> str:
    q1, median, q3 = np.percentile(values, [25, 50, 75])
    return f"{median:7.4f} [{q1:.4f}, {q3:.4f}]" if median < 1 else f"{median:6.2f} [{q1:.2f}, {q3:.2f}]"


def print_table(title: str, rows: list[dict]) -> None:
    print(title)
    print("| steps | method | model evals | rel. L2 error, median [IQR] | preview PSNR dB, median [IQR] |")
    print("|---|---|---|---|---|")
    for row in rows:
        rel = [e[0] for e in row["errors"]]
        db = [e[1] for e in row["errors"]]
        print(f"| {row['steps']} | {row['method']} | {row['evals']} | {summary(rel)} | {summary(db)} |")
    print()


def add_arguments(parser):
    parser.add_argument("--seeds", type=int, default=32, help="seeds for the analytic problem (default 32)")
    parser.add_argument("--steps", type=int, nargs="+", default=[20, 28, 50], help="step counts (default 20 28 50)")
    parser.add_argument("--tiny-seeds", type=int, default=8, help="seeds on the tiny model, 0 to skip (default 8)")
    parser.add_argument("--tiny-steps", type=int, default=20, help="steps on the tiny model (default 20)")
    parser.add_argument("--cfg", type=float, default=4.0, help="CFG scale (default 4)")
    parser.add_argument("--problem-seed", type=int, default=0, help="seed of the analytic mixture (default 0)")
    parser.add_argument("--models", help="model folder for part 2 (default: a fresh tiny random model)")


def run(args) -> int:
    if args.seeds < 1 or args.tiny_seeds < 0:
        raise UserError("--seeds must be at least 1 and --tiny-seeds 0 or more")
    started = time.perf_counter()
    print_table(
        f"Analytic Gaussian-mixture flow (mixture seed {args.problem_seed}), latent [1,16,32,32], CFG {args.cfg}, "
        f"{args.seeds} seeds; error of the final sample vs the full N-step Euler run",
        analytic_rows(args.steps, args.seeds, args.cfg, args.problem_seed),
    )
    if args.tiny_seeds > 0:
        with tempfile.TemporaryDirectory() as scratch:
            models = Path(args.models) if args.models else _tiny_model(Path(scratch) / "tiny")
            model = f"Anima model {args.models}" if args.models else "Tiny random-weight Anima model"
            print_table(
                f"{model} through Pipeline.generate (torch), 64x64, CFG {args.cfg}, "
                f"{args.tiny_seeds} seeds; error vs the full {args.tiny_steps}-step run",
                tiny_model_rows(models, args.tiny_steps, args.tiny_seeds, args.cfg),
            )
    print(f"({time.perf_counter() - started:.0f} s)")
    return 0


def _tiny_model(out: Path) -> Path:
    from anima_ui.fixtures.model import write_random_model

    return write_random_model(out, "tiny", seed=0)
