"""The Euler sampler (k-diffusion's `sample_euler`) on an x0 predictor, with optional Spectrum forecasting.

Per step i: x0 = predict_x0(x, σ_i) (already CFG-combined) — or Spectrum's forecast on a forecast step, used exactly
like a computed x0 — then d = (x − x0)/σ_i and x ← x + d·(σ_{i+1} − σ_i). The last step (σ_N = 0) lands on x0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from anima_ui.sampling.spectrum import Spectrum

PredictX0 = Callable[[np.ndarray, np.float32], np.ndarray]


@dataclass(frozen=True)
class StepInfo:
    index0: int  # 0-based step index
    total: int  # number of steps
    sigma: float  # σ_i, the noise level this step started from
    x: np.ndarray  # the latent after this step (after the last step: the result)
    x0: np.ndarray  # the x0 this step used, computed or forecast
    computed: bool  # False: Spectrum forecast x0 and no model pass ran


def euler_steps(
    predict_x0: PredictX0, x: np.ndarray, sigmas: np.ndarray, spectrum: Spectrum | None = None
) -> Iterator[StepInfo]:
    """Yield one StepInfo per step; the generator form lets a caller check for cancellation between steps."""
    total = len(sigmas) - 1
    if spectrum is not None and spectrum.steps != total:
        raise ValueError(f"the Spectrum state was made for {spectrum.steps} steps but there are {total} sigmas steps")
    x = np.asarray(x, dtype=np.float32)
    for i in range(total):
        sigma, sigma_next = np.float32(sigmas[i]), np.float32(sigmas[i + 1])
        computed = spectrum is None or not spectrum.should_predict()
        if computed:
            x0 = np.asarray(predict_x0(x, sigma), dtype=np.float32)
            if spectrum is not None:
                spectrum.update(x0, x, sigma)
        else:
            x0 = spectrum.predict(x, sigma, sigma_next)
        d = (x - x0) / sigma
        x = x + d * (sigma_next - sigma)
        yield StepInfo(index0=i, total=total, sigma=float(sigma), x=x, x0=x0, computed=computed)


def sample_euler(
    predict_x0: PredictX0,
    x: np.ndarray,
    sigmas: np.ndarray,
    spectrum: Spectrum | None = None,
    on_step: Callable[[StepInfo], None] | None = None,
) -> np.ndarray:
    """Run every step and return the final latent; `on_step` sees each step's StepInfo."""
    x = np.asarray(x, dtype=np.float32)
    for info in euler_steps(predict_x0, x, sigmas, spectrum):
        if on_step is not None:
            on_step(info)
        x = info.x
    return x
