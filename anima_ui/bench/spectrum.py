"""`anima-ui bench spectrum`: how far each Spectrum forecaster's final sample lands from two references, on several
flows, with the same computed steps for all.

* **The full N-step run** from the same seed: the image the user would have got without Spectrum.
* **The exact ODE**: a fine Euler solve, Richardson-extrapolated (2·x_2M − x_M) and checked for convergence against
  the same extrapolation at twice the resolution. It tells whether a forecaster is accurate or merely wrong in a
  direction that happens to cancel the N-step run's own error.

The flows are analytic (Gaussian mixtures, so E[x0 | x_σ] for x_σ = (1 − σ)·x0 + σ·ε is exact and closed-form) plus
the tiny random-weight Anima model through the real denoiser. Every forecaster runs the same compute/forecast plan
(`plan`); "euler k" is plain Euler with k = the plan's computed steps, the baseline a forecast has to beat. Errors are
the relative L2 distance of the final latent; each cell is the median over seeds with its interquartile range.
Forecasters are compared per cell by their ratio to the best forecaster of that cell, summarised by the worst ratio
and the geometric mean of the ratios.
"""

from __future__ import annotations

import math
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from anima_ui.errors import UserError
from anima_ui.pipeline import Pipeline
from anima_ui.request import GenerationRequest
from anima_ui.sampling.euler import sample_euler
from anima_ui.sampling.noise import initial_noise
from anima_ui.sampling.schedule import simple_sigmas
from anima_ui.sampling.spectrum import DEFAULT_FORECASTER, FORECASTERS, SETTINGS, Spectrum, plan

SHIFT = 3.0  # Anima's schedule shift: σ = shift·t/(1 + (shift − 1)·t)
REFERENCES = ("full", "exact")

# Ever sparser schedules (model evaluations at 20 / 28 / 50 steps in the comments), for the error-vs-evaluations table.
SPARSER = {
    "on": SETTINGS["on"],  # 11 / 13 / 19
    "warmup 3, flex 1": {"window": 2, "flex": 1.0, "warmup": 3, "stop": 0.9},  # 9 / 11 / 15
    "window 3, warmup 3, flex 1, stop 0.95": {"window": 3, "flex": 1.0, "warmup": 3, "stop": 0.95},  # 7 / 9 / 13
    "fast": SETTINGS["fast"],  # 6 / 8 / 11
    "window 4, flex 3, warmup 2, stop 0.95": {"window": 4, "flex": 3.0, "warmup": 2, "stop": 0.95},  # 5 / 7 / 9
}


# -- the analytic flows -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GaussianMixture:
    """x0 ~ Σ_j π_j·N(μ_j, diag(s²)): components sharing one diagonal covariance.

    Per component, x_σ | j ~ N((1 − σ)μ_j, diag(v)) with v = (1 − σ)²s² + σ², and E[x0 | x_σ, j] = μ_j + g·(x_σ −
    (1 − σ)μ_j) with the gain g = (1 − σ)s²/v common to all components. So E[x0 | x_σ] = m̄ + g·(x_σ − (1 − σ)m̄),
    m̄ = Σ_j r_j μ_j with r the posterior component probabilities (the |x|² term cancels out of r).
    """

    means: np.ndarray  # [K, *shape]
    variance: np.ndarray  # [*shape]
    log_weights: np.ndarray  # [K], log π (normalised or not: only differences matter)

    @cached_property
    def _flat(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        means = self.means.reshape(len(self.means), -1).astype(np.float64)
        return means, means**2, self.variance.astype(np.float64).ravel()

    def posterior_mean(self, x: np.ndarray, sigma: float) -> np.ndarray:
        """In x's dtype (float32 for the N-step runs, float64 for the fine solve)."""
        means, squares, variance = self._flat
        alpha = 1.0 - sigma
        var_x = alpha * alpha * variance + sigma * sigma
        log_r = self.log_weights + alpha * (means @ (x.ravel() / var_x)) - 0.5 * alpha**2 * (squares @ (1.0 / var_x))
        r = np.exp(log_r - log_r.max())
        r /= r.sum()
        mean = r @ means
        gain = alpha * variance / var_x
        return (mean + gain * (x.ravel() - alpha * mean)).reshape(x.shape).astype(x.dtype)


@dataclass(frozen=True)
class GuidedProblem:
    """A prompt's distribution (cond) and the distribution over all prompts (uncond), combined by CFG."""

    cond: GaussianMixture
    uncond: GaussianMixture

    @property
    def shape(self) -> tuple[int, ...]:
        return self.cond.variance.shape

    @classmethod
    def image_like(cls, seed: int = 0, components: int = 8, side: int = 32) -> "GuidedProblem":
        """Latents [1, 16, side, side] that look like images: a shared smooth layout, a smooth per-component variation
        (settled early, like composition) and per-element variances from 1e-3 to 1 (detail that settles only near
        σ = 0). The uncond mixture has all 8 components and twice the variance (a prompt narrows the distribution);
        the cond one has 2 of them. CFG 4 moves the final sample by about 35 % of its norm relative to CFG 1."""
        rng = np.random.default_rng(seed)

        def smooth_field(rms: float) -> np.ndarray:
            coarse = rng.normal(size=(1, 16, side // 4, side // 4))
            return rms * np.repeat(np.repeat(coarse, 4, axis=2), 4, axis=3)

        variance = np.exp(rng.uniform(np.log(1e-3), 0.0, size=(1, 16, side, side))).astype(np.float32)
        layout = smooth_field(0.6)
        means = np.stack([layout + smooth_field(0.1) for _ in range(components)]).astype(np.float32)
        return cls(cond=GaussianMixture(means[:2], variance, np.zeros(2)),
                   uncond=GaussianMixture(means, 2 * variance, np.zeros(components)))

    @classmethod
    def hierarchical(cls, dim: int, seed: int = 0, groups: int = 4, per_group: int = 4) -> "GuidedProblem":
        """Vectors [1, dim] from 4 groups of 4 components (group centres, then offsets within a group, then
        per-element variances from 1e-3 to 0.1). cond and uncond share every component and differ only in the
        weights: uncond weighs them equally, cond puts most weight on one group. In few dimensions the component is
        decided late (at smaller σ), so the x0 path turns in the middle of sampling where Spectrum forecasts."""
        rng = np.random.default_rng(seed)
        centres = rng.normal(scale=0.8, size=(groups, 1, dim))
        means = np.concatenate([c + rng.normal(scale=0.4, size=(per_group, 1, dim)) for c in centres]).astype(np.float32)
        variance = np.exp(rng.uniform(np.log(1e-3), np.log(0.1), size=(1, dim))).astype(np.float32)
        favoured = np.repeat(np.arange(groups) == 0, per_group)
        cond_logits = rng.normal(scale=1.0, size=groups * per_group) + 3.0 * favoured
        k = groups * per_group
        return cls(cond=GaussianMixture(means, variance, cond_logits), uncond=GaussianMixture(means, variance, np.zeros(k)))

    def denoiser(self, cfg: float):
        """predict_x0(x, σ), CFG-combined as the pipeline does (x0_u + cfg·(x0_c − x0_u)), in x's dtype."""

        def predict_x0(x, sigma):
            x0_cond = self.cond.posterior_mean(x, float(sigma))
            if cfg == 1.0:
                return x0_cond
            x0_uncond = self.uncond.posterior_mean(x, float(sigma))
            return x0_uncond + x.dtype.type(cfg) * (x0_cond - x0_uncond)

        return predict_x0

    def noise(self, seed: int) -> np.ndarray:
        return np.random.default_rng(seed).standard_normal(self.shape, dtype=np.float32)


ANALYTIC = {  # name -> GuidedProblem factory(problem seed)
    "image-like": lambda seed: GuidedProblem.image_like(seed),
    "mixture D=1024": lambda seed: GuidedProblem.hierarchical(1024, seed),
    "mixture D=64": lambda seed: GuidedProblem.hierarchical(64, seed),
}


@dataclass(frozen=True)
class Flow:
    """One flow to sample: predict_x0(x, σ) and the starting noise of a seed."""

    name: str
    predict_x0: object
    noise: object


# -- the exact reference ------------------------------------------------------------------------------------------
def fine_sigmas(steps: int) -> np.ndarray:
    """A smooth float64 grid for the fine solve: t = u² with u uniform from 1 to 0 (dense where detail settles),
    then Anima's shift. Euler's error on it is C·h + O(h²), which Richardson extrapolation needs."""
    u = np.linspace(1.0, 0.0, steps + 1)
    t = u * u
    return SHIFT * t / (1.0 + (SHIFT - 1.0) * t)


def euler_fine(predict_x0, noise: np.ndarray, steps: int) -> np.ndarray:
    x = noise.astype(np.float64)
    sigmas = fine_sigmas(steps)
    for sigma, sigma_next in zip(sigmas[:-1], sigmas[1:]):
        x = x + (x - predict_x0(x, sigma)) / sigma * (sigma_next - sigma)
    return x


def exact_solution(predict_x0, noise: np.ndarray, fine: int) -> tuple[np.ndarray, float]:
    """(the ODE solution extrapolated from 2·`fine` and 4·`fine` Euler steps, its relative change from the same
    extrapolation at half the resolution: the convergence check). The remaining error is second order, so about a
    third of the check."""
    x1, x2, x4 = (euler_fine(predict_x0, noise, fine * k) for k in (1, 2, 4))
    coarse, finer = 2 * x2 - x1, 2 * x4 - x2
    return finer, float(np.linalg.norm(finer - coarse) / np.linalg.norm(finer))


# -- running the forecasters --------------------------------------------------------------------------------------
def relative_error(result: np.ndarray, reference: np.ndarray) -> float:
    return float(np.linalg.norm(result.astype(np.float64) - reference) / np.linalg.norm(reference))


def forecaster_errors(flow: Flow, seeds, steps_list, schedules: dict, forecasters, fine: int | None) -> dict:
    """{(steps, schedule name, reference): {method: [error per seed]}}, plus {"check": [convergence per seed]}.

    Methods are the forecasters, "euler k" and, against the exact ODE, "full run" (the N-step run's own error).
    The exact reference is skipped when `fine` is None."""
    results: dict = {"check": []}
    for seed in seeds:
        noise = flow.noise(seed)
        exact = None
        if fine:
            exact, check = exact_solution(flow.predict_x0, noise, fine)
            results["check"].append(check)
        for steps in steps_list:
            sigmas = simple_sigmas(steps)
            refs = {"full": sample_euler(flow.predict_x0, noise, sigmas).astype(np.float64)}
            if exact is not None:
                refs["exact"] = exact
            for schedule_name, schedule in schedules.items():
                evals = len(plan(steps, **schedule)[0])
                finals = {name: sample_euler(flow.predict_x0, noise, sigmas, Spectrum(steps, name, **schedule))
                          for name in forecasters}
                finals[f"euler {evals}"] = sample_euler(flow.predict_x0, noise, simple_sigmas(evals))
                finals["full run"] = refs["full"]
                for ref_name, ref in refs.items():
                    cell = results.setdefault((steps, schedule_name, ref_name), {})
                    for method, final in finals.items():
                        if not (method == "full run" and ref_name == "full"):
                            cell.setdefault(method, []).append(relative_error(final, ref))
    return results


def analytic_flow(name: str, problem_seed: int, cfg: float) -> Flow:
    problem = ANALYTIC[name](problem_seed)
    return Flow(name, problem.denoiser(cfg), problem.noise)


def tiny_flow(models_dir: Path, cfg: float) -> Flow:
    pipeline = Pipeline.load(models_dir, backend="torch")
    request = GenerationRequest("a lighthouse on a cliff at dusk", "", cfg=cfg, width=64, height=64)
    predict = pipeline.x0_predictor(request)

    def noise(seed):
        return initial_noise(seed, request.height, request.width)

    def predict_x0(x, sigma):  # the model runs in float32; the fine solve carries its state in float64
        return predict(x.astype(np.float32), np.float32(sigma)).astype(x.dtype)

    return Flow("tiny model", predict_x0, noise)


# -- summaries ----------------------------------------------------------------------------------------------------
def median(values) -> float:
    return float(np.median(values))


def ratios_to_best(tables: dict, forecasters, schedule_name: str, reference: str) -> dict:
    """{forecaster: [median / best median, one per (flow, steps) cell]} for one schedule and reference."""
    ratios = {name: [] for name in forecasters}
    for (flow, steps, sched, ref), cell in tables.items():
        if sched != schedule_name or ref != reference:
            continue
        best = min(median(cell[name]) for name in forecasters)
        for name in forecasters:
            ratios[name].append(median(cell[name]) / best)
    return ratios


def summarise(tables: dict, forecasters, schedule_name: str = "on") -> dict:
    """{reference: {forecaster: (worst ratio to the best, geometric mean of the ratios)}} over every flow and step
    count of one schedule."""
    out = {}
    for reference in REFERENCES:
        ratios = ratios_to_best(tables, forecasters, schedule_name, reference)
        if all(ratios.values()):
            out[reference] = {name: (max(r), math.exp(np.mean(np.log(r)))) for name, r in ratios.items()}
    return out


def best_worst_case(summary: dict) -> str:
    """The forecaster with the smallest worst-case ratio against the full run (ties: smaller geometric mean)."""
    full = summary["full"]
    return min(full, key=lambda name: (round(full[name][0], 6), full[name][1]))


def cell_text(values) -> str:
    q1, mid, q3 = np.percentile(values, [25, 50, 75])
    return f"{mid:.4f} [{q1:.4f}, {q3:.4f}]"


# -- the command --------------------------------------------------------------------------------------------------
def add_arguments(parser):
    parser.add_argument("--seeds", type=int, default=16, help="seeds per analytic flow (default 16)")
    parser.add_argument("--steps", type=int, nargs="+", default=[20, 28, 50], help="step counts (default 20 28 50)")
    parser.add_argument("--flows", nargs="+", default=list(ANALYTIC), choices=list(ANALYTIC),
                        help="analytic flows (default: all)")
    parser.add_argument("--tiny-seeds", type=int, default=4, help="seeds on the tiny model, 0 to skip (default 4)")
    parser.add_argument("--fine", type=int, default=128,
                        help="Euler steps of the coarsest fine solve for the exact reference, 0 to skip (default 128)")
    parser.add_argument("--tiny-fine", type=int, default=32, help="the same for the tiny model (default 32)")
    parser.add_argument("--sparse-seeds", type=int, default=8,
                        help="seeds per analytic flow for the sparser-schedule table, 0 to skip (default 8)")
    parser.add_argument("--cfg", type=float, default=4.0, help="CFG scale (default 4)")
    parser.add_argument("--problem-seed", type=int, default=0, help="seed of the analytic mixtures (default 0)")
    parser.add_argument("--models", help="model folder for the tiny-model flow (default: a fresh tiny random model)")


def run(args) -> int:
    if args.seeds < 1 or min(args.tiny_seeds, args.fine, args.tiny_fine, args.sparse_seeds) < 0:
        raise UserError("--seeds must be at least 1; --tiny-seeds, --fine, --tiny-fine and --sparse-seeds 0 or more")
    started = time.perf_counter()
    forecasters = list(FORECASTERS)
    tables, checks = {}, {}
    with tempfile.TemporaryDirectory() as scratch:
        flows = [(analytic_flow(name, args.problem_seed, args.cfg), range(args.seeds), args.fine) for name in args.flows]
        if args.tiny_seeds:
            models = Path(args.models) if args.models else _tiny_model(Path(scratch) / "tiny")
            flows.append((tiny_flow(models, args.cfg), range(args.tiny_seeds), args.tiny_fine))
        for flow, seeds, fine in flows:
            print(f"[{time.perf_counter() - started:.0f} s] {flow.name}: {len(seeds)} seeds", file=sys.stderr, flush=True)
            result = forecaster_errors(flow, seeds, args.steps, SETTINGS, forecasters, fine or None)
            checks[flow.name] = (fine, result.pop("check"))
            tables.update({(flow.name, *key): cell for key, cell in result.items()})
        print_convergence(checks, tables, forecasters)
        for setting in SETTINGS:
            print_cells(tables, forecasters, setting, args)
            print_summary(summarise(tables, forecasters, setting), setting)
        if args.sparse_seeds:
            sparse = {}
            for name in args.flows:
                print(f"[{time.perf_counter() - started:.0f} s] sparser schedules: {name}", file=sys.stderr, flush=True)
                flow = analytic_flow(name, args.problem_seed, args.cfg)
                result = forecaster_errors(flow, range(args.sparse_seeds), args.steps, SPARSER, forecasters, None)
                result.pop("check")
                sparse.update({(flow.name, *key): cell for key, cell in result.items()})
            print_sparse(sparse, forecasters, args)
    print(f"({time.perf_counter() - started:.0f} s)")
    return 0


def print_convergence(checks: dict, tables: dict, forecasters) -> None:
    print("Exact reference: Richardson 2·x_4M − x_2M from Euler solves on a smooth grid; check = its relative change "
          "from 2·x_2M − x_M (largest over seeds), against the smallest median forecaster error vs it on that flow.")
    print("| flow | M | check | smallest error vs exact | check / smallest |")
    print("|---|---|---|---|---|")
    for flow, (fine, values) in checks.items():
        if not values:
            print(f"| {flow} | – | not run | | |")
            continue
        smallest = min(median(cell[name]) for (f, _, _, ref), cell in tables.items()
                       if f == flow and ref == "exact" for name in forecasters)
        print(f"| {flow} | {fine} | {max(values):.1e} | {smallest:.1e} | {max(values) / smallest:.3f} |")
    print()


def print_cells(tables: dict, forecasters, setting: str, args) -> None:
    print(f"Setting \"{setting}\" {SETTINGS[setting]}: relative L2 error of the final latent, median [IQR] over "
          f"seeds ({args.seeds} per analytic flow, {args.tiny_seeds} on the tiny model), CFG {args.cfg}.")
    for reference in REFERENCES:
        cells = {key: cell for key, cell in tables.items() if key[2] == setting and key[3] == reference}
        if not cells:
            continue
        name = "the full N-step run" if reference == "full" else "the exact ODE"
        print(f"\nAgainst {name}:")
        full_run = " | full N-step run" if reference == "exact" else ""
        print("| flow | steps | evals | " + " | ".join(forecasters) + f" | euler, same evals{full_run} |")
        print("|---|---|---|" + "---|" * (len(forecasters) + 1 + bool(full_run)))
        for (flow, steps, _, _), cell in cells.items():
            baseline = next(k for k in cell if k.startswith("euler "))
            best = min(median(cell[f]) for f in forecasters)
            texts = [(f"**{cell_text(cell[f])}**" if median(cell[f]) == best else cell_text(cell[f])) for f in forecasters]
            texts += [cell_text(cell[k]) for k in (baseline, "full run") if k in cell]
            print(f"| {flow} | {steps} | {baseline.split()[1]} | " + " | ".join(texts) + " |")
    print()


def print_summary(summary: dict, setting: str) -> None:
    print(f"Summary of setting \"{setting}\" over every flow and step count above: each cell's median divided by the "
          "best forecaster's median in that cell; worst case and geometric mean of that ratio.")
    print("| forecaster | " + " | ".join(f"vs {r}: worst | vs {r}: geo. mean" for r in summary) + " |")
    print("|---|" + "---|---|" * len(summary))
    for name in next(iter(summary.values())):
        values = " | ".join(f"{summary[r][name][0]:.2f} | {summary[r][name][1]:.2f}" for r in summary)
        print(f"| {name}{' (default)' if name == DEFAULT_FORECASTER else ''} | {values} |")
    print(f"\nBest worst case against the full run ({setting}): {best_worst_case(summary)} "
          f"(default: {DEFAULT_FORECASTER})\n")


def print_sparse(sparse: dict, forecasters, args) -> None:
    print(f"Sparser schedules ({args.sparse_seeds} seeds per analytic flow): model evaluations, and the geometric mean "
          "over the analytic flows of the median error vs the full run.")
    print("| schedule | steps | evals | " + " | ".join(forecasters) + " | euler, same evals |")
    print("|---|---|---|" + "---|" * (len(forecasters) + 1))
    for schedule_name, schedule in SPARSER.items():
        for steps in args.steps:
            cells = [cell for (_, s, sched, ref), cell in sparse.items()
                     if s == steps and sched == schedule_name and ref == "full"]
            baseline = next(k for k in cells[0] if k.startswith("euler "))
            geo = {m: math.exp(np.mean([math.log(median(c[m])) for c in cells])) for m in [*forecasters, baseline]}
            best = min(geo[f] for f in forecasters)
            texts = [(f"**{geo[f]:.4f}**" if geo[f] == best else f"{geo[f]:.4f}") for f in forecasters]
            print(f"| {schedule_name} | {steps} | {len(plan(steps, **schedule)[0])} | " + " | ".join(texts)
                  + f" | {geo[baseline]:.4f} |")
    print()


def _tiny_model(out: Path) -> Path:
    from anima_ui.fixtures.model import write_random_model  # imports torch; only needed without --models

    return write_random_model(out, "tiny", seed=0)
