"""Shared by the VAE tests: random VAE files in the official layout and the diffusers oracle."""

import numpy as np
import torch
from safetensors.torch import save_file

from anima_ui.fixtures.weights import random_vae_state
from anima_ui.vae.latent import model_to_vae_space


def write_vae_file(path, base_dim: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A random VAE written like the release file (194 Wan keys, bf16); returns the bf16-rounded fp32 state."""
    state = {k: torch.from_numpy(v).to(torch.bfloat16) for k, v in random_vae_state(base_dim, seed).items()}
    save_file(state, str(path))
    return {k: v.float().numpy() for k, v in state.items()}


SMALL_VAE_DIM = 16  # base width of the random VAE the decoder tests share (the release file's is 96)


def small_vae_file(tmp_path_factory) -> tuple:
    """(path, bf16-rounded fp32 state) of a random small VAE in the release file's layout, for a module fixture."""
    path = tmp_path_factory.mktemp("vae") / "qwen_image_vae.safetensors"
    return path, write_vae_file(path, SMALL_VAE_DIM)


def diffusers_decode(state: dict[str, np.ndarray], base_dim: int, latent: np.ndarray) -> np.ndarray:
    """diffusers' AutoencoderKLQwenImage on the same weights (keys mapped by diffusers' own Wan conversion):
    model-space latent [1,16,h,w] -> float image [H,W,3] in [0,1]."""
    from diffusers import AutoencoderKLQwenImage
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    model = AutoencoderKLQwenImage(base_dim=base_dim).eval()
    converted = convert_wan_vae_to_diffusers({k: torch.from_numpy(v) for k, v in state.items()})
    model.load_state_dict(converted, strict=True)
    raw = torch.from_numpy(model_to_vae_space(latent))[:, :, None]  # [1,16,1,h,w]
    with torch.inference_mode():
        out = model.decode(raw).sample[0, :, 0].numpy()
    return np.clip((out.transpose(1, 2, 0) + 1.0) / 2.0, 0.0, 1.0)


def random_latent(h: int, w: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, 16, h, w)).astype(np.float32)
