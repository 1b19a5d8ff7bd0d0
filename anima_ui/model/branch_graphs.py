"""The three per-block branch bodies as ONNX graphs built from NumPy weights (no torch): what `anima-ui
export` writes. Same inputs, output, shapes and arithmetic as the torch modules in branches.py, which stay
the float32 reference the tests compare these graphs against."""

import numpy as np
import onnx

from anima_ui.model.config import BRANCH_INPUTS
from anima_ui.model.host import EPS
from anima_ui.model.onnx_graph import Graph, attention, gelu_erf, linear, reshape, rms_norm

# Bumped whenever the graphs this module builds change, so finished graphs of an older build are redone.
GRAPHS_VERSION = 1

# The tensors of one block each graph holds (names without the `blocks.{i}.` prefix). The cross-attention
# k/v projections and k_norm are not here: the host applies them once per prompt (cross_attention_kv).
BRANCH_WEIGHTS = {
    "self_attn": tuple(f"self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "output_proj", "q_norm", "k_norm")),
    "cross_attn": tuple(f"cross_attn.{n}.weight" for n in ("q_proj", "output_proj", "q_norm")),
    "mlp": ("mlp.layer1.weight", "mlp.layer2.weight"),
}


def branch_graph(kind: str, weights: dict[str, np.ndarray], batch: int, tokens: int, context_len: int, dtype: str) -> onnx.ModelProto:
    """One branch graph: h [B,N,D] plus rope_cos/rope_sin [N,hd] (self_attn) or k/v [B,S,D] (cross_attn) -> out [B,N,D].
    `weights` holds at least BRANCH_WEIGHTS[kind] (block prefix removed); dtype "float32" or "float16"."""
    return BUILDERS[kind](weights, batch, tokens, context_len, dtype)


def _self_attention(w, batch, tokens, context_len, dtype) -> onnx.ModelProto:
    width, head_dim = w["self_attn.q_proj.weight"].shape[0], w["self_attn.q_norm.weight"].shape[0]
    heads = width // head_dim
    g = Graph(dtype, "self_attn")
    h = g.input("h", (batch, tokens, width))
    cos = reshape(g, g.input("rope_cos", (tokens, head_dim)), (1, tokens, 1, head_dim))
    sin = reshape(g, g.input("rope_sin", (tokens, head_dim)), (1, tokens, 1, head_dim))
    split = (batch, tokens, heads, head_dim)

    def projected(name: str) -> str:
        return reshape(g, linear(g, h, w[f"self_attn.{name}.weight"], name), split)

    q = _rope(g, rms_norm(g, projected("q_proj"), w["self_attn.q_norm.weight"], EPS), cos, sin, head_dim)
    k = _rope(g, rms_norm(g, projected("k_proj"), w["self_attn.k_norm.weight"], EPS), cos, sin, head_dim)
    mixed = attention(g, q, k, projected("v_proj"), batch, tokens, heads, head_dim)
    out = linear(g, mixed, w["self_attn.output_proj.weight"], "output_proj")
    return g.model({"out": (out, (batch, tokens, width))})


def _rope(g: Graph, x: str, cos: str, sin: str, head_dim: int) -> str:
    """x·cos + rotate_half(x)·sin, rotate_half(x) = [−x₂, x₁] over the two halves of the head axis."""
    half = head_dim // 2
    axis = g.const([-1], "axis", dtype=np.int64)
    first = g.node("Slice", [x, g.const([0], "start", dtype=np.int64), g.const([half], "end", dtype=np.int64), axis])
    second = g.node("Slice", [x, g.const([half], "start", dtype=np.int64), g.const([head_dim], "end", dtype=np.int64), axis])
    rotated = g.node("Concat", [g.node("Neg", [second]), first], axis=-1)
    return g.node("Add", [g.node("Mul", [x, cos]), g.node("Mul", [rotated, sin])])


def _cross_attention(w, batch, tokens, context_len, dtype) -> onnx.ModelProto:
    width, head_dim = w["cross_attn.q_proj.weight"].shape[0], w["cross_attn.q_norm.weight"].shape[0]
    g = Graph(dtype, "cross_attn")
    h = g.input("h", (batch, tokens, width))
    split = (batch, context_len, width // head_dim, head_dim)
    k = reshape(g, g.input("k", (batch, context_len, width)), split)
    v = reshape(g, g.input("v", (batch, context_len, width)), split)
    return g.model({"out": (cross_attention_body(g, w, h, k, v, batch, tokens), (batch, tokens, width))})


def cross_attention_body(g: Graph, w: dict[str, np.ndarray], h: str, k: str, v: str, batch: int, tokens: int) -> str:
    """q from h [B,N,D] (q_proj, per-head q_norm), attention over k/v [B,S,H,hd], output_proj -> [B,N,D]."""
    width, head_dim = w["cross_attn.q_proj.weight"].shape[0], w["cross_attn.q_norm.weight"].shape[0]
    heads = width // head_dim
    q = reshape(g, linear(g, h, w["cross_attn.q_proj.weight"], "q_proj"), (batch, tokens, heads, head_dim))
    q = rms_norm(g, q, w["cross_attn.q_norm.weight"], EPS)
    return linear(g, attention(g, q, k, v, batch, tokens, heads, head_dim), w["cross_attn.output_proj.weight"], "output_proj")


def _feed_forward(w, batch, tokens, context_len, dtype) -> onnx.ModelProto:
    width = w["mlp.layer1.weight"].shape[1]
    g = Graph(dtype, "mlp")
    h = g.input("h", (batch, tokens, width))
    out = linear(g, gelu_erf(g, linear(g, h, w["mlp.layer1.weight"], "layer1")), w["mlp.layer2.weight"], "layer2")
    return g.model({"out": (out, (batch, tokens, width))})


BUILDERS = {"self_attn": _self_attention, "cross_attn": _cross_attention, "mlp": _feed_forward}
assert set(BUILDERS) == set(BRANCH_INPUTS) == set(BRANCH_WEIGHTS)
