"""Schedule, noise, CFG and the Euler sampler against diffusers and torch as oracles."""

import contextlib
import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from anima_ui.errors import UserError
from anima_ui.limits import MAX_SEED, MAX_STEPS
from anima_ui.sampling.cfg import cfg_combine
from anima_ui.sampling.euler import StepInfo, euler_steps, sample_euler
from anima_ui.sampling.noise import initial_noise, torch_randn
from anima_ui.sampling.schedule import shifted_sigma_table, simple_sigmas
from anima_ui.sampling.spectrum import Spectrum, plan

# anima_model.md §7.2: ComfyUI "simple", 30 steps, shift 3 (printed to 6 decimals)
SIMPLE_30 = [
    1.0, 0.988753, 0.976987, 0.964286, 0.951353, 0.937781, 0.923077, 0.908051, 0.89222, 0.875, 0.857326,
    0.838624, 0.818182, 0.797095, 0.774662, 0.75, 0.724405, 0.697002, 0.666667, 0.634948, 0.600719, 0.5625,
    0.522164, 0.478202, 0.428571, 0.375562, 0.317035, 0.25, 0.177249, 0.095506, 0.0,
]


def diffusers_anima_sigmas(steps: int, unshifted=None) -> np.ndarray:
    """The schedule as diffusers' Anima pipeline sets it: `FlowMatchEulerDiscreteScheduler(shift=3.0)` (the scheduler
    `scripts/convert_anima_to_diffusers.py` saves) and `AnimaSetTimestepsStep`'s `sigmas=linspace(1, 1/N, N)`."""
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    if unshifted is None:
        unshifted = np.linspace(1.0, 1 / steps, steps)
    scheduler.set_timesteps(sigmas=unshifted)
    return scheduler.sigmas.numpy()


def comfy_unshifted_grid(steps: int) -> np.ndarray:
    """The unshifted t that ComfyUI's "simple" picks: table index 999 − int(k·1000/N) ↔ t = (1000 − int(k·1000/N))/1000."""
    return np.array([(1000 - int(k * (1000 / steps))) / 1000 for k in range(steps)])


def test_simple_sigmas_match_the_30_step_values_in_the_spec():
    sigmas = simple_sigmas(30)
    assert sigmas.dtype == np.float32 and sigmas.shape == (31,)
    np.testing.assert_allclose(sigmas, SIMPLE_30, atol=5e-7, rtol=0)


def test_shifted_table_ends():
    table = shifted_sigma_table(3.0)
    assert table.shape == (1000,) and table[-1] == 1.0
    assert table[0] == np.float32(3 * 0.001 / (1 + 2 * 0.001))
    assert np.all(np.diff(table) > 0)


@pytest.mark.parametrize("steps", [1, 2, 4, 5, 8, 10, 20, 25, 40, 50, 100, 125, 200])
def test_simple_equals_diffusers_anima_schedule_when_steps_divide_1000(steps):
    # linspace(1, 1/N, N) is exactly ComfyUI's grid 1 − k/N when 1000/N is a whole number
    np.testing.assert_array_equal(simple_sigmas(steps), diffusers_anima_sigmas(steps))


@pytest.mark.parametrize("steps", range(1, 121))
def test_simple_equals_diffusers_given_comfy_grid_and_differs_only_by_grid_rounding(steps):
    ours = simple_sigmas(steps)
    np.testing.assert_array_equal(ours, diffusers_anima_sigmas(steps, comfy_unshifted_grid(steps)))
    # with diffusers' own linspace the grids differ by < 1/1000 in t (ComfyUI rounds t up onto the table), which the
    # shift's slope (≤ 3) turns into < 3e-3 in σ; ours is never below diffusers'
    theirs = diffusers_anima_sigmas(steps)
    assert np.all(ours >= theirs)
    assert np.max(ours - theirs) < 3e-3


def test_simple_sigmas_rejects_bad_steps():
    for bad in (0, -3, 2.5, "20", True, MAX_STEPS + 1, 1001):
        with pytest.raises(UserError, match="steps"):
            simple_sigmas(bad)


NOISE_SEEDS = [0, 1, 5, 2**32 + 5, 2**63 - 1, 2**64 - 1]
# latents of 512x512, 704x576 and 1024x1024 images, then sizes that are not whole blocks of 16 (torch redraws the tail)
NOISE_SHAPES = [(1, 16, 1, 64, 64), (1, 16, 1, 72, 88), (1, 16, 1, 128, 128), (17,), (33,), (3, 15)]
NOISE_CHECK = """
import json, sys
import numpy as np, torch
from anima_ui.sampling.noise import torch_randn
worst, equal, total = 0.0, 0, 0
for seed in json.loads(sys.argv[1]):
    for shape in json.loads(sys.argv[2]):
        expected = torch.randn(shape, generator=torch.Generator("cpu").manual_seed(seed)).numpy()
        ours = torch_randn(tuple(shape), seed)
        assert ours.shape == expected.shape and ours.dtype == np.float32
        worst = max(worst, float(np.abs(ours - expected).max()))
        equal += int((ours == expected).sum())
        total += ours.size
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "max_abs": worst, "equal": equal / total}))
"""


def test_noise_equals_torchs_portable_kernel_within_one_ulp():
    """torch's scalar kernel (any CPU without AVX2, aarch64 too) calls glibc's logf/cosf/sinf, which are within
    one ulp of the correctly rounded values ours computes: measured 98.5% bit-identical, max 2.4e-7. The kernel
    is chosen at start-up, so this runs in a fresh process with ATEN_CPU_CAPABILITY=default."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    done = subprocess.run([sys.executable, "-c", NOISE_CHECK, json.dumps(NOISE_SEEDS), json.dumps(NOISE_SHAPES)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    print(f"\nnoise vs torch's scalar kernel: max abs difference {result['max_abs']:.2e}, {100 * result['equal']:.1f}% bit-identical")
    assert result["capability"] == "DEFAULT"
    assert result["max_abs"] <= 4.8e-7 and result["equal"] > 0.97


def test_noise_matches_torch_on_this_cpu(monkeypatch):
    """An x86 CPU with AVX2 gets torch's vectorised kernel (float32 2π·u, polynomial log/sincos): measured max
    abs difference 2.3e-6, 62% bit-identical."""
    monkeypatch.setattr(sys, "argv", ["noise-check", json.dumps(NOISE_SEEDS), json.dumps(NOISE_SHAPES)])
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(NOISE_CHECK, {})
    result = json.loads(printed.getvalue())
    print(f"\nnoise vs torch's {result['capability']} kernel: max abs difference {result['max_abs']:.2e}, "
          f"{100 * result['equal']:.1f}% bit-identical")
    assert result["max_abs"] < 5e-6 and result["equal"] > 0.5


def test_initial_noise_is_the_video_shape_squeezed_and_keeps_torchs_seed_semantics():
    noise = initial_noise(1234, 64, 96)
    assert noise.shape == (1, 16, 8, 12) and noise.dtype == np.float32
    np.testing.assert_array_equal(noise, torch_randn((1, 16, 1, 8, 12), 1234)[:, :, 0])
    assert not np.array_equal(noise, initial_noise(1235, 64, 96))
    # manual_seed keeps the low 32 bits: seeds 5 and 2^32 + 5 draw the same numbers in torch too
    np.testing.assert_array_equal(initial_noise(2**32 + 5, 64, 64), initial_noise(5, 64, 64))
    expected = torch.randn((1, 16, 1, 8, 8), generator=torch.Generator("cpu").manual_seed(2**32 + 5))[:, :, 0].numpy()
    np.testing.assert_allclose(initial_noise(2**32 + 5, 64, 64), expected, atol=5e-6)
    assert abs(float(noise.mean())) < 0.15 and 0.85 < float(noise.std()) < 1.15
    assert MAX_SEED == 2**64 - 1  # the whole range torch's generator takes
    np.testing.assert_array_equal(initial_noise(MAX_SEED, 8, 8), initial_noise(MAX_SEED, 8, 8))


@pytest.mark.parametrize("seed, height, width, word", [(-1, 64, 64, "seed"), (MAX_SEED + 1, 64, 64, "seed"),
                                                       (0, 60, 64, "height"), (0, 64, 0, "width")])
def test_initial_noise_rejects_bad_input(seed, height, width, word):
    with pytest.raises(UserError, match=word):
        initial_noise(seed, height, width)


def test_cfg_combine_is_uncond_plus_scaled_difference():
    rng = np.random.default_rng(0)
    cond, uncond = rng.normal(size=(2, 1, 16, 4, 4)).astype(np.float32)
    out = cfg_combine(cond, uncond, 4.0)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, uncond + 4.0 * (cond - uncond), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(cfg_combine(cond, uncond, 1.0), cond, atol=1e-6)
    np.testing.assert_array_equal(cfg_combine(cond, uncond, 0.0), uncond)


class LinearDenoiser:
    """x0 = a·x + b, a stand-in whose outputs change with x so a wrong update shows; counts its calls."""

    def __init__(self, shape, seed=0):
        rng = np.random.default_rng(seed)
        self.a = np.float32(0.3)
        self.b = rng.normal(size=shape).astype(np.float32)
        self.calls = 0

    def __call__(self, x, sigma):
        self.calls += 1
        return self.a * x * np.float32(1 - sigma) + self.b


def test_sample_euler_matches_diffusers_flow_match_euler_steps():
    steps, shape = 12, (1, 16, 4, 4)
    x = initial_noise(7, 32, 32)
    denoiser = LinearDenoiser(shape)
    sigmas = simple_sigmas(steps)
    ours = sample_euler(denoiser, x, sigmas)

    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(sigmas=comfy_unshifted_grid(steps))
    latent = torch.from_numpy(x.copy())
    for t in scheduler.timesteps:
        sigma = np.float32(t.item() / 1000)
        x0 = denoiser(latent.numpy(), sigma)
        velocity = torch.from_numpy((latent.numpy() - x0) / sigma)  # the model's output in diffusers terms
        latent = scheduler.step(velocity, t, latent).prev_sample
    np.testing.assert_allclose(ours, latent.numpy(), rtol=1e-5, atol=1e-5)
    assert denoiser.calls == 2 * steps


def test_last_step_lands_on_x0():
    target = np.full((1, 16, 2, 2), 0.25, dtype=np.float32)
    out = sample_euler(lambda x, sigma: target, np.ones_like(target), simple_sigmas(5))
    np.testing.assert_allclose(out, target, atol=1e-6)


def test_on_step_reports_every_step_and_x_is_the_latent_after_it():
    denoiser = LinearDenoiser((1, 16, 2, 2))
    sigmas = simple_sigmas(6)
    infos: list[StepInfo] = []
    final = sample_euler(denoiser, initial_noise(1, 16, 16), sigmas, on_step=infos.append)
    assert [i.index0 for i in infos] == list(range(6)) and {i.total for i in infos} == {6}
    assert [i.sigma for i in infos] == [float(s) for s in sigmas[:-1]]
    assert all(i.computed for i in infos)
    np.testing.assert_array_equal(infos[-1].x, final)
    step = infos[2]
    expected = infos[1].x + (infos[1].x - step.x0) / np.float32(step.sigma) * (sigmas[3] - sigmas[2])
    np.testing.assert_allclose(step.x, expected, rtol=1e-6, atol=1e-6)


def test_spectrum_forecast_steps_skip_the_model_and_are_used_like_computed_ones():
    steps = 20
    denoiser = LinearDenoiser((1, 16, 3, 3))
    sigmas = simple_sigmas(steps)
    x = initial_noise(3, 24, 24)
    infos = list(euler_steps(denoiser, x, sigmas, Spectrum(steps)))
    computed, forecast = plan(steps)
    assert [i.index0 + 1 for i in infos if i.computed] == computed
    assert [i.index0 + 1 for i in infos if not i.computed] == forecast
    assert denoiser.calls == len(computed)

    # replay: the same sampler fed the recorded x0's step by step gives the same latents
    shadow = Spectrum(steps)
    latent = x
    for info in infos:
        if shadow.should_predict():
            x0 = shadow.predict()
            np.testing.assert_array_equal(x0, info.x0)
        else:
            x0 = denoiser(latent, np.float32(info.sigma))
            shadow.update(x0)
        i = info.index0
        latent = latent + (latent - x0) / sigmas[i] * (sigmas[i + 1] - sigmas[i])
        np.testing.assert_array_equal(latent, info.x)


def test_spectrum_made_for_other_step_count_is_refused():
    with pytest.raises(ValueError, match="10 steps"):
        sample_euler(lambda x, s: x, np.zeros((1, 16, 1, 1), np.float32), simple_sigmas(12), Spectrum(10))
