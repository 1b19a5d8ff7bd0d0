"""madebyollin's taew2_1 (TAEHV) tiny decoder as a sharper step preview, for one latent frame.

It takes the MODEL-space latent (TAEHV "decodes exactly what diffusion models use", madebyollin/taehv README). The
reference decodes one latent frame into 4 frames (two stride-2 TGrow layers) and trims the first 3;
here only what the kept last frame depends on is computed: both frames of the middle stage (the
second one's MemBlocks read the first as memory), then only the last TGrow slice of the second.
"""

from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from anima_ui.errors import UserError
from anima_ui.vae.latent import Z_DIM, check_latent, to_uint8

N_F = (256, 128, 64, 64)
MEMBLOCKS = ((3, 4, 5), (9, 10, 11), (15, 16, 17))
PREFIXES = ("decoder.", "taehv_decoder.")  # madebyollin's file / ComfyUI-converted files


def _memblock_shapes(index: int, c: int) -> dict[str, tuple]:
    return {f"{index}.conv.0.weight": (c, 2 * c, 3, 3), f"{index}.conv.0.bias": (c,),
            f"{index}.conv.2.weight": (c, c, 3, 3), f"{index}.conv.2.bias": (c,),
            f"{index}.conv.4.weight": (c, c, 3, 3), f"{index}.conv.4.bias": (c,)}


def taehv_decoder_shapes() -> dict[str, tuple]:
    """The taew2_1 decoder tensors (as madebyollin/taehv's taehv.py names them), without the `decoder.` prefix."""
    shapes = {"1.weight": (N_F[0], Z_DIM, 3, 3), "1.bias": (N_F[0],)}
    for level, indices in enumerate(MEMBLOCKS):
        for index in indices:
            shapes |= _memblock_shapes(index, N_F[level])
        grow, proj = indices[-1] + 2, indices[-1] + 3  # TGrow 1x1 conv, then the 3x3 projection
        stride = 1 if level == 0 else 2
        shapes[f"{grow}.conv.weight"] = (N_F[level] * stride, N_F[level], 1, 1)
        shapes[f"{proj}.weight"] = (N_F[level + 1], N_F[level], 3, 3)
    shapes |= {"22.weight": (3, N_F[3], 3, 3), "22.bias": (3,)}
    return shapes


class TaehvDecoder:
    def __init__(self, weights: dict[str, torch.Tensor]):
        self.w = weights

    def _conv(self, x, name):
        weight = self.w[f"{name}.weight"]
        return F.conv2d(x, weight, self.w.get(f"{name}.bias"), padding=weight.shape[-1] // 2)

    def _memblock(self, x, past, index):
        h = F.relu(self._conv(torch.cat([x, past], 1), f"{index}.conv.0"))
        h = F.relu(self._conv(h, f"{index}.conv.2"))
        return F.relu(self._conv(h, f"{index}.conv.4") + x)

    def _memblocks(self, frames, indices):
        """frames: [T, C, H, W], consecutive frames of one video; each block's memory is its own input
        one frame earlier (zeros for the first)."""
        for index in indices:
            past = torch.cat([torch.zeros_like(frames[:1]), frames[:-1]], 0)
            frames = self._memblock(frames, past, index)
        return frames

    def forward_last_frame(self, z: torch.Tensor) -> torch.Tensor:
        """[1,16,h,w] model-space latent -> the kept (last) frame [1,3,8h,8w] in [0,1]."""
        x = F.relu(self._conv(torch.tanh(z / 3.0) * 3.0, "1"))
        x = self._memblocks(x, MEMBLOCKS[0])
        x = F.conv2d(F.interpolate(x, scale_factor=2.0, mode="nearest"), self.w["7.conv.weight"])  # TGrow stride 1
        x = self._conv(x, "8")
        x = self._memblocks(x, MEMBLOCKS[1])
        x = F.conv2d(F.interpolate(x, scale_factor=2.0, mode="nearest"), self.w["13.conv.weight"])
        x = x.reshape(2, N_F[1], *x.shape[-2:])  # TGrow stride 2: channel halves are frames 0 and 1
        x = self._conv(x, "14")
        x = self._memblocks(x, MEMBLOCKS[2])
        x = F.interpolate(x[1:], scale_factor=2.0, mode="nearest")
        x = F.conv2d(x, self.w["19.conv.weight"][-N_F[2]:])  # the last of the two frames it grows
        x = F.relu(self._conv(x, "20"))
        return self._conv(x, "22").clamp(0.0, 1.0)

    def decode(self, x0) -> np.ndarray:
        """Model-space x0 [1,16,h,w] -> uint8 RGB [8h, 8w, 3]."""
        latent = torch.from_numpy(check_latent(x0))
        with torch.inference_mode():
            image = self.forward_last_frame(latent)[0].permute(1, 2, 0).numpy()
        return to_uint8(image)


def load_taehv_decoder(path) -> TaehvDecoder:
    path = Path(path)
    return _load_cached(str(path.resolve()), path.stat().st_mtime_ns)


@lru_cache(maxsize=1)  # previews decode every step with the same file
def _load_cached(path: str, _mtime_ns: int) -> TaehvDecoder:
    from safetensors import SafetensorError, safe_open

    try:
        handle = safe_open(path, framework="pt")
    except (SafetensorError, OSError) as exc:
        raise UserError(f"cannot read the preview decoder {path} ({exc}); re-download taew2_1.safetensors") from exc
    with handle:
        names = set(handle.keys())
        prefix = next((p for p in PREFIXES if f"{p}1.weight" in names), None)
        if prefix is None:
            raise UserError(f"{Path(path).name} has no decoder.1.weight: not a TAEHV file; "
                            "use madebyollin's taew2_1.safetensors in vae_approx/")
        weights, problems = {}, []
        for key, shape in taehv_decoder_shapes().items():
            if prefix + key not in names:
                problems.append(f"missing {prefix}{key}")
                continue
            tensor = handle.get_tensor(prefix + key).float()
            if key.endswith("conv.weight") and tensor.shape[0] > shape[0]:
                tensor = tensor[-shape[0]:]  # a TGrow with more time steps: keep the last (as patch_tgrow_layers)
            if tuple(tensor.shape) != shape:
                problems.append(f"misshapen {prefix}{key} {tuple(tensor.shape)} (expected {shape})")
            weights[key] = tensor
    if problems:
        raise UserError(f"{Path(path).name} is not a taew2_1 decoder: {'; '.join(problems[:3])}; "
                        "use madebyollin's taew2_1.safetensors in vae_approx/")
    return TaehvDecoder(weights)
