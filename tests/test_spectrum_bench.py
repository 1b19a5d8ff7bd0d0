"""The analytic problem behind `anima-ui bench spectrum`: its closed-form denoiser against a direct evaluation of the
posterior, and one quick run of the harness."""

import argparse

import numpy as np
import pytest

from anima_ui.bench import spectrum as bench
from anima_ui.sampling.spectrum import plan


def direct_posterior_mean(mixture, x, sigma):
    """E[x0 | x_σ] from the full Gaussian densities of each component (float64, nothing cancelled)."""
    alpha = 1.0 - sigma
    var_x = alpha**2 * mixture.variance.astype(np.float64) + sigma**2
    log_density = []
    for mean in mixture.means.astype(np.float64):
        residual = x - alpha * mean
        log_density.append(-0.5 * np.sum(residual**2 / var_x + np.log(2 * np.pi * var_x)))
    log_density = np.array(log_density)
    r = np.exp(log_density - log_density.max())
    r /= r.sum()
    per_component = [m + alpha * mixture.variance / var_x * (x - alpha * m) for m in mixture.means.astype(np.float64)]
    return np.tensordot(r, np.stack(per_component), axes=1)


@pytest.mark.parametrize("sigma", [0.97, 0.8, 0.5, 0.1])
def test_closed_form_posterior_mean_equals_direct_evaluation(sigma):
    problem = bench.GuidedProblem.make(seed=3, side=8)
    rng = np.random.default_rng(0)
    for mixture in (problem.cond, problem.uncond):
        x0 = mixture.means[1] + np.sqrt(mixture.variance) * rng.normal(size=mixture.variance.shape)
        x = ((1 - sigma) * x0 + sigma * rng.normal(size=x0.shape)).astype(np.float32)
        np.testing.assert_allclose(mixture.posterior_mean(x, sigma), direct_posterior_mean(mixture, x, sigma), rtol=1e-4, atol=1e-5)


def test_posterior_mean_limits():
    mixture = bench.GuidedProblem.make(side=8).uncond
    x = np.random.default_rng(1).normal(size=mixture.variance.shape).astype(np.float32)
    np.testing.assert_allclose(mixture.posterior_mean(x, 1.0), mixture.means.mean(axis=0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(mixture.posterior_mean(x, 1e-6), x, atol=1e-3)


def test_cfg_moves_the_analytic_sample():
    from anima_ui.sampling.euler import sample_euler
    from anima_ui.sampling.noise import initial_noise
    from anima_ui.sampling.schedule import simple_sigmas

    problem = bench.GuidedProblem.make()
    noise, sigmas = initial_noise(0, 256, 256), simple_sigmas(8)
    guided, plain = (sample_euler(problem.denoiser(cfg), noise, sigmas) for cfg in (4.0, 1.0))
    assert np.linalg.norm(guided - plain) / np.linalg.norm(plain) > 0.2


def test_harness_runs_and_prints_the_table(capsys):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert bench.run(parser.parse_args(["--seeds", "2", "--steps", "8", "--tiny-seeds", "0"])) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split("|")[1:-1] for line in lines if line.startswith("| 8 ")]
    evals = len(plan(8)[0])
    assert [r[1].strip() for r in rows] == [*bench.METHODS, f"euler {evals} steps"]
    assert all(int(r[2]) == evals for r in rows)
    medians = [float(r[3].split()[0]) for r in rows]
    assert all(0 < m < 1 for m in medians)
