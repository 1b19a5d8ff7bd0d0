"""The official Qwen-Image / Wan-2.1 VAE file: its key layout, and a torch-free reader of the decoder half.

Keys are the official Wan names (`decoder.*`, `conv2.*`, no prefix); all widths follow from `base_dim`
(96 in the release), which the reader takes from the tensor shapes. For a single frame every causal
3x3x3 conv sees two zero frames before the real one, so it equals a 2-D 3x3 conv with the last temporal
tap `weight[:, :, 2]`; `time_conv` (temporal upsampling) is never used.
"""

from pathlib import Path

import numpy as np

from anima_ui.errors import UserError
from anima_ui.model.tensor_file import TensorFile
from anima_ui.vae.latent import Z_DIM

DIM_MULT = (1, 2, 4, 4)
NUM_RES_BLOCKS = 2


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


def decoder_levels(d: int) -> list[tuple[int, int, bool]]:
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
    for level, (c_in, c_out, upsample) in enumerate(decoder_levels(d)):
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


def _infer_base_dim(shapes: dict[str, tuple]) -> int:
    head = shapes.get("decoder.head.2.weight")
    if head is None or len(head) < 2:
        raise UserError("VAE file has no decoder.head.2.weight: not a Wan-2.1 / Qwen-Image VAE; "
                        "use vae/qwen_image_vae.safetensors from the Anima release")
    return int(head[1])


def load_decoder_weights(path) -> tuple[int, dict[str, np.ndarray]]:
    """Read the decoder half of an official VAE file (bf16/fp16/fp32) without torch:
    (base_dim, fp32 weights with every conv as its 2-D single-frame form [O, I, kh, kw])."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"VAE file not found: {path}; put qwen_image_vae.safetensors in the model's vae/ folder")
    file = TensorFile(path)
    shapes = file.shapes
    base_dim = _infer_base_dim(shapes)
    expected = decoder_param_shapes(base_dim)
    missing = [k for k in expected if k not in shapes]
    wrong = [f"{k} {shapes[k]} (expected {v})" for k, v in expected.items() if k in shapes and shapes[k] != v]
    if missing or wrong:
        problems = ([f"missing {', '.join(missing[:4])}" + (" ..." if len(missing) > 4 else "")] if missing else []) + \
                   ([f"misshapen {', '.join(wrong[:3])}"] if wrong else [])
        raise UserError(f"VAE file {path.name} is not a Wan-2.1 VAE: {'; '.join(problems)}; "
                        "use vae/qwen_image_vae.safetensors from the Anima release")
    return base_dim, {k: _single_frame(file.read(k)) for k in expected}


def _single_frame(w: np.ndarray) -> np.ndarray:
    """A causal 3-D conv weight [O, I, t, kh, kw] as the 2-D conv it is for one frame: the last temporal tap."""
    return np.ascontiguousarray(w[:, :, -1]) if w.ndim == 5 else w
