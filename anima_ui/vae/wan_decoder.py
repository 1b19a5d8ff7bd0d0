"""The project's own torch decoder for the Qwen-Image / Wan-2.1 VAE, one image (one latent frame): the
reference the graph decoder (onnx_decoder.py) is tested against. Key layout and the single-frame reading
of the weights: weights.py; sd.cpp's tiling: tiling.py.
"""

import numpy as np
import torch
import torch.nn.functional as F

from anima_ui.vae.latent import check_latent, model_to_vae_space, to_uint8
from anima_ui.vae.tiling import decode_tiled
from anima_ui.vae.weights import NUM_RES_BLOCKS, decoder_levels, load_decoder_weights


def load_vae_decoder(path) -> "WanDecoder":
    """Read the decoder half of an official VAE file (bf16/fp16/fp32 safetensors) into fp32."""
    base_dim, weights = load_decoder_weights(path)
    return WanDecoder({k: torch.from_numpy(v) for k, v in weights.items()}, base_dim)


# ---------------------------------------------------------------- the network (single frame, 2-D)

def _rms_norm(x: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    scale = x.shape[1] ** 0.5
    return F.normalize(x, dim=1) * scale * gamma.reshape(1, -1, 1, 1)


class WanDecoder:
    """Weights as 2-D convs (load_decoder_weights); `forward` maps a raw (VAE-space) latent [1,16,h,w] to [1,3,8h,8w] in ~[-1,1]."""

    def __init__(self, weights: dict[str, torch.Tensor], base_dim: int):
        self.base_dim = base_dim
        self.w = weights

    def _conv(self, x, prefix, padding):
        return F.conv2d(x, self.w[prefix + "weight"], self.w[prefix + "bias"], padding=padding)

    def _residual(self, x, prefix):
        h = self._conv(F.silu(_rms_norm(x, self.w[prefix + "residual.0.gamma"])), prefix + "residual.2.", 1)
        h = self._conv(F.silu(_rms_norm(h, self.w[prefix + "residual.3.gamma"])), prefix + "residual.6.", 1)
        shortcut = self._conv(x, prefix + "shortcut.", 0) if prefix + "shortcut.weight" in self.w else x
        return h + shortcut

    def _attention(self, x, prefix):
        b, c, h, w = x.shape
        qkv = self._conv(_rms_norm(x, self.w[prefix + "norm.gamma"]), prefix + "to_qkv.", 0)
        q, k, v = qkv.reshape(b, 3, c, h * w).permute(1, 0, 3, 2).unsqueeze(2)  # each [b, 1 head, hw, c]
        out = F.scaled_dot_product_attention(q, k, v).squeeze(1).permute(0, 2, 1).reshape(b, c, h, w)
        return self._conv(out, prefix + "proj.", 0) + x

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        x = self._conv(z, "conv2.", 0)
        x = self._conv(x, "decoder.conv1.", 1)
        x = self._residual(x, "decoder.middle.0.")
        x = self._attention(x, "decoder.middle.1.")
        x = self._residual(x, "decoder.middle.2.")
        index = 0
        for _, _, upsample in decoder_levels(self.base_dim):
            for _ in range(NUM_RES_BLOCKS + 1):
                x = self._residual(x, f"decoder.upsamples.{index}.")
                index += 1
            if upsample:
                x = F.interpolate(x, scale_factor=2.0, mode="nearest-exact")
                x = self._conv(x, f"decoder.upsamples.{index}.resample.1.", 1)
                index += 1
        x = F.silu(_rms_norm(x, self.w["decoder.head.0.gamma"]))
        return self._conv(x, "decoder.head.2.", 1)

    def decode_float(self, latent: np.ndarray, tiled: bool = False, tile: int = 32, overlap: float = 0.5) -> np.ndarray:
        """Model-space latent [1,16,h,w] -> float image [H,W,3] in [0,1]."""
        raw = model_to_vae_space(check_latent(latent))
        with torch.inference_mode():
            if tiled:
                out = decode_tiled(lambda t: self.forward(torch.from_numpy(t)).numpy(), raw, tile, overlap)
            else:
                out = self.forward(torch.from_numpy(raw)).numpy()
        return np.clip((out[0].transpose(1, 2, 0) + 1.0) / 2.0, 0.0, 1.0)

    def decode(self, latent: np.ndarray, tiled: bool = False, tile: int = 32, overlap: float = 0.5) -> np.ndarray:
        """Model-space latent [1,16,h,w] -> uint8 RGB [8h, 8w, 3]."""
        return to_uint8(self.decode_float(latent, tiled, tile, overlap))
