"""madebyollin's taew2_1 (TAEHV) tiny decoder as a sharper step preview, for one latent frame, without torch:
an ONNX graph built from the safetensors with onnx.helper and run by onnxruntime.

It takes the MODEL-space latent (TAEHV "decodes exactly what diffusion models use", madebyollin/taehv README). The
reference decodes one latent frame into 4 frames (two stride-2 TGrow layers) and trims the first 3;
here only what the kept last frame depends on is computed: both frames of the middle stage (the
second one's MemBlocks read the first as memory), then only the last TGrow slice of the second.
A MemBlock's memory is its own input one frame earlier, zeros for the first frame: with zero memory only the
first half of its first conv's input channels contributes, so that conv takes only that half of the weight.
"""

from functools import lru_cache
from pathlib import Path

import numpy as np

from anima_ui.errors import UserError
from anima_ui.model.tensor_file import TensorFile
from anima_ui.vae.latent import Z_DIM, check_latent, to_uint8
from anima_ui.vae.onnx_decoder import ort_session
from anima_ui.vae.onnx_nodes import GraphBuilder

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


def build_taehv_graph(w: dict[str, np.ndarray], height: int, width: int):
    """The last-frame decoder for a [1,16,height,width] model-space latent -> [1,3,8·height,8·width] in [0,1]."""
    g = GraphBuilder()

    def conv(x, name, weight=None):
        weight = w[f"{name}.weight"] if weight is None else weight
        bias = f"{name}.bias"
        pad = weight.shape[-1] // 2
        inputs = [x, g.const(weight, f"w{name}")] + ([g.const(w[bias], f"b{name}")] if bias in w else [])
        return g.op("Conv", *inputs, pads=[pad] * 4)

    def memblock(x, past, index):
        """past None: the first frame, whose memory is zeros."""
        first = w[f"{index}.conv.0.weight"]
        if past is None:
            h = conv(x, f"{index}.conv.0", first[:, : first.shape[1] // 2])
        else:
            h = conv(g.op("Concat", x, past, axis=1), f"{index}.conv.0")
        h = conv(g.op("Relu", h), f"{index}.conv.2")
        return g.op("Relu", g.op("Add", conv(g.op("Relu", h), f"{index}.conv.4"), x))

    def upsample(x):  # torch's nearest x2: out[i] = in[floor(i / 2)]
        return g.op("Resize", x, "", g.const(np.array([1, 1, 2, 2], np.float32), "scales"), mode="nearest",
                    coordinate_transformation_mode="asymmetric", nearest_mode="floor")

    three = g.const(np.float32(3.0), "three")
    x = g.op("Relu", conv(g.op("Mul", g.op("Tanh", g.op("Div", "latent", three)), three), "1"))
    for index in MEMBLOCKS[0]:
        x = memblock(x, None, index)
    x = conv(conv(upsample(x), "7.conv"), "8")  # TGrow stride 1, then the projection
    for index in MEMBLOCKS[1]:
        x = memblock(x, None, index)
    grow = upsample(x)
    # TGrow stride 2: the first half of its output channels is frame 0, the second frame 1
    frames = [conv(conv(grow, "13.conv", half), "14") for half in np.split(w["13.conv.weight"], 2)]
    for i, index in enumerate(MEMBLOCKS[2]):
        last = i == len(MEMBLOCKS[2]) - 1  # the first frame's output of the last block feeds nothing
        frames = [None if last else memblock(frames[0], None, index), memblock(frames[1], frames[0], index)]
    x = conv(upsample(frames[1]), "19.conv", w["19.conv.weight"][-N_F[2]:])  # the last of the two frames it grows
    x = conv(g.op("Relu", conv(x, "20")), "22")
    g.op("Clip", x, g.const(np.float32(0.0), "zero"), g.const(np.float32(1.0), "one"), out="image")
    return g.model([("latent", (1, Z_DIM, height, width))], [("image", (1, 3, 8 * height, 8 * width))], "taew2_1_last_frame")


class TaehvDecoder:
    """The decoder weights of one taew2_1 file; one onnxruntime session per latent size, built on first use."""

    def __init__(self, weights: dict[str, np.ndarray]):
        self.w = weights
        self._sessions = {}

    def decode(self, x0) -> np.ndarray:
        """Model-space x0 [1,16,h,w] -> uint8 RGB [8h, 8w, 3]."""
        latent = np.ascontiguousarray(check_latent(x0), dtype=np.float32)
        size = latent.shape[-2:]
        if size not in self._sessions:
            self._sessions[size] = ort_session(build_taehv_graph(self.w, *size))
        image = self._sessions[size].run(None, {"latent": latent})[0]
        return to_uint8(image[0].transpose(1, 2, 0))


def load_taehv_decoder(path) -> TaehvDecoder:
    path = Path(path)
    return _load_cached(str(path.resolve()), path.stat().st_mtime_ns)


@lru_cache(maxsize=1)  # previews decode every step with the same file
def _load_cached(path: str, _mtime_ns: int) -> TaehvDecoder:
    try:
        file = TensorFile(path)
    except UserError as exc:
        raise UserError(f"cannot read the preview decoder {path} ({exc}); re-download taew2_1.safetensors") from None
    prefix = next((p for p in PREFIXES if f"{p}1.weight" in file.entries), None)
    if prefix is None:
        raise UserError(f"{Path(path).name} has no decoder.1.weight: not a TAEHV file; "
                        "use madebyollin's taew2_1.safetensors in vae_approx/")
    weights, problems = {}, []
    for key, shape in taehv_decoder_shapes().items():
        if prefix + key not in file.entries:
            problems.append(f"missing {prefix}{key}")
            continue
        tensor = file.read(prefix + key)
        if key.endswith("conv.weight") and tensor.shape[0] > shape[0]:
            tensor = tensor[-shape[0]:]  # a TGrow with more time steps: keep the last (as patch_tgrow_layers)
        if tuple(tensor.shape) != shape:
            problems.append(f"misshapen {prefix}{key} {tuple(tensor.shape)} (expected {shape})")
        weights[key] = np.ascontiguousarray(tensor)
    if problems:
        raise UserError(f"{Path(path).name} is not a taew2_1 decoder: {'; '.join(problems[:3])}; "
                        "use madebyollin's taew2_1.safetensors in vae_approx/")
    return TaehvDecoder(weights)
