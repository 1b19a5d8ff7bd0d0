"""Spectrum: the schedule against the spec's table and an independent transcription of sd.cpp's rule, the forecast
weights against a direct NumPy ridge solve, and the history bookkeeping."""

import inspect
import json
import math
import random

import numpy as np
import pytest

from anima_ui.cli import main
from anima_ui.errors import UserError
from anima_ui.sampling import spectrum as spectrum_module
from anima_ui.sampling.spectrum import DEFAULTS, Spectrum, chebyshev_weights, plan, tau

# spectrum_and_sdcpp.md §1.6 (defaults)
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


def test_defaults_are_sdcpp_defaults_and_the_constructor_uses_them():
    assert DEFAULTS == {"w": 0.40, "m": 3, "lam": 1.0, "window": 2, "flex": 0.5, "warmup": 4, "stop": 0.9}
    signature = inspect.signature(Spectrum)
    assert {name: signature.parameters[name].default for name in DEFAULTS} == DEFAULTS


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
    spectrum = Spectrum(20)
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
    # spectrum_and_sdcpp.md §1.4: at step 5 of 20 the blended coefficients sum to 0.894
    spectrum = Spectrum(20)
    for _ in range(4):
        spectrum.update(np.ones(3, dtype=np.float32))
    np.testing.assert_allclose(spectrum.predict(), 0.8939, atol=1e-4)


def test_only_computed_steps_enter_the_history():
    steps = 28
    spectrum = Spectrum(steps)
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
        Spectrum(10).predict()


@pytest.mark.parametrize("params, word", [({"w": 1.5}, "w"), ({"m": -1}, "m"), ({"m": 2.5}, "m"), ({"lam": -1}, "lam"),
                                          ({"window": 0}, "window"), ({"flex": -0.1}, "flex"), ({"warmup": -1}, "warmup"),
                                          ({"stop": 2}, "stop"), ({"stop": float("nan")}, "stop")])
def test_bad_parameters_raise_user_errors_naming_them(params, word):
    with pytest.raises(UserError, match=f"Spectrum {word}"):
        Spectrum(20, **params)


def test_plan_rejects_unknown_parameters():
    with pytest.raises(UserError, match="unknown Spectrum parameter"):
        plan(20, window_size=3)


def test_velocity_variant_forecasts_v_with_the_same_fit_and_returns_x0():
    rng = np.random.default_rng(11)
    steps = 20
    exact, velocity = Spectrum(steps), Spectrum(steps, variant="velocity")
    sigmas = np.linspace(1.0, 0.5, 6, dtype=np.float32)
    for sigma in sigmas[:4]:
        x = rng.normal(size=(1, 16, 2, 2)).astype(np.float32)
        x0 = rng.normal(size=(1, 16, 2, 2)).astype(np.float32)
        exact.update((x - x0) / sigma)  # sd.cpp's state fed the velocities directly
        velocity.update(x0, x, sigma)
    x, sigma = rng.normal(size=(1, 16, 2, 2)).astype(np.float32), sigmas[4]
    assert exact.should_predict() and velocity.should_predict()
    np.testing.assert_allclose(velocity.predict(x, sigma), x - sigma * exact.predict(), rtol=1e-6, atol=1e-6)


def test_velocity_variant_needs_the_latent_and_sigma():
    spectrum = Spectrum(20, variant="velocity")
    with pytest.raises(ValueError, match="needs x"):
        spectrum.update(np.zeros(2, np.float32))


def test_the_variant_does_not_change_the_plan_and_unknown_variants_are_refused():
    assert plan(28, variant="velocity") == plan(28)
    with pytest.raises(UserError, match="Spectrum variant"):
        Spectrum(20, variant="vel")
