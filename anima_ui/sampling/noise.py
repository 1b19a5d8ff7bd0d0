"""The initial latent noise, drawn exactly as ComfyUI and diffusers draw it so a seed means the same image.

torch's CPU generator is the only source of these numbers (NumPy cannot reproduce them), so this is the one place
sampling imports torch.
"""

import numpy as np

from anima_ui.errors import UserError
from anima_ui.limits import MAX_SEED

LATENT_CHANNELS = 16
VAE_STRIDE = 8


def initial_noise(seed: int, height: int, width: int) -> np.ndarray:
    """float32 [1, 16, height/8, width/8]: `torch.randn((1, 16, 1, h, w), generator=Generator("cpu").manual_seed(seed))`
    with the single video frame squeezed out."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed <= MAX_SEED:
        raise UserError(f"seed must be a whole number from 0 to {MAX_SEED}, got {seed!r}")
    for name, side in (("height", height), ("width", width)):
        if isinstance(side, bool) or not isinstance(side, (int, np.integer)) or side <= 0 or side % VAE_STRIDE:
            raise UserError(f"{name} must be a positive multiple of {VAE_STRIDE} pixels, got {side!r}")
    import torch  # here, not at the top: the rest of sampling (and anima-ui spectrum-plan) runs without torch

    generator = torch.Generator("cpu").manual_seed(int(seed))
    noise = torch.randn((1, LATENT_CHANNELS, 1, height // VAE_STRIDE, width // VAE_STRIDE), generator=generator)
    return noise[:, :, 0].numpy().astype(np.float32, copy=False)
