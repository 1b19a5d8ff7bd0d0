"""The Wan-2.1 decoder (one frame, 2-D, as wan_decoder.py computes it) as fixed-shape ONNX graphs built
directly from the safetensors weights (no torch).

Three parts of one network:
- "full":  model-space latent [B,16,h,w] -> image [B,3,8h,8w]
- "trunk": model-space latent [1,16,h,w] -> features [1,4d,h,w] (conv2, conv1, the mid block: the only
           spatially global op, the mid-block attention, is here)
- "up":    features [B,4d,h,w] -> image [B,3,8h,8w] (local: a tile of it needs a halo, see tiling.py)

Folded into the weights: the Wan latent mean/std into conv2 (the graphs take the sampler's latent), the
attention scale 1/sqrt(C) into the query projection, and (x+1)/2 into the head conv, so the image comes
out in [0,1]; `clip` adds Clip(0,1) (leave it out where tiles are blended before clamping).

The node patterns are the ones rknn-toolkit2 fuses for the NPU: the channel RMS norm as
ReduceL2 -> Clip(min=eps) -> Expand -> Div (a Max(eps) there stays on the CPU), SiLU as Sigmoid * x,
attention as 4-D MatMul -> Softmax -> MatMul, upsampling as Resize nearest/asymmetric/floor.
"""

import numpy as np
import onnx

from anima_ui.errors import UserError
from anima_ui.vae.latent import LATENTS_MEAN, LATENTS_STD, SCALE, Z_DIM
from anima_ui.vae.onnx_nodes import GraphBuilder
from anima_ui.vae.weights import DIM_MULT, NUM_RES_BLOCKS, decoder_levels

PARTS = ("full", "trunk", "up")
NORM_EPS = 1e-12  # F.normalize's clamp on the channel norm


def build_decoder_graph(weights: dict[str, np.ndarray], base_dim: int, height: int, width: int,
                        part: str = "full", batch: int = 1, clip: bool = True):
    """One fixed-shape decoder graph for a latent (or feature map) of height x width latent pixels.
    weights: load_decoder_weights' output. Returns an onnx.ModelProto."""
    if part not in PARTS:
        raise UserError(f"unknown decoder graph part {part!r}: choose one of {', '.join(PARTS)}")
    if height < 1 or width < 1 or batch < 1:
        raise UserError(f"decoder graph of {batch}x{height}x{width} latent pixels: all must be positive")
    top = base_dim * DIM_MULT[-1]
    g = GraphBuilder()
    if part == "up":
        inputs = [("features", (batch, top, height, width))]
        x, shape = "features", inputs[0][1]
    else:
        inputs = [("latent", (batch, Z_DIM, height, width))]
        x, shape = _trunk(g, weights, "latent", inputs[0][1])
    if part == "trunk":
        g.op("Identity", x, out="features")
        outputs = [("features", shape)]
    else:
        x, shape = _up_path(g, weights, base_dim, x, shape)
        _head(g, weights, x, shape, clip)
        outputs = [("image", (batch, 3, height * SCALE, width * SCALE))]
    return g.model(inputs, outputs, name=f"wan_decoder_{part}_{batch}x{height}x{width}")


# ---------------------------------------------------------------- the network, as wan_decoder.py

def _trunk(g, w, x, shape):
    # conv2 on the VAE-space latent z*std + mean, folded: W(z*std + mean) + b = (W*std) z + (W mean + b)
    conv2 = w["conv2.weight"]
    weight = conv2 * LATENTS_STD.reshape(1, -1, 1, 1)
    bias = w["conv2.bias"] + conv2[:, :, 0, 0] @ LATENTS_MEAN
    x = _conv(g, x, weight, bias, 0, "conv2")
    x = _conv(g, x, w["decoder.conv1.weight"], w["decoder.conv1.bias"], 1, "decoder.conv1")
    shape = (shape[0], w["decoder.conv1.weight"].shape[0], shape[2], shape[3])
    x = _residual(g, w, "decoder.middle.0.", x, shape)
    x = _attention(g, w, "decoder.middle.1.", x, shape)
    x = _residual(g, w, "decoder.middle.2.", x, shape)
    return x, shape


def _up_path(g, w, base_dim, x, shape):
    index = 0
    for _, c_out, upsample in decoder_levels(base_dim):
        for _ in range(NUM_RES_BLOCKS + 1):
            prefix = f"decoder.upsamples.{index}."
            x = _residual(g, w, prefix, x, shape)
            shape = (shape[0], c_out, shape[2], shape[3])
            index += 1
        if upsample:
            prefix = f"decoder.upsamples.{index}.resample.1."
            scales = g.const(np.array([1, 1, 2, 2], np.float32), "scales")
            x = g.op("Resize", x, "", scales, mode="nearest", coordinate_transformation_mode="asymmetric",
                     nearest_mode="floor")
            x = _conv(g, x, w[prefix + "weight"], w[prefix + "bias"], 1, prefix[:-1])
            shape = (shape[0], w[prefix + "weight"].shape[0], shape[2] * 2, shape[3] * 2)
            index += 1
    return x, shape


def _head(g, w, x, shape, clip):
    x = _silu(g, _rms_norm(g, x, w["decoder.head.0.gamma"], shape))
    # (x + 1) / 2 folded into the last conv
    x = _conv(g, x, w["decoder.head.2.weight"] * 0.5, w["decoder.head.2.bias"] * 0.5 + 0.5, 1, "decoder.head.2")
    if clip:
        g.op("Clip", x, g.const(np.float32(0.0), "zero"), g.const(np.float32(1.0), "one"), out="image")
    else:
        g.op("Identity", x, out="image")


def _residual(g, w, prefix, x, shape):
    c_out = w[prefix + "residual.2.weight"].shape[0]
    out_shape = (shape[0], c_out, shape[2], shape[3])
    h = _silu(g, _rms_norm(g, x, w[prefix + "residual.0.gamma"], shape))
    h = _conv(g, h, w[prefix + "residual.2.weight"], w[prefix + "residual.2.bias"], 1, prefix + "residual.2")
    h = _silu(g, _rms_norm(g, h, w[prefix + "residual.3.gamma"], out_shape))
    h = _conv(g, h, w[prefix + "residual.6.weight"], w[prefix + "residual.6.bias"], 1, prefix + "residual.6")
    if prefix + "shortcut.weight" in w:
        x = _conv(g, x, w[prefix + "shortcut.weight"], w[prefix + "shortcut.bias"], 0, prefix + "shortcut")
    return g.op("Add", h, x)


def _attention(g, w, prefix, x, shape):
    """Single-head attention over the h*w pixels, channels as features, scale 1/sqrt(C)."""
    b, c, height, width = shape
    tokens = height * width
    h = _rms_norm(g, x, w[prefix + "norm.gamma"], shape)
    qkv_w, qkv_b = w[prefix + "to_qkv.weight"], w[prefix + "to_qkv.bias"]
    scale = np.float32(c ** -0.5)
    q = _conv(g, h, qkv_w[:c] * scale, qkv_b[:c] * scale, 0, prefix + "to_q")
    k = _conv(g, h, qkv_w[c:2 * c], qkv_b[c:2 * c], 0, prefix + "to_k")
    v = _conv(g, h, qkv_w[2 * c:], qkv_b[2 * c:], 0, prefix + "to_v")
    heads = g.const(np.array([b, 1, c, tokens], np.int64), "heads_shape")
    q = g.op("Transpose", g.op("Reshape", q, heads), perm=[0, 1, 3, 2])  # [b, 1, hw, c]
    k = g.op("Reshape", k, heads)  # [b, 1, c, hw]
    v = g.op("Transpose", g.op("Reshape", v, heads), perm=[0, 1, 3, 2])  # [b, 1, hw, c]
    attn = g.op("Softmax", g.op("MatMul", q, k), axis=-1)  # [b, 1, hw, hw]
    out = g.op("Transpose", g.op("MatMul", attn, v), perm=[0, 1, 3, 2])  # [b, 1, c, hw]
    out = g.op("Reshape", out, g.const(np.array(shape, np.int64), "image_shape"))
    out = _conv(g, out, w[prefix + "proj.weight"], w[prefix + "proj.bias"], 0, prefix + "proj")
    return g.op("Add", out, x)


def _rms_norm(g, x, gamma, shape):
    """F.normalize(x, dim=1) * sqrt(C) * gamma, in the form the NPU compiler fuses into one norm."""
    norm = g.op("ReduceL2", x, g.const(np.array([1], np.int64), "channel_axis"), keepdims=1)
    norm = g.op("Clip", norm, g.const(np.float32(NORM_EPS), "norm_eps"), "")
    norm = g.op("Expand", norm, g.const(np.array(shape, np.int64), "norm_shape"))
    x = g.op("Div", x, norm)
    scale = (gamma.reshape(1, -1, 1, 1) * np.float32(shape[1] ** 0.5)).astype(np.float32)
    return g.op("Mul", x, g.const(scale, "gamma"))


def _silu(g, x):
    return g.op("Mul", x, g.op("Sigmoid", x))


def _conv(g, x, weight, bias, padding, name):
    kh, kw = weight.shape[2:]
    return g.op("Conv", x, g.const(weight.astype(np.float32), name + ".weight"),
                g.const(bias.astype(np.float32), name + ".bias"),
                kernel_shape=[kh, kw], pads=[padding] * 4)


def graph_gflop(model) -> float:
    """Multiply-adds x 2 of the graph's Conv and MatMul nodes (99 % of the work), in GFLOP."""
    inferred = onnx.shape_inference.infer_shapes(model)
    dims = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in (*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output)}
    dims |= {t.name: list(t.dims) for t in model.graph.initializer}
    flop = 0
    for node in inferred.graph.node:
        if node.op_type == "Conv":
            _, c_in, kh, kw = dims[node.input[1]]
            flop += 2 * int(np.prod(dims[node.output[0]])) * c_in * kh * kw
        elif node.op_type == "MatMul":
            flop += 2 * int(np.prod(dims[node.output[0]])) * dims[node.input[0]][-1]
    return flop / 1e9
