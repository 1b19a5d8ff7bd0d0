"""The project's own torch decoder for the Qwen-Image / Wan-2.1 VAE, one image (one latent frame).

For a single frame every causal 3x3x3 conv sees two zero frames before the real one, so it equals a
2-D 3x3 conv with the last temporal tap `weight[:, :, 2]`; `time_conv` (temporal upsampling) is never
used (ComfyUI comfy/ldm/wan/vae.py). Keys are the official Wan names (`decoder.*`, `conv2.*`); all widths follow from
`base_dim` (96 in the release), which the loader reads from the tensor shapes.

Optional tiling reproduces stable-diffusion.cpp's `sd_tiling_calc_tiles` / `process_tiles_2d` /
`sd_tensor_merge_2d`: latent tiles decoded independently and summed with smootherstep weights.
"""

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from anima_ui.errors import UserError
from anima_ui.vae.latent import SCALE, Z_DIM, check_latent, model_to_vae_space, to_uint8

DIM_MULT = (1, 2, 4, 4)
NUM_RES_BLOCKS = 2


# ---------------------------------------------------------------- key layout of the official file

def _residual_shapes(prefix: str, c_in: int, c_out: int) -> dict[str, tuple]:
    shapes = {
        f"{prefix}residual.0.gamma": (c_in, 1, 1, 1),
        f"{prefix}residual.2.weight": (c_out, c_in, 3, 3, 3),
        f"{prefix}residual.2.bias": (c_out,),
        f"{prefix}residual.3.gamma": (c_out, 1, 1, 1),
        f"{prefix}residual.6.weight": (c_out, c_out, 3, 3, 3),
        f"{prefix}residual.6.bias": (c_out,),
    }
    if c_in != c_out:
        shapes[f"{prefix}shortcut.weight"] = (c_out, c_in, 1, 1, 1)
        shapes[f"{prefix}shortcut.bias"] = (c_out,)
    return shapes


def _attention_shapes(prefix: str, c: int) -> dict[str, tuple]:
    return {
        f"{prefix}norm.gamma": (c, 1, 1),
        f"{prefix}to_qkv.weight": (3 * c, c, 1, 1),
        f"{prefix}to_qkv.bias": (3 * c,),
        f"{prefix}proj.weight": (c, c, 1, 1),
        f"{prefix}proj.bias": (c,),
    }


def _resample_shapes(prefix: str, c_in: int, c_out: int, time_conv: tuple | None) -> dict[str, tuple]:
    shapes = {f"{prefix}resample.1.weight": (c_out, c_in, 3, 3), f"{prefix}resample.1.bias": (c_out,)}
    if time_conv is not None:
        shapes[f"{prefix}time_conv.weight"] = time_conv
        shapes[f"{prefix}time_conv.bias"] = (time_conv[0],)
    return shapes


def _encoder_shapes(d: int) -> dict[str, tuple]:
    dims = [d * m for m in (1, *DIM_MULT)]
    shapes = {"encoder.conv1.weight": (d, 3, 3, 3, 3), "encoder.conv1.bias": (d,)}
    index = 0
    for level in range(len(DIM_MULT)):
        c_in, c_out = dims[level], dims[level + 1]
        for _ in range(NUM_RES_BLOCKS):
            shapes |= _residual_shapes(f"encoder.downsamples.{index}.", c_in, c_out)
            c_in, index = c_out, index + 1
        if level != len(DIM_MULT) - 1:
            time_conv = None if level == 0 else (c_out, c_out, 3, 1, 1)  # downsample2d, then downsample3d
            shapes |= _resample_shapes(f"encoder.downsamples.{index}.", c_out, c_out, time_conv)
            index += 1
    top = dims[-1]
    shapes |= _residual_shapes("encoder.middle.0.", top, top)
    shapes |= _attention_shapes("encoder.middle.1.", top)
    shapes |= _residual_shapes("encoder.middle.2.", top, top)
    shapes |= {"encoder.head.0.gamma": (top, 1, 1, 1), "encoder.head.2.weight": (2 * Z_DIM, top, 3, 3, 3),
               "encoder.head.2.bias": (2 * Z_DIM,)}
    return shapes


def _decoder_levels(d: int) -> list[tuple[int, int, bool]]:
    """(input width, width, upsample after this level?) per decoder level; upsampling halves the width."""
    dims = [d * m for m in (DIM_MULT[-1], *reversed(DIM_MULT))]  # 4d, 4d, 4d, 2d, d
    return [(dims[i] // 2 if i > 0 else dims[i], dims[i + 1], i != len(DIM_MULT) - 1) for i in range(len(DIM_MULT))]


def _decoder_shapes(d: int) -> dict[str, tuple]:
    top = d * DIM_MULT[-1]
    shapes = {"decoder.conv1.weight": (top, Z_DIM, 3, 3, 3), "decoder.conv1.bias": (top,)}
    shapes |= _residual_shapes("decoder.middle.0.", top, top)
    shapes |= _attention_shapes("decoder.middle.1.", top)
    shapes |= _residual_shapes("decoder.middle.2.", top, top)
    index = 0
    for level, (c_in, c_out, upsample) in enumerate(_decoder_levels(d)):
        for _ in range(NUM_RES_BLOCKS + 1):
            shapes |= _residual_shapes(f"decoder.upsamples.{index}.", c_in, c_out)
            c_in, index = c_out, index + 1
        if upsample:
            temporal = level < 2  # upsample3d (with time_conv) twice, then upsample2d
            time_conv = (2 * c_out, c_out, 3, 1, 1) if temporal else None
            shapes |= _resample_shapes(f"decoder.upsamples.{index}.", c_out, c_out // 2, time_conv)
            index += 1
    shapes |= {"decoder.head.0.gamma": (d, 1, 1, 1), "decoder.head.2.weight": (3, d, 3, 3, 3),
               "decoder.head.2.bias": (3,)}
    return shapes


def vae_param_shapes(base_dim: int = 96) -> dict[str, tuple]:
    """All 194 tensors of the official VAE file (encoder, decoder, conv1, conv2) with their shapes."""
    return {
        **_encoder_shapes(base_dim),
        **_decoder_shapes(base_dim),
        "conv1.weight": (2 * Z_DIM, 2 * Z_DIM, 1, 1, 1), "conv1.bias": (2 * Z_DIM,),
        "conv2.weight": (Z_DIM, Z_DIM, 1, 1, 1), "conv2.bias": (Z_DIM,),
    }


def decoder_param_shapes(base_dim: int = 96) -> dict[str, tuple]:
    """The tensors the single-image decoder reads (`decoder.*` without `time_conv`, and `conv2.*`)."""
    return {k: v for k, v in vae_param_shapes(base_dim).items()
            if (k.startswith("decoder.") and ".time_conv." not in k) or k.startswith("conv2.")}


# ---------------------------------------------------------------- loading

def _infer_base_dim(shapes: dict[str, tuple]) -> int:
    head = shapes.get("decoder.head.2.weight")
    if head is None or len(head) < 2:
        raise UserError("VAE file has no decoder.head.2.weight: not a Wan-2.1 / Qwen-Image VAE; "
                        "use vae/qwen_image_vae.safetensors from the Anima release")
    return int(head[1])


def load_vae_decoder(path) -> "WanDecoder":
    """Read the decoder half of an official VAE file (bf16/fp16/fp32 safetensors) into fp32."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise UserError(f"VAE file not found: {path}; put qwen_image_vae.safetensors in the model's vae/ folder")
    try:
        handle = safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as exc:
        raise UserError(f"cannot read VAE file {path} ({exc}); re-download it") from exc
    with handle:
        shapes = {k: tuple(handle.get_slice(k).get_shape()) for k in handle.keys()}
        base_dim = _infer_base_dim(shapes)
        expected = decoder_param_shapes(base_dim)
        missing = [k for k in expected if k not in shapes]
        wrong = [f"{k} {shapes[k]} (expected {v})" for k, v in expected.items() if k in shapes and shapes[k] != v]
        if missing or wrong:
            problems = ([f"missing {', '.join(missing[:4])}" + (" ..." if len(missing) > 4 else "")] if missing else []) + \
                       ([f"misshapen {', '.join(wrong[:3])}"] if wrong else [])
            raise UserError(f"VAE file {path.name} is not a Wan-2.1 VAE: {'; '.join(problems)}; "
                            "use vae/qwen_image_vae.safetensors from the Anima release")
        weights = {k: handle.get_tensor(k).float() for k in expected}
    return WanDecoder(weights, base_dim)


# ---------------------------------------------------------------- the network (single frame, 2-D)

def _conv_weight(w: torch.Tensor) -> torch.Tensor:
    """A causal 3-D conv weight as the 2-D conv it is for one frame: the last temporal tap."""
    return w[:, :, -1] if w.dim() == 5 else w


def _rms_norm(x: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    scale = x.shape[1] ** 0.5
    return F.normalize(x, dim=1) * scale * gamma.reshape(1, -1, 1, 1)


class WanDecoder:
    """Weights as 2-D convs; `forward` maps a raw (VAE-space) latent [1,16,h,w] to [1,3,8h,8w] in ~[-1,1]."""

    def __init__(self, weights: dict[str, torch.Tensor], base_dim: int):
        self.base_dim = base_dim
        self.w = {k: _conv_weight(v).contiguous() for k, v in weights.items()}

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
        for _, _, upsample in _decoder_levels(self.base_dim):
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


# ---------------------------------------------------------------- sd.cpp tiling

@dataclass(frozen=True)
class TileAxis:
    count: int
    overlap_factor: float


def tile_axis(length: int, tile: int, overlap_factor: float) -> TileAxis:
    """sd.cpp `sd_tiling_calc_tiles` (non-circular): how many tiles along one latent axis, and the
    overlap they end up with."""
    tile_overlap = int(tile * overlap_factor)
    step = tile - tile_overlap
    count = (length - tile_overlap) // step
    overshoot = ((count + 1) * step + tile_overlap) % length
    if overshoot != step and overshoot <= count * (tile // 2 - tile_overlap):
        count += 1  # room for one more tile without the overlap exceeding 0.5
    if count <= 2:
        if length <= tile:
            return TileAxis(1, 0.0)
        return TileAxis(2, float(np.float32(2 * tile - length) / np.float32(tile)))
    return TileAxis(count, float(np.float32(tile * count - length) / np.float32(tile * (count - 1))))


def tile_size(requested: int, length: int) -> int:
    """sd.cpp `VAE::get_tile_sizes`: at least 4 latent pixels, at most the latent size."""
    return max(min(requested if requested >= 4 else 32, length), 4)


def _smootherstep(t: np.ndarray) -> np.ndarray:
    return t * t * t * (t * (6.0 * t - 15.0) + 10.0)


def _ramp(size: int, skip: int, overlap: int, has_before: bool, has_after: bool) -> np.ndarray:
    """Blend weight along one axis of an output tile, as in sd.cpp `sd_tensor_merge_2d`."""
    i = np.arange(size, dtype=np.float32)
    f = np.ones(size, dtype=np.float32)
    if has_before:
        f = np.minimum(f, (i - skip) / np.float32(overlap))
    if has_after:
        f = np.minimum(f, (size - i) / np.float32(overlap))
    return _smootherstep(np.minimum(f, 1.0))


def _tile_origins(length: int, tile: int, step: int) -> list[tuple[int, int]]:
    """(origin, skip) per tile along one axis: the last tile is moved back to end at the border and its
    first `skip` output rows, already covered, are not accumulated again (sd.cpp `process_tiles_2d`)."""
    origins, pos = [], 0
    while pos < length:
        if pos + tile >= length:
            origins.append((length - tile, pos - (length - tile)))
            break
        origins.append((pos, 0))
        pos += step
    return origins


def decode_tiled(decode_raw, raw_latent: np.ndarray, tile: int = 32, overlap: float = 0.5) -> np.ndarray:
    """Decode [1,16,h,w] tile by tile with `decode_raw` ([1,16,th,tw] -> [1,3,8th,8tw] in ~[-1,1]) and
    blend exactly like sd.cpp's tiled VAE decode. Returns [1,3,8h,8w] (not clamped)."""
    _, _, h, w = raw_latent.shape
    overlap = min(max(overlap, 0.0), 0.5)
    tile_x, tile_y = tile_size(tile, w), tile_size(tile, h)
    axis_x, axis_y = tile_axis(w, tile_x, overlap), tile_axis(h, tile_y, overlap)
    # float32 products, truncated, as in C
    overlap_x = int(np.float32(tile_x) * np.float32(axis_x.overlap_factor))
    overlap_y = int(np.float32(tile_y) * np.float32(axis_y.overlap_factor))
    out = np.zeros((1, 3, h * SCALE, w * SCALE), dtype=np.float32)
    for y, skip_y in _tile_origins(h, tile_y, tile_y - overlap_y):
        for x, skip_x in _tile_origins(w, tile_x, tile_x - overlap_x):
            pixels = decode_raw(np.ascontiguousarray(raw_latent[:, :, y:y + tile_y, x:x + tile_x]))
            oy, ox, th, tw = y * SCALE, x * SCALE, tile_y * SCALE, tile_x * SCALE
            sy, sx = skip_y * SCALE, skip_x * SCALE
            if overlap_x == 0 and overlap_y == 0:
                out[:, :, oy + sy:oy + th, ox + sx:ox + tw] = pixels[:, :, sy:, sx:]
                continue
            weight_y = _ramp(th, sy, overlap_y * SCALE, overlap_y > 0 and oy > 0, overlap_y > 0 and oy < h * SCALE - th)
            weight_x = _ramp(tw, sx, overlap_x * SCALE, overlap_x > 0 and ox > 0, overlap_x > 0 and ox < w * SCALE - tw)
            weight = weight_y[sy:, None] * weight_x[None, sx:]
            out[:, :, oy + sy:oy + th, ox + sx:ox + tw] += pixels[:, :, sy:, sx:] * weight
    return out
