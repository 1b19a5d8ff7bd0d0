"""Spectrum step forecasting: on a forecast step the sampler skips every model pass and uses a forecast of the step's
(CFG-combined) x0, made from the x0's of the steps it did compute.

Two independent choices make a run:

* **The schedule** (which steps are forecast) is stable-diffusion.cpp's (`src/runtime/spectrum.hpp`, `SpectrumState`),
  fixed by counters alone: `warmup` calls are always computed, then a window that starts at `window` and grows by
  `flex` after every computed call, and every call from ⌊stop·steps⌋ on is computed again. `SETTINGS` names two
  schedules: "on" (sd.cpp's defaults) and "fast" (about half the model evaluations of "on").
* **The forecaster** (what a forecast step uses), one of `FORECASTERS`. "sdcpp" is sd.cpp's forecast exactly:
      x̂0 = (1 − w)·(h_last + ½·(h_last − h_prev)) + w·Σ_k ω_k·h_k
  where h_k are the last K = max(m + 1, 6) computed x0's and ω are the weights of a ridge (λ) fit of Chebyshev
  polynomials T_0..T_m in τ = 2·call/50 − 1. All arithmetic sd.cpp does in float32 is done in float32 here, in the
  same order, so the forecasts match bit for bit against spectrum.hpp built without FMA contraction. The others
  forecast x0, or the velocity v = (x − x0)/σ (then x0 = x − σ·v̂), with the rules below.

Which forecaster is the default, and the measurements behind it, are in docs/spectrum_quality.md
(`anima-ui bench spectrum` reproduces them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from anima_ui.errors import UserError
from anima_ui.limits import MAX_STEPS

MIN_HISTORY = 6  # sd.cpp keeps K = max(m + 1, 6) computed x0's
TAU_CALLS = 50  # sd.cpp maps call indices 0..50 onto τ ∈ [−1, 1] whatever the step count
MAX_DEGREE = 10

F32 = np.float32


@dataclass(frozen=True)
class Forecaster:
    space: str  # "x0", or "velocity": forecast v = (x − x0)/σ and return x0 = x − σ·v̂
    rule: str  # "blend" | "taylor" | "reuse" | "linear" | "midpoint" (no velocity "reuse": it equals x0 "reuse")
    about: str


FORECASTERS = {
    "taylor": Forecaster("x0", "taylor", "x0 + ½·(x0 − previous x0) of the last two computed steps (sd.cpp's w = 0)"),
    "sdcpp": Forecaster("x0", "blend", "stable-diffusion.cpp's blend: (1 − w)·Taylor + w·Chebyshev ridge fit, on x0"),
    "reuse": Forecaster("x0", "reuse", "the last computed x0 unchanged"),
    "linear": Forecaster("x0", "linear", "x0 extrapolated linearly in σ through the last two computed steps"),
    "velocity": Forecaster("velocity", "blend", "sd.cpp's blend on the velocity"),
    "velocity-taylor": Forecaster("velocity", "taylor", "v + ½·(v − previous v) (sd.cpp's w = 0 on the velocity)"),
    "velocity-linear": Forecaster("velocity", "linear", "the velocity extrapolated linearly in σ"),
    "velocity-ab": Forecaster(
        "velocity", "midpoint", "the velocity extrapolated linearly in σ to the middle of the step (Adams–Bashforth 2)"
    ),
}
DEFAULT_FORECASTER = "taylor"

# name -> (type, default, meaning): the one definition of every tunable, read by the CLI flags, the infotext parser
# and the constructor. w, m and lam matter only to the "blend" forecasters (sdcpp, velocity).
PARAMETERS = {
    "w": (float, 0.40, "blend weight of the Chebyshev fit (Taylor gets 1 − w); sdcpp and velocity only"),
    "m": (int, 3, "Chebyshev degree; sdcpp and velocity only"),
    "lam": (float, 1.0, "ridge strength of the Chebyshev fit; sdcpp and velocity only"),
    "window": (int, 2, "initial skip window"),
    "flex": (float, 0.5, "window growth after every computed step"),
    "warmup": (int, 4, "first steps always computed"),
    "stop": (float, 0.9, "fraction of steps from which every step is computed"),
}
DEFAULTS = {name: default for name, (_, default, _) in PARAMETERS.items()}
SCHEDULE_KEYS = ("window", "flex", "warmup", "stop")
SETTINGS = {  # named schedules; "on" is sd.cpp's
    "on": {key: DEFAULTS[key] for key in SCHEDULE_KEYS},
    "fast": {"window": 3, "flex": 1.5, "warmup": 2, "stop": 0.95},  # about half the evaluations of "on"
}


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


def _check_params(steps, forecaster, w, m, lam, window, flex, warmup, stop) -> None:
    def whole(value) -> bool:
        return isinstance(value, (int, np.integer)) and not isinstance(value, bool)

    def number(value) -> bool:
        return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool) and math.isfinite(value)

    checks = [
        (whole(steps) and 1 <= steps <= MAX_STEPS, f"steps must be a whole number from 1 to {MAX_STEPS}, got {steps!r}"),
        (forecaster in FORECASTERS, f"Spectrum forecaster must be one of {', '.join(FORECASTERS)}, got {forecaster!r}"),
        (number(w) and 0.0 <= w <= 1.0, f"Spectrum w (Chebyshev blend weight) must be between 0 and 1, got {w!r}"),
        (whole(m) and 0 <= m <= MAX_DEGREE, f"Spectrum m (Chebyshev degree) must be a whole number from 0 to {MAX_DEGREE}, got {m!r}"),
        (number(lam) and lam >= 0.0, f"Spectrum lam (ridge strength) must be 0 or more, got {lam!r}"),
        (whole(window) and window >= 1, f"Spectrum window must be a whole number of at least 1, got {window!r}"),
        (number(flex) and flex >= 0.0, f"Spectrum flex (window growth) must be 0 or more, got {flex!r}"),
        (whole(warmup) and warmup >= 0, f"Spectrum warmup must be a whole number of steps, 0 or more, got {warmup!r}"),
        (number(stop) and 0.0 <= stop <= 1.0, f"Spectrum stop must be a fraction between 0 and 1, got {stop!r}"),
    ]
    for ok, message in checks:
        if not ok:
            raise UserError(message)


class Spectrum:
    """sd.cpp's `SpectrumState` for one generation of `steps` denoiser calls (Euler: one call per step), with a
    choice of forecaster.

    Per call the sampler asks `should_predict()`; if True it uses `predict(x, sigma, sigma_next)` instead of the model,
    otherwise it runs the model and hands the x0 to `update(x0, x, sigma)`. Only computed steps enter the history.
    x, sigma and sigma_next (the step's input latent and its noise levels) are needed only by forecasters that use
    them (velocity space, extrapolation in σ).
    """

    def __init__(self, steps: int, forecaster: str = DEFAULT_FORECASTER, w=DEFAULTS["w"], m=DEFAULTS["m"],
                 lam=DEFAULTS["lam"], window=DEFAULTS["window"], flex=DEFAULTS["flex"], warmup=DEFAULTS["warmup"],
                 stop=DEFAULTS["stop"]):
        _check_params(steps, forecaster, w, m, lam, window, flex, warmup, stop)
        self.steps = int(steps)
        self.forecaster = forecaster
        self.space, self.rule = FORECASTERS[forecaster].space, FORECASTERS[forecaster].rule
        self.w, self.m, self.lam = float(w), int(m), float(lam)
        self.flex, self.warmup = float(flex), int(warmup)
        self.history_size = max(self.m + 1, MIN_HISTORY)
        self.stop_step = int(F32(stop) * F32(steps))  # (int)(stop_percent * (float)total_steps)
        self.calls = 0  # denoiser calls so far, computed or forecast (sd.cpp `cnt`)
        self.forecasts_in_a_row = 0  # sd.cpp `num_cached`
        self.window = F32(window)  # sd.cpp `curr_ws`, a float that grows by flex
        self.history: list[np.ndarray] = []  # the forecast quantity (x0, or v) of computed steps, oldest first
        self.history_taus: list[np.float32] = []
        self.history_sigmas: list[float | None] = []
        self.forecasts = 0

    @classmethod
    def from_config(cls, steps: int, config: dict) -> "Spectrum":
        """A run from a request's Spectrum config: {"setting": name, "forecaster": name, **parameter overrides}."""
        return cls(steps, **resolve(config))

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
        if self.space == "velocity":
            tracked = (_require(x, "x") - x0) / F32(_require(sigma, "sigma"))
        else:
            tracked = np.array(x0, dtype=np.float32, copy=True)
        self.history.append(tracked.astype(np.float32, copy=False))
        self.history_taus.append(tau(self.calls))
        self.history_sigmas.append(None if sigma is None else float(sigma))
        keep = self.history_size
        del self.history[:-keep], self.history_taus[:-keep], self.history_sigmas[:-keep]
        if self.calls >= self.warmup:
            self.window = F32(self.window + F32(self.flex))
        self.forecasts_in_a_row = 0
        self.calls += 1

    def weights(self) -> np.ndarray:
        """The Chebyshev weights ω over the history (oldest first) for the current call."""
        return chebyshev_weights(self.history_taus, tau(self.calls), self.m, self.lam)

    def predict(self, x: np.ndarray | None = None, sigma: float | None = None, sigma_next: float | None = None) -> np.ndarray:
        """The forecast x0 for the current call (float32, shape of the history), and advance the counters."""
        if len(self.history) < 2:
            raise RuntimeError("Spectrum.predict() needs two computed steps; ask should_predict() first")
        forecast = self._forecast(sigma, sigma_next)
        if self.space == "velocity":
            forecast = _require(x, "x") - F32(_require(sigma, "sigma")) * forecast
        self.forecasts_in_a_row += 1
        self.forecasts += 1
        self.calls += 1
        return forecast

    def _forecast(self, sigma, sigma_next) -> np.ndarray:
        last, previous = self.history[-1], self.history[-2]
        if self.rule == "blend":
            return self._blend(self.weights())
        if self.rule == "taylor":  # what sd.cpp's blend returns at w = 0, bit for bit
            return last + F32(0.5) * (last - previous)
        if self.rule == "reuse":
            return last.copy()
        sigma_last, sigma_previous = (_require(s, "sigma") for s in self.history_sigmas[-2:][::-1])
        target = float(_require(sigma, "sigma"))
        if self.rule == "midpoint":
            target = 0.5 * (target + float(_require(sigma_next, "sigma_next")))
        slope = (target - sigma_last) / (sigma_last - sigma_previous)
        return last + F32(slope) * (last - previous)

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
        raise ValueError(f"this Spectrum forecaster needs {name} (the step's input latent and noise levels)")
    return value


def resolve(config: dict) -> dict:
    """The full Spectrum keyword arguments of a config {"setting": "on" | "fast", "forecaster": name, **overrides}:
    the setting's schedule, then the overrides on top. UserError names an unknown setting or parameter."""
    config = dict(config)
    setting = config.pop("setting", "on")
    if setting not in SETTINGS:
        raise UserError(f"Spectrum setting must be one of {', '.join(SETTINGS)}, got {setting!r}")
    unknown = sorted(set(config) - set(PARAMETERS) - {"forecaster"})
    if unknown:
        raise UserError(f"unknown Spectrum parameter(s) {', '.join(unknown)}: use forecaster, {', '.join(PARAMETERS)}")
    return {"forecaster": DEFAULT_FORECASTER, **DEFAULTS, **SETTINGS[setting], **config}


def canonical(config: dict) -> dict:
    """A config written out in full: {"setting", "forecaster", then every parameter this run uses (the schedule's,
    and w, m, lam for the blend forecasters)}. This is what the PNG parameters and the JSON sidecar record, so a
    restore brings back the same run even if a setting's numbers change later."""
    full = {key: _whole_if_integral(key, value) for key, value in resolve(config).items()}
    Spectrum(1, **full)  # UserError naming a bad value
    used = SCHEDULE_KEYS + (("w", "m", "lam") if FORECASTERS[full["forecaster"]].rule == "blend" else ())
    return {"setting": config.get("setting", "on"), "forecaster": full["forecaster"], **{key: full[key] for key in used}}


def _whole_if_integral(key: str, value):
    """2.0 → 2 for the whole-number parameters (form widgets send floats); anything else is left to the checks."""
    if key in PARAMETERS and PARAMETERS[key][0] is int and isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def first_forecasting_steps(config: dict, limit: int = 100) -> int | None:
    """The smallest step count at which this config forecasts any step (None: none up to `limit`)."""
    return next((steps for steps in range(1, limit + 1) if plan(steps, **config)[1]), None)


def plan(steps: int, **config) -> tuple[list[int], list[int]]:
    """Which steps (1-based) a Spectrum run of this config (see `resolve`) computes and which it forecasts.

    Runs the real state object on a one-element stand-in latent, so the plan cannot drift from the sampler's
    behaviour. The forecaster does not change the plan.
    """
    spectrum = Spectrum(steps, **{**resolve(config), "forecaster": "reuse"})  # the cheapest; same plan
    stand_in = np.zeros(1, dtype=np.float32)
    computed, forecast = [], []
    for step in range(1, steps + 1):
        if spectrum.should_predict():
            spectrum.predict()
            forecast.append(step)
        else:
            spectrum.update(stand_in)
            computed.append(step)
    return computed, forecast
