"""The ONNX graph of one block's W8A8 + low-rank FFN, built with the project's graph builder
(anima_ui/model/onnx_graph.py), and the float FFN branch graph it replaces (anima_ui/model/branch_graphs.py).

Input `h` [B, N, D] and output `out` [B, N, D], as the exported FFN branch graphs; GELU is the exGelu pattern.
Tensor names matter to the conversion: the hybrid configuration keeps int8 exactly the residual GEMM outputs
(names starting `res1`/`res2`, and the toolkit's renamings of them such as `res1_3_mm`); the FP16 tensors `h`
and `mid…` carry the ranges their int8 copies (the residual GEMMs' inputs) are quantized with. A residual GEMM
split along K (ffn.k_pieces) reads Slices of its input named `h0`, `h1`… / `mid0`, `mid1`… and writes
`res1_0`, `res1_1`… / `res2_0`…, each with its own range (ffn.range_names), added by FP16 Adds (ffn.add_tree)."""

import numpy as np
import onnx

from anima_ui.model.branch_graphs import branch_graph
from anima_ui.model.onnx_graph import Graph, gelu_erf, linear
from anima_ui.quant.ffn import QuantizedFfn, add_tree, piece_slices, range_names

INT8_PREFIXES = ("res1", "res2")  # tensors (and the toolkit's renamings of them) that stay int8


def _layer(g: Graph, x: str, residual: np.ndarray, la: np.ndarray, lb: np.ndarray, index: int, pieces: tuple) -> str:
    """x·R + (x·La)·Lb with [in, out] weights; R's GEMM (or each piece of it) writes `res{index}…`; the terms
    are added in add_tree's order, the low-rank branch last."""
    inputs, outputs = range_names(index, pieces)
    if len(pieces) == 1:
        terms = [linear(g, x, residual.T, outputs[0])]
    else:
        terms = []
        for s, name, out in zip(piece_slices(pieces), inputs, outputs):
            bounds = [g.const([bound], hint, np.int64) for bound, hint in ((s.start, "start"), (s.stop, "stop"), (2, "axis"))]
            terms.append(linear(g, g.node("Slice", [x, *bounds], name), residual[s].T, out))
    terms.append(linear(g, linear(g, x, la.T, f"lra{index}"), lb.T, f"lrb{index}"))
    return add_tree(terms, lambda a, b: g.node("Add", [a, b], f"pre{index}"))


def quantized_ffn_model(q: QuantizedFfn, shape: tuple[int, int, int]) -> onnx.ModelProto:
    """The graph takes x̂ = x/λ1 (the host divides): layer 1, GELU, ·(1/λ2), layer 2. The rank-0 variant
    (smoothing alone) is only emulated: its residual GEMM output would be the graph output."""
    if q.rank < 1:
        raise ValueError("a quantized FFN graph needs a low-rank branch (rank >= 1)")
    g = Graph("float32", "ffn_w8a8_lowrank")
    h = g.input("h", shape)
    pre = _layer(g, h, q.r1, q.la1, q.lb1, 1, q.pieces1)
    mid = g.node("Mul", [gelu_erf(g, pre), g.const(q.inv_smooth_mid, "inv_lambda2")], "mid")
    out = _layer(g, mid, q.r2, q.la2, q.lb2, 2, q.pieces2)
    model = g.model({"out": (out, shape)})
    onnx.checker.check_model(model)
    return model


def float_ffn_model(w1: np.ndarray, w2: np.ndarray, shape: tuple[int, int, int]) -> onnx.ModelProto:
    """The float32 FFN branch graph `anima-ui export` writes, for weights in [in, out] layout."""
    weights = {"mlp.layer1.weight": np.asarray(w1).T, "mlp.layer2.weight": np.asarray(w2).T}
    return branch_graph("mlp", weights, shape[0], shape[1], 0, "float32")
