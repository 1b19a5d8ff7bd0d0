"""Latent checks and the model-space <-> VAE-space conversion shared by every decoder (no torch)."""

import numpy as np

from anima_ui.errors import UserError

Z_DIM = 16
SCALE = 8  # pixels per latent pixel

# Wan-2.1 latent normalisation (ComfyUI comfy/latent_formats.py Wan21; diffusers' AutoencoderKLQwenImage defaults):
# model space = (raw - mean) / std
LATENTS_MEAN = np.array([-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                         0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921], np.float32)
LATENTS_STD = np.array([2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                        3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160], np.float32)


def check_latent(latent) -> np.ndarray:
    """A model-space latent [1,16,h,w] as contiguous float32; UserError on a wrong shape or NaN/Inf."""
    latent = np.asarray(latent)
    if latent.ndim != 4 or latent.shape[:2] != (1, Z_DIM):
        raise UserError(f"latent has shape {latent.shape}, expected [1, 16, h, w]; pass the sampler's latent")
    if not np.isfinite(latent).all():
        raise UserError("latent contains NaN or Inf: sampling diverged; lower CFG or change the seed and retry")
    return np.ascontiguousarray(latent, dtype=np.float32)


def model_to_vae_space(latent: np.ndarray) -> np.ndarray:
    """ComfyUI's Wan21.process_out (= sd.cpp's diffusion_to_vae_latents): sampler space -> VAE space."""
    return latent * LATENTS_STD.reshape(1, -1, 1, 1) + LATENTS_MEAN.reshape(1, -1, 1, 1)


def to_uint8(image: np.ndarray) -> np.ndarray:
    """[0,1] floats -> uint8 with sd.cpp's rounding (x*255 + 0.5, truncated)."""
    return (np.clip(image, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)
