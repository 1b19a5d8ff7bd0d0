"""Spectrum step forecasting, exactly as stable-diffusion.cpp's `src/runtime/spectrum.hpp` (`SpectrumState`).

On a forecast step the sampler skips every model pass and uses a forecast of the (CFG-combined) x0 instead:
    x̂0 = (1 − w)·(h_last + ½·(h_last − h_prev)) + w·Σ_k ω_k·h_k
where h_k are the last K = max(m + 1, 6) *computed* x0's and ω are the weights of a ridge (λ) fit of Chebyshev
polynomials T_0..T_m in τ = 2·call/50 − 1. Which steps are forecast is fixed by the counters alone: `warmup` calls are
always computed, then a window that starts at `window` and grows by `flex` after every computed call, and every call
from ⌊stop·steps⌋ on is computed again.

All arithmetic that sd.cpp does in float32 is done in float32 here, in the same order, so the forecasts match
(bit for bit against spectrum.hpp built without FMA contraction).

`variant="velocity"` (not in sd.cpp) runs the identical fit and blend on the velocity v = (x − x0)/σ of the computed
steps and returns x0 = x − σ·v̂. The fit shrinks what it forecasts by 6–15 % (the coefficients sum to 0.85–0.94); on x0
that pulls the sample toward 0, on v it only slows one step. docs/spectrum_quality.md has the measurements.
"""

from __future__ import annotations

import math

import numpy as np

from anima_ui.errors import UserError
from anima_ui.limits import MAX_STEPS

DEFAULTS = {"w": 0.40, "m": 3, "lam": 1.0, "window": 2, "flex": 0.5, "warmup": 4, "stop": 0.9}
VARIANTS = ("sdcpp", "velocity")
MIN_HISTORY = 6  # sd.cpp keeps K = max(m + 1, 6) computed x0's
TAU_CALLS = 50  # sd.cpp maps call indices 0..50 onto τ ∈ [−1, 1] whatever the step count
MAX_DEGREE = 10

F32 = np.float32


def tau(call_index: int) -> np.float32:
    """`(step_cnt / 50.0f) * 2.0f - 1.0f`."""
    return F32(F32(call_index) / F32(TAU_CALLS)) * F32(2.0) - F32(1.0)


def chebyshev_row(t: np.float32, degree: int) -> list[np.float32]:
    """[T_0(t), …, T_degree(t)] by the recurrence T_j = 2t·T_{j−1} − T_{j−2}, in float32."""
    row = [F32(1.0)]
    if degree >= 1:
        row.append(F32(t))
    for _ in range(2, degree + 1):
        row.append(F32(2.0) * F32(t) * row[-1] - row[-2])
    return row


def _cholesky(a: list[list[np.float32]]) -> list[list[np.float32]] | None:
    """Lower-triangular L with L·Lᵀ = a, or None when a pivot is not positive (sd.cpp's `cholesky_decompose`)."""
    n = len(a)
    lower = [[F32(0.0)] * n for _ in range(n)]
    for i in range(n):
        for j in range(i + 1):
            total = F32(0.0)
            for k in range(j):
                total = total + lower[i][k] * lower[j][k]
            if i == j:
                pivot = a[i][i] - total
                if pivot <= 0.0:
                    return None
                lower[i][j] = np.sqrt(pivot)
            else:
                lower[i][j] = (a[i][j] - total) / lower[j][j]
    return lower


def _cholesky_solve(lower: list[list[np.float32]], b: list[np.float32]) -> list[np.float32]:
    n = len(b)
    y = [F32(0.0)] * n
    for i in range(n):
        total = F32(0.0)
        for j in range(i):
            total = total + lower[i][j] * y[j]
        y[i] = (b[i] - total) / lower[i][i]
    x = [F32(0.0)] * n
    for i in reversed(range(n)):
        total = F32(0.0)
        for j in range(i + 1, n):
            total = total + lower[j][i] * x[j]
        x[i] = (y[i] - total) / lower[i][i]
    return x


def chebyshev_weights(taus: list[np.float32], tau_target: np.float32, degree: int, lam: float) -> np.ndarray:
    """ω = X·(XᵀX + λI)⁻¹·x*, so that the ridge forecast at τ* is Σ_k ω_k·h_k (float32 [len(taus)]).

    If XᵀX + λI is not numerically positive-definite, 1e-4·trace/(m+1) is added to its diagonal and the
    factorisation retried, as in sd.cpp.
    """
    size = degree + 1
    design = [chebyshev_row(t, degree) for t in taus]
    target = chebyshev_row(tau_target, degree)
    normal = [[F32(0.0)] * size for _ in range(size)]
    for i in range(size):
        for j in range(size):
            total = F32(0.0)
            for row in design:
                total = total + row[i] * row[j]
            normal[i][j] = total + (F32(lam) if i == j else F32(0.0))
    lower = _cholesky(normal)
    if lower is None:
        trace = F32(0.0)
        for i in range(size):
            trace = trace + normal[i][i]
        for i in range(size):
            normal[i][i] = normal[i][i] + F32(1e-4) * trace / F32(size)
        lower = _cholesky(normal)
        if lower is None:
            raise UserError(f"the Spectrum fit is singular with lam={lam}: use a larger lam (default 1.0)")
    v = _cholesky_solve(lower, target)
    weights = []
    for row in design:
        total = F32(0.0)
        for j in range(size):
            total = total + row[j] * v[j]
        weights.append(total)
    return np.array(weights, dtype=np.float32)


def _check_params(steps, w, m, lam, window, flex, warmup, stop, variant) -> None:
    def whole(value) -> bool:
        return isinstance(value, (int, np.integer)) and not isinstance(value, bool)

    def number(value) -> bool:
        return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool) and math.isfinite(value)

    checks = [
        (whole(steps) and 1 <= steps <= MAX_STEPS, f"steps must be a whole number from 1 to {MAX_STEPS}, got {steps!r}"),
        (number(w) and 0.0 <= w <= 1.0, f"Spectrum w (Chebyshev blend weight) must be between 0 and 1, got {w!r}"),
        (whole(m) and 0 <= m <= MAX_DEGREE, f"Spectrum m (Chebyshev degree) must be a whole number from 0 to {MAX_DEGREE}, got {m!r}"),
        (number(lam) and lam >= 0.0, f"Spectrum lam (ridge strength) must be 0 or more, got {lam!r}"),
        (whole(window) and window >= 1, f"Spectrum window must be a whole number of at least 1, got {window!r}"),
        (number(flex) and flex >= 0.0, f"Spectrum flex (window growth) must be 0 or more, got {flex!r}"),
        (whole(warmup) and warmup >= 0, f"Spectrum warmup must be a whole number of steps, 0 or more, got {warmup!r}"),
        (number(stop) and 0.0 <= stop <= 1.0, f"Spectrum stop must be a fraction between 0 and 1, got {stop!r}"),
        (variant in VARIANTS, f"Spectrum variant must be one of {', '.join(VARIANTS)}, got {variant!r}"),
    ]
    for ok, message in checks:
        if not ok:
            raise UserError(message)


class Spectrum:
    """sd.cpp's `SpectrumState` for one generation of `steps` denoiser calls (Euler: one call per step).

    Per call the sampler asks `should_predict()`; if True it uses `predict(x, sigma)` instead of the model, otherwise
    it runs the model and hands the x0 to `update(x0, x, sigma)`. Only computed steps enter the history. x and sigma
    (the step's input latent and noise level) are needed by the velocity variant only.
    """

    def __init__(self, steps: int, w=0.40, m=3, lam=1.0, window=2, flex=0.5, warmup=4, stop=0.9, variant="sdcpp"):
        _check_params(steps, w, m, lam, window, flex, warmup, stop, variant)
        self.steps = int(steps)
        self.w, self.m, self.lam = float(w), int(m), float(lam)
        self.flex, self.warmup = float(flex), int(warmup)
        self.variant = variant
        self.history_size = max(self.m + 1, MIN_HISTORY)
        self.stop_step = int(F32(stop) * F32(steps))  # (int)(stop_percent * (float)total_steps)
        self.calls = 0  # denoiser calls so far, computed or forecast (sd.cpp `cnt`)
        self.forecasts_in_a_row = 0  # sd.cpp `num_cached`
        self.window = F32(window)  # sd.cpp `curr_ws`, a float that grows by flex
        self.history: list[np.ndarray] = []  # the forecast quantity (x0, or v) of computed steps, oldest first
        self.history_taus: list[np.float32] = []
        self.forecasts = 0

    def should_predict(self) -> bool:
        if self.calls < self.warmup:
            return False
        if self.stop_step > 0 and self.calls >= self.stop_step:
            return False
        if len(self.history) < 2:
            return False
        window = max(1, math.floor(self.window))
        return (self.forecasts_in_a_row + 1) % window != 0

    def update(self, x0: np.ndarray, x: np.ndarray | None = None, sigma: float | None = None) -> None:
        """Record a computed step (a float32 copy) and advance the counters."""
        if self.variant == "velocity":
            tracked = (_require(x, "x") - x0) / F32(_require(sigma, "sigma"))
        else:
            tracked = np.array(x0, dtype=np.float32, copy=True)
        self.history.append(tracked.astype(np.float32, copy=False))
        self.history_taus.append(tau(self.calls))
        del self.history[: -self.history_size], self.history_taus[: -self.history_size]
        if self.calls >= self.warmup:
            self.window = F32(self.window + F32(self.flex))
        self.forecasts_in_a_row = 0
        self.calls += 1

    def weights(self) -> np.ndarray:
        """The Chebyshev weights ω over the history (oldest first) for the current call."""
        return chebyshev_weights(self.history_taus, tau(self.calls), self.m, self.lam)

    def predict(self, x: np.ndarray | None = None, sigma: float | None = None) -> np.ndarray:
        """The forecast x0 for the current call (float32, shape of the history), and advance the counters."""
        if len(self.history) < 2:
            raise RuntimeError("Spectrum.predict() needs two computed steps; ask should_predict() first")
        forecast = self._blend(self.weights())
        if self.variant == "velocity":
            forecast = _require(x, "x") - F32(_require(sigma, "sigma")) * forecast
        self.forecasts_in_a_row += 1
        self.forecasts += 1
        self.calls += 1
        return forecast

    def _blend(self, weights: np.ndarray) -> np.ndarray:
        """(1 − w)·Taylor + w·Chebyshev, element by element in sd.cpp's float32 order."""
        w_cheb = F32(self.w)
        w_taylor = F32(1.0) - w_cheb
        chebyshev = np.zeros_like(self.history[0])
        for weight, h in zip(weights, self.history):
            chebyshev += weight * h
        last, previous = self.history[-1], self.history[-2]
        taylor = last + F32(0.5) * (last - previous)
        return w_taylor * taylor + w_cheb * chebyshev


def _require(value, name):
    if value is None:
        raise ValueError(f"the velocity variant of Spectrum needs {name} (the step's input latent and sigma)")
    return value


def plan(steps: int, **params) -> tuple[list[int], list[int]]:
    """Which steps (1-based) a `Spectrum(steps, **params)` run computes and which it forecasts.

    Runs the real state object on a one-element stand-in latent, so the plan cannot drift from the sampler's
    behaviour. The variant does not change the plan.
    """
    unknown = sorted(set(params) - set(DEFAULTS) - {"variant"})
    if unknown:
        raise UserError(f"unknown Spectrum parameter(s) {', '.join(unknown)}: use {', '.join(DEFAULTS)} or variant")
    spectrum = Spectrum(steps, **params)
    stand_in = np.zeros(1, dtype=np.float32)
    computed, forecast = [], []
    for step in range(1, steps + 1):
        if spectrum.should_predict():
            spectrum.predict(stand_in, 1.0)
            forecast.append(step)
        else:
            spectrum.update(stand_in, stand_in, 1.0)
            computed.append(step)
    return computed, forecast
