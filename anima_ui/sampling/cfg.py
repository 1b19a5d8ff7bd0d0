"""Classifier-free guidance on denoised predictions (ComfyUI's `cfg_function`; the same as CFG on velocities)."""

import numpy as np


def cfg_combine(x0_cond: np.ndarray, x0_uncond: np.ndarray, cfg: float) -> np.ndarray:
    """x0_u + cfg·(x0_c − x0_u), float32. At cfg == 1 this is x0_c, so callers skip the uncond pass instead."""
    cond = np.asarray(x0_cond, dtype=np.float32)
    uncond = np.asarray(x0_uncond, dtype=np.float32)
    return uncond + np.float32(cfg) * (cond - uncond)


def cfg_x0_predictor(velocity, cfg: float):
    """predict_x0(x, sigma) for the Euler sampler from a flow model `velocity(xs [B,...], sigmas [B]) -> v`:
    x0 = x - sigma * v for cond and uncond in one batch of 2, CFG-combined; at cfg == 1 only cond (batch 1)."""
    batch = 1 if cfg == 1.0 else 2

    def predict_x0(x, sigma):
        xs = np.repeat(np.asarray(x, np.float32), batch, axis=0)
        x0 = xs - np.float32(sigma) * velocity(xs, np.full(batch, sigma, np.float32))
        return cfg_combine(x0[:1], x0[1:], cfg) if batch == 2 else x0

    return predict_x0
