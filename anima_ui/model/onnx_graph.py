"""Build fixed-shape ONNX graphs straight from NumPy weights, without torch: the node patterns the RKNN
compiler recognises, and an atomic, hashed file writer.

rknn-toolkit2 2.5.0 maps a MatMul whose right operand is a constant to a 1x1 Conv, fuses
Pow-ReduceMean-Add-Sqrt-Div-Mul (RMSNorm) into exNorm, Div-Erf-Add-Mul-Mul (exact GELU) into exGelu, and
Transpose-Mul-MatMul-Softmax-MatMul (attention) into exSDPAttention, all on the NPU; the helpers below
emit exactly those patterns (they are also what torch's ONNX exporter writes for the same ops).

One `Graph` per file: `g = Graph("float32")`, `x = g.input("h", shape)`, then helpers that return output
names, then `g.save(path, outputs)`. Every graph is written at opset 19 (the RKNN toolkit's recommended
opset) and IR version 9, which onnx 1.16+ and onnxruntime 1.17+ all read."""

import hashlib

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from anima_ui.files import write_atomically

OPSET = 19
IR_VERSION = 9
DTYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}


class Graph:
    """Nodes and constant initializers of one graph, in one float dtype ("float32" or "float16")."""

    def __init__(self, dtype: str, name: str = "graph"):
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
        self.dtype = dtype
        self.name = name
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self._count = 0

    def _name(self, hint: str) -> str:
        self._count += 1
        return f"{hint}_{self._count}"

    def input(self, name: str, shape) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, DTYPES[self.dtype], list(shape)))
        return name

    def const(self, array, hint: str = "const", dtype=None) -> str:
        """A constant initializer, cast to the graph dtype unless `dtype` is given (int64 for shapes/axes)."""
        name = self._name(hint)
        values = np.asarray(array, dtype=dtype or self.dtype)
        self.initializers.append(numpy_helper.from_array(values, name))
        return name

    def node(self, op: str, inputs: list[str], hint: str | None = None, **attributes) -> str:
        output = self._name(hint or op.lower())
        self.nodes.append(helper.make_node(op, inputs, [output], name=output, **attributes))
        return output

    def model(self, outputs: dict[str, tuple[str, tuple[int, ...]]]) -> onnx.ModelProto:
        """outputs: final name -> (the value that becomes it, its shape); graph outputs feed no other node."""
        producers = {node.output[0]: node for node in self.nodes}
        for final, (value, _) in outputs.items():
            assert not any(value in node.input for node in self.nodes), f"{value} is consumed inside the graph"
            producers[value].output[0] = final
        results = [helper.make_tensor_value_info(final, DTYPES[self.dtype], list(shape)) for final, (_, shape) in outputs.items()]
        graph = helper.make_graph(self.nodes, self.name, self.inputs, results, self.initializers)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION,
                                 producer_name="anima-ui")


# -- node patterns --------------------------------------------------------------------------------------------------
def linear(g: Graph, x: str, weight: np.ndarray, hint: str = "linear") -> str:
    """x @ weight.T for a torch-layout weight [out, in], bias-free; a constant right operand (-> a 1x1 Conv on the NPU)."""
    return g.node("MatMul", [x, g.const(np.ascontiguousarray(np.asarray(weight).T), hint + "_weight")], hint)


def reshape(g: Graph, x: str, shape) -> str:
    return g.node("Reshape", [x, g.const(np.asarray(shape, np.int64), "shape", dtype=np.int64)])


def transpose(g: Graph, x: str, perm) -> str:
    return g.node("Transpose", [x], perm=list(perm))


def rms_norm(g: Graph, x: str, weight: np.ndarray, eps: float) -> str:
    """RMSNorm over the last axis: x · 1/sqrt(mean(x²) + eps) · weight (the exNorm pattern)."""
    square = g.node("Pow", [x, g.const(2.0, "two")])
    mean = g.node("ReduceMean", [square, g.const([-1], "axes", dtype=np.int64)], keepdims=1)
    root = g.node("Sqrt", [g.node("Add", [mean, g.const(eps, "eps")])])
    inverse = g.node("Div", [g.const(1.0, "one"), root])
    return g.node("Mul", [g.node("Mul", [x, inverse]), g.const(weight, "norm_weight")])


def gelu_erf(g: Graph, x: str) -> str:
    """Exact GELU, 0.5 · x · (1 + erf(x / √2)) (the exGelu pattern)."""
    erf = g.node("Erf", [g.node("Div", [x, g.const(np.sqrt(2.0), "sqrt2")])])
    return g.node("Mul", [g.node("Mul", [x, g.node("Add", [erf, g.const(1.0, "one")])]), g.const(0.5, "half")])


def attention(g: Graph, q: str, k: str, v: str, batch: int, tokens: int, heads: int, head_dim: int) -> str:
    """Softmax attention, no mask. q [B,N,H,hd], k/v [B,S,H,hd] -> [B,N,H·hd] (the exSDPAttention pattern).
    The 1/√hd scale is split as hd^-¼ on q and on kᵀ, the way torch exports scaled_dot_product_attention."""
    root_scale = g.const(head_dim ** -0.25, "scale")
    q = g.node("Mul", [transpose(g, q, (0, 2, 1, 3)), root_scale])
    k = g.node("Mul", [transpose(g, k, (0, 2, 3, 1)), root_scale])
    weights = g.node("Softmax", [g.node("MatMul", [q, k])], axis=-1)
    out = transpose(g, g.node("MatMul", [weights, transpose(g, v, (0, 2, 1, 3))]), (0, 2, 1, 3))
    return reshape(g, out, (batch, tokens, heads * head_dim))


# -- files ----------------------------------------------------------------------------------------------------------
def write_model(model: onnx.ModelProto, path) -> str:
    """Write `model` to `path` atomically; returns the sha256 of the bytes written."""
    data = model.SerializeToString()
    write_atomically(path, lambda f: f.write(data))
    return hashlib.sha256(data).hexdigest()
