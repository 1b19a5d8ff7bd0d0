"""The sigma schedule: ComfyUI's "simple" scheduler over Anima's shifted 1000-entry flow table.

Anima is a flow model (x_σ = σ·ε + (1 − σ)·x0) trained with shift 3; ComfyUI's `ModelSamplingDiscreteFlow` keeps a
float32 table `sigmas[k] = shift·t/(1 + (shift − 1)·t)`, t = (k + 1)/1000, and "simple" picks evenly spaced entries
from its top end.
"""

import numpy as np

from anima_ui.errors import UserError
from anima_ui.limits import check_steps

TABLE_SIZE = 1000  # more steps than table entries would only repeat entries: limits.MAX_STEPS stays below it


def shifted_sigma_table(shift: float = 3.0) -> np.ndarray:
    """ComfyUI's table, computed in float32 like torch does: `time_snr_shift(shift, arange(1, 1001) / 1000)`."""
    t = np.arange(1, TABLE_SIZE + 1, dtype=np.float32) / np.float32(TABLE_SIZE)
    if shift == 1.0:
        return t
    shift32 = np.float32(shift)
    return shift32 * t / (np.float32(1.0) + (shift32 - np.float32(1.0)) * t)


def simple_sigmas(steps: int, shift: float = 3.0) -> np.ndarray:
    """`steps` sigmas from 1 down, then a trailing 0: σ_k = table[999 − int(k·1000/steps)] (float32, steps + 1 values)."""
    check_steps(steps)
    if not np.isfinite(shift) or shift <= 0:
        raise UserError(f"the schedule shift must be a positive number, got {shift!r}")
    table = shifted_sigma_table(shift)
    stride = TABLE_SIZE / steps  # a Python float, as in ComfyUI, so int(k·stride) truncates identically
    picked = [table[-(1 + int(k * stride))] for k in range(steps)]
    return np.array(picked + [0.0], dtype=np.float32)
