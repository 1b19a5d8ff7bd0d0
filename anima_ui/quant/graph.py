"""ONNX graphs of one block's FFN, built from NumPy arrays with onnx.helper (no torch): the W8A8 + low-rank
graph of a QuantizedFfn, and the plain float FFN it replaces.

Input `h` [B, N, D] and output `out` [B, N, D], as the exported FFN branch graphs. GELU is written as torch
exports the exact GELU (Div by √2, Erf, Add 1, Mul, Mul ½): rknn-toolkit2 fuses that pattern into one
exGelu on the NPU, while a lone Erf would run on the CPU.

Tensor names matter to the conversion: the toolkit renames a MatMul output `res1` to `res1_mm`, and the
hybrid configuration keeps int8 exactly the residual GEMM outputs (`res1*`, `res2*`); the FP16 tensors `h`
and `mid` carry the ranges their int8 copies (the residual GEMMs' inputs) are quantized with."""

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from anima_ui.quant.ffn import QuantizedFfn

OPSET = 19
IR_VERSION = 9  # rknn-toolkit2 2.5.0 pins onnx 1.18, which reads IR <= 11
INT8_PREFIXES = ("res1", "res2")  # tensors (and the toolkit's renamings of them) that stay int8
RANGE_PREFIXES = {"h": "h", "res1": "res1", "mid": "mid", "res2": "res2"}  # QuantizedFfn range -> cfg tensor prefix


def _gelu(x: str, out: str) -> list:
    return [
        helper.make_node("Div", [x, "sqrt2"], [f"{out}_div"]),
        helper.make_node("Erf", [f"{out}_div"], [f"{out}_erf"]),
        helper.make_node("Add", [f"{out}_erf", "one"], [f"{out}_add"]),
        helper.make_node("Mul", [x, f"{out}_add"], [f"{out}_mul"]),
        helper.make_node("Mul", [f"{out}_mul", "half"], [out]),
    ]


def _gelu_constants() -> list:
    return [numpy_helper.from_array(np.array(v, np.float32), name) for name, v in (("sqrt2", np.sqrt(2.0)), ("one", 1.0), ("half", 0.5))]


def _layer(x: str, out: str, index: int) -> list:
    """x·R{i} + (x·La{i})·Lb{i}; the residual GEMM's output is `res{i}`."""
    return [
        helper.make_node("MatMul", [x, f"R{index}"], [f"res{index}"]),
        helper.make_node("MatMul", [x, f"La{index}"], [f"lra{index}"]),
        helper.make_node("MatMul", [f"lra{index}", f"Lb{index}"], [f"lrb{index}"]),
        helper.make_node("Add", [f"res{index}", f"lrb{index}"], [out]),
    ]


def _model(nodes: list, initializers: list, shape: tuple[int, int, int], name: str) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, name,
        [helper.make_tensor_value_info("h", TensorProto.FLOAT, list(shape))],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, list(shape))],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="anima-ui")
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    return model


def quantized_ffn_model(q: QuantizedFfn, shape: tuple[int, int, int]) -> onnx.ModelProto:
    """The graph takes x̂ = x/λ1 (the host divides): layer 1, GELU, ·(1/λ2), layer 2. The rank-0 variant
    (smoothing alone) is only emulated: its residual GEMM output would be the graph output."""
    if q.rank < 1:
        raise ValueError("a quantized FFN graph needs a low-rank branch (rank >= 1)")
    arrays = {"R1": q.r1, "La1": q.la1, "Lb1": q.lb1, "inv_lambda2": q.inv_smooth_mid, "R2": q.r2, "La2": q.la2, "Lb2": q.lb2}
    initializers = [numpy_helper.from_array(np.ascontiguousarray(v, np.float32), k) for k, v in arrays.items()]
    nodes = (
        _layer("h", "pre", 1)
        + _gelu("pre", "gelu")
        + [helper.make_node("Mul", ["gelu", "inv_lambda2"], ["mid"])]
        + _layer("mid", "out", 2)
    )
    return _model(nodes, initializers + _gelu_constants(), shape, "ffn_w8a8_lowrank")


def float_ffn_model(w1: np.ndarray, w2: np.ndarray, shape: tuple[int, int, int]) -> onnx.ModelProto:
    """GELU(h·W1)·W2, weights [in, out]: the FFN branch graph without quantization."""
    initializers = [numpy_helper.from_array(np.ascontiguousarray(w, np.float32), k) for k, w in (("W1", w1), ("W2", w2))]
    nodes = (
        [helper.make_node("MatMul", ["h", "W1"], ["pre"])]
        + _gelu("pre", "mid")
        + [helper.make_node("MatMul", ["mid", "W2"], ["out"])]
    )
    return _model(nodes, initializers + _gelu_constants(), shape, "ffn")


def save(model: onnx.ModelProto, path) -> None:
    """Written under a temporary name and renamed, so a killed run leaves no half-written graph."""
    path = Path(path)
    temp = path.with_name(f".{path.name}.partial")
    onnx.save(model, str(temp))
    temp.replace(path)
