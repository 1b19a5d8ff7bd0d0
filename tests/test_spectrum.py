"""Spectrum: the schedule against sd.cpp's published table and an independent transcription of sd.cpp's rule, the
"sdcpp" forecast weights against a direct NumPy ridge solve, every other forecaster against its formula, the named
settings and the canonical config."""

import inspect
import json
import math
import random

import numpy as np
import pytest

from anima_ui.cli import main
from anima_ui.errors import UserError
from anima_ui.sampling import spectrum as spectrum_module
from anima_ui.sampling.spectrum import (
    DEFAULT_FORECASTER,
    DEFAULTS,
    FORECASTERS,
    SETTINGS,
    Spectrum,
    canonical,
    chebyshev_weights,
    first_forecasting_steps,
    plan,
    tau,
)

# sd.cpp's defaults: the schedule stable-diffusion.cpp's Spectrum PRs and blog post publish
FULL_PLANS = {
    20: [1, 2, 3, 4, 6, 8, 11, 14, 18, 19, 20],
    28: [1, 2, 3, 4, 6, 8, 11, 14, 18, 22, 26, 27, 28],
    30: [1, 2, 3, 4, 6, 8, 11, 14, 18, 22, 27, 28, 29, 30],
    40: [1, 2, 3, 4, 6, 8, 11, 14, 18, 22, 27, 32, 37, 38, 39, 40],
    50: [1, 2, 3, 4, 6, 8, 11, 14, 18, 22, 27, 32, 38, 44, 46, 47, 48, 49, 50],
}
COMPUTED_COUNTS = {8: 6, 10: 7, 12: 8, 15: 9, 20: 11, 25: 13, 28: 13, 30: 14, 40: 16, 50: 19}


@pytest.mark.parametrize("steps", sorted(FULL_PLANS))
def test_plan_matches_the_spec_table(steps):
    computed, forecast = plan(steps)
    assert computed == FULL_PLANS[steps]
    assert forecast == [s for s in range(1, steps + 1) if s not in FULL_PLANS[steps]]


def test_plan_counts_match_the_spec_table():
    assert {steps: len(plan(steps)[0]) for steps in COMPUTED_COUNTS} == COMPUTED_COUNTS
    assert plan(20)[1] == [5, 7, 9, 10, 12, 13, 15, 16, 17]


def test_spectrum_plan_command_prints_one_json_object(capsys):
    assert main(["spectrum-plan", "--steps", "20"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out == {"computed": FULL_PLANS[20], "forecast": [5, 7, 9, 10, 12, 13, 15, 16, 17]}
    assert main(["spectrum-plan", "--steps", "28", "--warmup", "2", "--flex", "0.3", "--stop", "0.8"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["computed"], out["forecast"]) == plan(28, warmup=2, flex=0.3, stop=0.8)


def test_spectrum_plan_command_reports_bad_parameters_in_one_line(capsys):
    assert main(["spectrum-plan", "--steps", "20", "--stop", "1.5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: Spectrum stop") and "\n" not in err


def sdcpp_rule(steps, w, m, lam, window, flex, warmup, stop):
    """An independent transcription of `SpectrumState::{init, should_predict, update, predict}` bookkeeping
    (sd.cpp keeps `curr_ws` and `stop_percent * total_steps` in float32)."""
    stop_step = int(np.float32(stop) * np.float32(steps))
    history_cap = max(m + 1, 6)
    cnt = num_cached = history = 0
    curr_ws = np.float32(window)
    marks = []
    for _ in range(steps):
        forecast = (
            cnt >= warmup
            and not (stop_step > 0 and cnt >= stop_step)
            and history >= 2
            and (num_cached + 1) % max(1, math.floor(curr_ws)) != 0
        )
        if forecast:
            num_cached += 1
        else:
            history = min(history + 1, history_cap)
            if cnt >= warmup:
                curr_ws = np.float32(curr_ws + np.float32(flex))
            num_cached = 0
        marks.append(not forecast)
        cnt += 1
    return [i + 1 for i, c in enumerate(marks) if c], [i + 1 for i, c in enumerate(marks) if not c]


def test_plan_equals_an_independent_transcription_of_sdcpp_for_many_settings():
    rng = random.Random(0)
    for _ in range(250):
        params = {
            "w": rng.choice([0.0, 0.4, 1.0]),
            "m": rng.randint(0, 6),
            "lam": rng.choice([0.1, 1.0]),
            "window": rng.randint(1, 4),
            "flex": rng.choice([0.0, 0.1, 0.25, 0.3, 0.5, 0.7, 0.75, 1.1, 2.0]),
            "warmup": rng.randint(0, 7),
            "stop": rng.choice([0.0, 0.35, 0.5, 0.65, 0.7, 0.85, 0.9, 0.95, 1.0]),
        }
        steps = rng.randint(1, 120)
        assert plan(steps, **params) == sdcpp_rule(steps, **params), (steps, params)


def test_defaults_are_sdcpp_defaults_and_the_constructor_and_on_setting_use_them():
    assert DEFAULTS == {"w": 0.40, "m": 3, "lam": 1.0, "window": 2, "flex": 0.5, "warmup": 4, "stop": 0.9}
    signature = inspect.signature(Spectrum)
    assert {name: signature.parameters[name].default for name in DEFAULTS} == DEFAULTS
    assert signature.parameters["forecaster"].default == DEFAULT_FORECASTER
    assert SETTINGS["on"] == {"window": 2, "flex": 0.5, "warmup": 4, "stop": 0.9}


def ridge_forecast(taus, tau_target, history, degree, lam):
    """The same ridge problem solved directly in float64: β = argmin ‖Xβ − H‖² + λ‖β‖², forecast = x*ᵀβ, by
    least squares on the augmented system [X; √λ·I] β = [H; 0]."""
    taus = np.asarray(taus, dtype=np.float64)
    design = np.polynomial.chebyshev.chebvander(taus, degree)
    augmented = np.vstack([design, math.sqrt(lam) * np.eye(degree + 1)])
    rhs = np.vstack([history, np.zeros((degree + 1, history.shape[1]))])
    beta = np.linalg.lstsq(augmented, rhs, rcond=None)[0]
    return np.polynomial.chebyshev.chebvander(np.array([tau_target], dtype=np.float64), degree) @ beta


@pytest.mark.parametrize("degree, lam, count", [(3, 1.0, 6), (3, 1.0, 4), (2, 0.1, 5), (4, 0.5, 6), (0, 1.0, 3)])
def test_chebyshev_weights_equal_a_direct_least_squares_ridge_solve(degree, lam, count):
    rng = np.random.default_rng(degree * 10 + count)
    calls = sorted(rng.choice(40, size=count, replace=False))
    taus = [tau(c) for c in calls]
    target = tau(calls[-1] + 2)
    history = rng.normal(size=(count, 50))
    weights = chebyshev_weights(taus, target, degree, lam).astype(np.float64)
    np.testing.assert_allclose(weights @ history, ridge_forecast(taus, target, history, degree, lam)[0], rtol=2e-5, atol=2e-5)


def test_singular_fit_takes_the_diagonal_jitter_retry(monkeypatch):
    # λ = 0 with two points and degree 3: XᵀX has rank 2, so sd.cpp adds 1e-4·trace/(m+1) to the diagonal and retries
    attempts = []
    factorise = spectrum_module._cholesky
    monkeypatch.setattr(spectrum_module, "_cholesky", lambda a: attempts.append(factorise(a)) or attempts[-1])
    taus = [tau(0), tau(1)]
    design = np.polynomial.chebyshev.chebvander(np.array(taus, dtype=np.float64), 3)
    normal = design.T @ design
    normal += np.eye(4) * 1e-4 * np.trace(normal) / 4
    target = np.polynomial.chebyshev.chebvander(np.array([tau(2)], dtype=np.float64), 3)[0]
    expected = design @ np.linalg.solve(normal, target)
    np.testing.assert_allclose(chebyshev_weights(taus, tau(2), 3, 0.0), expected, rtol=1e-4, atol=1e-5)
    assert attempts[0] is None and attempts[1] is not None


def test_predict_is_the_taylor_chebyshev_blend():
    rng = np.random.default_rng(5)
    spectrum = Spectrum(20, "sdcpp")
    history = [rng.normal(size=(1, 16, 2, 2)).astype(np.float32) for _ in range(4)]
    for h in history:
        spectrum.update(h)
    assert spectrum.should_predict()
    flat = np.stack([h.ravel() for h in history]).astype(np.float64)
    chebyshev = ridge_forecast([tau(c) for c in range(4)], tau(4), flat, 3, 1.0)[0]
    taylor = flat[-1] + 0.5 * (flat[-1] - flat[-2])
    expected = (0.6 * taylor + 0.4 * chebyshev).reshape(1, 16, 2, 2)
    forecast = spectrum.predict()
    assert forecast.dtype == np.float32
    np.testing.assert_allclose(forecast, expected, rtol=1e-5, atol=1e-5)


def test_a_constant_x0_is_forecast_too_small_as_the_spec_says():
    # at step 5 of 20 sd.cpp's blended coefficients sum to 0.894 (λ = 1 shrinks the ridge fit)
    spectrum = Spectrum(20, "sdcpp")
    for _ in range(4):
        spectrum.update(np.ones(3, dtype=np.float32))
    np.testing.assert_allclose(spectrum.predict(), 0.8939, atol=1e-4)


def test_only_computed_steps_enter_the_history():
    steps = 28
    spectrum = Spectrum(steps, "sdcpp")
    computed_calls, forecasts = [], []
    for call in range(steps):
        if spectrum.should_predict():
            forecasts.append(spectrum.predict())
        else:
            spectrum.update(np.full(2, call, dtype=np.float32))
            computed_calls.append(call)
    kept = computed_calls[-6:]
    assert [float(h[0]) for h in spectrum.history] == kept
    assert spectrum.history_taus == [tau(c) for c in kept]
    assert len(forecasts) == steps - len(computed_calls) == spectrum.forecasts
    assert spectrum.calls == steps
    # forecasts extrapolate between integer call indices and so are never one of the stored values
    stored = {float(h[0]) for h in spectrum.history}
    assert all(float(f[0]) not in stored for f in forecasts)


def test_history_is_a_copy_and_holds_max_m_plus_1_or_6_entries():
    spectrum = Spectrum(30, m=7, warmup=30)
    x0 = np.zeros(2, dtype=np.float32)
    for call in range(12):
        x0[:] = call
        spectrum.update(x0)
    assert [float(h[0]) for h in spectrum.history] == list(range(4, 12))


def test_predict_without_history_is_refused():
    with pytest.raises(RuntimeError, match="should_predict"):
        Spectrum(10).predict(np.zeros(2, np.float32), 0.5, 0.4)


@pytest.mark.parametrize("params, word", [({"w": 1.5}, "w"), ({"m": -1}, "m"), ({"m": 2.5}, "m"), ({"lam": -1}, "lam"),
                                          ({"window": 0}, "window"), ({"flex": -0.1}, "flex"), ({"warmup": -1}, "warmup"),
                                          ({"stop": 2}, "stop"), ({"stop": float("nan")}, "stop")])
def test_bad_parameters_raise_user_errors_naming_them(params, word):
    with pytest.raises(UserError, match=f"Spectrum {word}"):
        Spectrum(20, **params)


def test_plan_rejects_unknown_parameters():
    with pytest.raises(UserError, match="unknown Spectrum parameter"):
        plan(20, window_size=3)


def test_taylor_is_sdcpps_blend_at_w_0_bit_for_bit():
    rng = np.random.default_rng(3)
    taylor, blend = Spectrum(28, "taylor"), Spectrum(28, "sdcpp", w=0.0)
    for _ in range(28):
        assert taylor.should_predict() == blend.should_predict()
        if taylor.should_predict():
            np.testing.assert_array_equal(taylor.predict(), blend.predict())
        else:
            x0 = rng.normal(size=(1, 16, 3, 3)).astype(np.float32)
            taylor.update(x0)
            blend.update(x0)
    assert taylor.forecasts == blend.forecasts > 0


def fed(forecaster, x0s, xs, sigmas):
    """A Spectrum of 20 steps whose 4 warm-up steps were fed these x0's at these latents and noise levels."""
    spectrum = Spectrum(20, forecaster)
    for x0, x, sigma in zip(x0s, xs, sigmas):
        spectrum.update(x0, x, sigma)
    assert spectrum.should_predict()
    return spectrum


def test_every_forecaster_follows_its_formula():
    rng = np.random.default_rng(11)
    sigmas = [np.float32(s) for s in (1.0, 0.95, 0.9, 0.8)]
    x0s = [rng.normal(size=(1, 16, 2, 2)).astype(np.float32) for _ in sigmas]
    xs = [rng.normal(size=(1, 16, 2, 2)).astype(np.float32) for _ in sigmas]
    x, sigma, sigma_next = rng.normal(size=(1, 16, 2, 2)).astype(np.float32), 0.7, 0.6
    v = [(x_ - x0) / s for x_, x0, s in zip(xs, x0s, sigmas)]
    to_x0 = lambda velocity: x - sigma * velocity  # noqa: E731
    through = lambda h, target: h[-1] + (target - sigmas[-1]) / (sigmas[-1] - sigmas[-2]) * (h[-1] - h[-2])  # noqa: E731
    expected = {
        "taylor": x0s[-1] + 0.5 * (x0s[-1] - x0s[-2]),
        "reuse": x0s[-1],
        "linear": through(x0s, sigma),
        "velocity-taylor": to_x0(v[-1] + 0.5 * (v[-1] - v[-2])),
        "velocity-linear": to_x0(through(v, sigma)),
        "velocity-ab": to_x0(through(v, (sigma + sigma_next) / 2)),
        "velocity": to_x0(fed("sdcpp", v, xs, sigmas).predict()),  # sd.cpp's state fed the velocities directly
        "sdcpp": fed("sdcpp", x0s, xs, sigmas).predict(),
    }
    assert set(expected) == set(FORECASTERS)
    for name, value in expected.items():
        forecast = fed(name, x0s, xs, sigmas).predict(x, sigma, sigma_next)
        assert forecast.dtype == np.float32
        np.testing.assert_allclose(forecast, value, rtol=2e-5, atol=2e-5, err_msg=name)


def test_reusing_the_last_velocity_is_reusing_the_last_x0_under_euler():
    # why there is no "velocity-reuse": Euler toward a fixed x0 keeps the velocity (x − x0)/σ fixed
    from anima_ui.sampling.euler import sample_euler
    from anima_ui.sampling.schedule import simple_sigmas

    class VelocityReuse(Spectrum):
        def predict(self, x=None, sigma=None, sigma_next=None):
            super().predict(x, sigma, sigma_next)  # advances the counters
            return x - np.float32(sigma) * (self.x_last - self.x0_last) / np.float32(self.sigma_last)

        def update(self, x0, x=None, sigma=None):
            self.x0_last, self.x_last, self.sigma_last = x0, x, sigma
            super().update(x0, x, sigma)

    def denoiser(x, sigma):
        return np.tanh(x) * (1 - sigma)

    x = np.random.default_rng(2).normal(size=(1, 16, 2, 2)).astype(np.float32)
    reuse = sample_euler(denoiser, x, simple_sigmas(20), Spectrum(20, "reuse"))
    velocity_reuse = sample_euler(denoiser, x, simple_sigmas(20), VelocityReuse(20, "reuse"))
    np.testing.assert_allclose(velocity_reuse, reuse, rtol=1e-5, atol=1e-5)


def test_velocity_forecasters_need_the_latent_and_sigma():
    spectrum = Spectrum(20, "velocity-taylor")
    with pytest.raises(ValueError, match="needs x"):
        spectrum.update(np.zeros(2, np.float32))


def test_the_forecaster_does_not_change_the_plan_and_unknown_ones_are_refused():
    assert all(plan(28, forecaster=name) == plan(28) for name in FORECASTERS)
    with pytest.raises(UserError, match="Spectrum forecaster"):
        Spectrum(20, "vel")


def test_fast_setting_about_halves_the_evaluations_of_on_again():
    for steps in (20, 28, 50):
        on, fast = len(plan(steps)[0]), len(plan(steps, setting="fast")[0])
        assert abs(fast - on / 2) <= 1.5, (steps, on, fast)
        assert plan(steps, setting="fast")[0][-1] == steps  # the last step is always computed
    assert plan(20, setting="fast")[0] == [1, 2, 5, 9, 15, 20]


def test_first_forecasting_steps():
    assert first_forecasting_steps({}) == 6 and plan(5)[1] == [] and plan(6)[1] == [5]
    assert first_forecasting_steps({"setting": "fast"}) == 4
    assert first_forecasting_steps({"warmup": 200}) is None


def test_canonical_config_writes_out_what_the_run_uses():
    assert canonical({}) == {"setting": "on", "forecaster": DEFAULT_FORECASTER, **SETTINGS["on"]}
    assert canonical({"setting": "fast", "forecaster": "sdcpp", "window": 4.0}) == {
        "setting": "fast", "forecaster": "sdcpp", **SETTINGS["fast"], "window": 4, "w": 0.4, "m": 3, "lam": 1.0}
    assert canonical(canonical({"setting": "fast"})) == canonical({"setting": "fast"})
    for bad, word in (({"setting": "turbo"}, "setting"), ({"variant": "velocity"}, "unknown"), ({"window": 2.5}, "window")):
        with pytest.raises(UserError, match=word):
            canonical(bad)
