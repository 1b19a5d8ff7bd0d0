"""A small ONNX graph builder on `onnx.helper` (no torch): constants, nodes with generated names, and a
fixed-shape model at opset 19 / IR 9 (what rknn-toolkit2 2.5.0 and onnxruntime both load)."""

import numpy as np
import onnx
from onnx import helper, numpy_helper

OPSET = 19
IR_VERSION = 9


class GraphBuilder:
    """Collects nodes and initializers; every `op` returns the name of its (single) output."""

    def __init__(self):
        self.nodes = []
        self.initializers = []
        self._used = set()

    def _fresh(self, base: str) -> str:
        name, n = base, 1
        while name in self._used:
            n += 1
            name = f"{base}_{n}"
        self._used.add(name)
        return name

    def const(self, array, name: str = "const") -> str:
        array = np.asarray(array)
        if array.dtype == np.float64:
            array = array.astype(np.float32)
        name = self._fresh(name)
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def op(self, op_type: str, *inputs: str, out: str | None = None, **attrs) -> str:
        """One node; an input of "" is an omitted optional input. `out` names the output (a graph output)."""
        output = self._fresh(out or op_type.lower())
        self.nodes.append(helper.make_node(op_type, list(inputs), [output], name=f"{output}/{op_type}", **attrs))
        return output

    def model(self, inputs: list[tuple[str, tuple]], outputs: list[tuple[str, tuple]], name: str) -> onnx.ModelProto:
        """inputs/outputs: (name, fixed shape) of float32 tensors."""
        value = lambda n, shape: helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, list(shape))
        for n, _ in inputs:
            self._used.add(n)
        graph = helper.make_graph(self.nodes, name, [value(*i) for i in inputs], [value(*o) for o in outputs],
                                  initializer=self.initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="anima-ui")
        model.ir_version = IR_VERSION
        return model
