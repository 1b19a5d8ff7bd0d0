"""Classifier-free guidance on denoised predictions (ComfyUI's `cfg_function`; the same as CFG on velocities)."""

import numpy as np


def cfg_combine(x0_cond: np.ndarray, x0_uncond: np.ndarray, cfg: float) -> np.ndarray:
    """x0_u + cfg·(x0_c − x0_u), float32. At cfg == 1 this is x0_c, so callers skip the uncond pass instead."""
    cond = np.asarray(x0_cond, dtype=np.float32)
    uncond = np.asarray(x0_uncond, dtype=np.float32)
    return uncond + np.float32(cfg) * (cond - uncond)
