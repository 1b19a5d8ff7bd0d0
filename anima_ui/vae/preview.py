"""Cheap step previews: the per-pixel latent -> RGB projection, or the taew2_1 tiny decoder when its
file is in the model folder.

Projection choice: ComfyUI's `Wan21.latent_rgb_factors` (comfy/latent_formats.py), not sd.cpp's
`wan_21_latent_rgb_proj` (src/runtime/latent-preview.h). Both map the same normalised (model-space)
latent with the same (rgb + 1) / 2 convention, and neither can be checked here: with no real VAE
weights a PSNR against a decode is meaningless. ComfyUI is Anima's reference implementation
(co-released with Comfy Org, which ships these factors for every Wan-2.1-latent model including
Qwen-Image and Anima), so its previews are the ones Anima users know; the sd.cpp matrix's
provenance is not stated anywhere (presumed trained by the PR author). Both are kept so the
benchmark can report how far apart they are.
"""

from pathlib import Path

import numpy as np
from PIL import Image

from anima_ui.vae.latent import check_latent, to_uint8
from anima_ui.vae.taehv import load_taehv_decoder

# [16 latent channels, RGB]
COMFYUI_WAN21_FACTORS = np.array([
    [-0.1299, -0.1692, 0.2932], [0.0671, 0.0406, 0.0442], [0.3568, 0.2548, 0.1747], [0.0372, 0.2344, 0.1420],
    [0.0313, 0.0189, -0.0328], [0.0296, -0.0956, -0.0665], [-0.3477, -0.4059, -0.2925], [0.0166, 0.1902, 0.1975],
    [-0.0412, 0.0267, -0.1364], [-0.1293, 0.0740, 0.1636], [0.0680, 0.3019, 0.1128], [0.0032, 0.0581, 0.0639],
    [-0.1251, 0.0927, 0.1699], [0.0060, -0.0633, 0.0005], [0.3477, 0.2275, 0.2950], [0.1984, 0.0913, 0.1861],
], np.float32)
COMFYUI_WAN21_BIAS = np.array([-0.1835, -0.0868, -0.3360], np.float32)

SDCPP_WAN21_FACTORS = np.array([
    [0.015123, -0.148418, 0.479828], [0.003652, -0.010680, -0.037142], [0.212264, 0.063033, 0.016779],
    [0.232999, 0.406476, 0.220125], [-0.051864, -0.082384, -0.069396], [0.085005, -0.161492, 0.010689],
    [-0.245369, -0.506846, -0.117010], [-0.151145, 0.017721, 0.007207], [-0.293239, -0.207936, -0.421135],
    [-0.187721, 0.050783, 0.177649], [-0.013067, 0.265964, 0.166578], [0.028327, 0.109329, 0.108642],
    [-0.205343, 0.043991, 0.148914], [0.014307, -0.048647, -0.007219], [0.217150, 0.053074, 0.319923],
    [0.155357, 0.083156, 0.064780],
], np.float32)
SDCPP_WAN21_BIAS = np.array([-0.270270, -0.234976, -0.456853], np.float32)

PROJECTIONS = {"comfyui": (COMFYUI_WAN21_FACTORS, COMFYUI_WAN21_BIAS),
               "sdcpp": (SDCPP_WAN21_FACTORS, SDCPP_WAN21_BIAS)}


def latent_to_rgb(x0, projection: str = "comfyui") -> np.ndarray:
    """Model-space x0 [1,16,h,w] -> uint8 [h,w,3]: rgb = x0 . F + b, pixel = clamp((rgb + 1) / 2)."""
    factors, bias = PROJECTIONS[projection]
    latent = check_latent(x0)[0]
    rgb = np.tensordot(latent, factors, axes=([0], [0])) + bias  # [h, w, 3]
    return to_uint8((rgb + 1.0) * 0.5)


def preview_image(x0, size: int, taesd_path=None) -> Image.Image:
    """A display preview whose longer side is `size` pixels: the projection upscaled bilinearly, or the
    taew2_1 decode (8x the latent) resized when `taesd_path` names an existing file."""
    if taesd_path is not None and Path(taesd_path).is_file():
        image = Image.fromarray(load_taehv_decoder(taesd_path).decode(x0), "RGB")
    else:
        image = Image.fromarray(latent_to_rgb(x0), "RGB")
    scale = size / max(image.size)
    target = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
    return image if target == image.size else image.resize(target, Image.Resampling.BILINEAR)
