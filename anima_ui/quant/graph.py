"""The ONNX graph of one block's W8A8 + low-rank FFN, built with the project's graph builder
(anima_ui/model/onnx_graph.py), and the float FFN branch graph it replaces (anima_ui/model/branch_graphs.py).

Input `h` [B, N, D] and output `out` [B, N, D], as the exported FFN branch graphs; GELU is the exGelu pattern.
Tensor names matter to the conversion: the hybrid configuration keeps int8 exactly the residual GEMM outputs
(names starting `res1`/`res2`, and the toolkit's renamings of them such as `res1_3_mm`); the FP16 tensors `h`
and `mid…` carry the ranges their int8 copies (the residual GEMMs' inputs) are quantized with."""

import numpy as np
import onnx

from anima_ui.model.branch_graphs import branch_graph
from anima_ui.model.onnx_graph import Graph, gelu_erf, linear
from anima_ui.quant.ffn import QuantizedFfn

INT8_PREFIXES = ("res1", "res2")  # tensors (and the toolkit's renamings of them) that stay int8
RANGE_PREFIXES = {"h": "h", "res1": "res1", "mid": "mid", "res2": "res2"}  # QuantizedFfn range -> cfg tensor prefix


def _layer(g: Graph, x: str, residual: np.ndarray, la: np.ndarray, lb: np.ndarray, index: int) -> str:
    """x·R + (x·La)·Lb with [in, out] weights; the residual GEMM's output is named `res{index}…`."""
    res = linear(g, x, residual.T, f"res{index}")
    low_rank = linear(g, linear(g, x, la.T, f"lra{index}"), lb.T, f"lrb{index}")
    return g.node("Add", [res, low_rank], f"pre{index}")


def quantized_ffn_model(q: QuantizedFfn, shape: tuple[int, int, int]) -> onnx.ModelProto:
    """The graph takes x̂ = x/λ1 (the host divides): layer 1, GELU, ·(1/λ2), layer 2. The rank-0 variant
    (smoothing alone) is only emulated: its residual GEMM output would be the graph output."""
    if q.rank < 1:
        raise ValueError("a quantized FFN graph needs a low-rank branch (rank >= 1)")
    g = Graph("float32", "ffn_w8a8_lowrank")
    h = g.input("h", shape)
    pre = _layer(g, h, q.r1, q.la1, q.lb1, 1)
    mid = g.node("Mul", [gelu_erf(g, pre), g.const(q.inv_smooth_mid, "inv_lambda2")], "mid")
    out = _layer(g, mid, q.r2, q.la2, q.lb2, 2)
    model = g.model({"out": (out, shape)})
    onnx.checker.check_model(model)
    return model


def float_ffn_model(w1: np.ndarray, w2: np.ndarray, shape: tuple[int, int, int]) -> onnx.ModelProto:
    """The float32 FFN branch graph `anima-ui export` writes, for weights in [in, out] layout."""
    weights = {"mlp.layer1.weight": np.asarray(w1).T, "mlp.layer2.weight": np.asarray(w2).T}
    return branch_graph("mlp", weights, shape[0], shape[1], 0, "float32")
