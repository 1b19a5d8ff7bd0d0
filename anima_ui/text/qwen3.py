"""The Qwen3-0.6B-Base text encoder in float32 on onnxruntime, streamed from `qwen_3_06b_base.safetensors`.

The release stores bf16 (1.2 GB); in float32 the model would take 2.4 GB, more than the board can spare next
to the DiT. So nothing is held between prompts: each encode reads one decoder layer at a time from the file
(the page cache keeps it warm), widens it to float32 into buffers every layer reuses, and runs it through one
decoder-layer graph (built here with onnx.helper) that takes the weights as inputs. The maths is transformers'
`Qwen3Model` in float32 (final hidden states after the last RMSNorm, causal attention, no padding).

Why onnxruntime and not NumPy: `anima-ui bench text` measured it 2x faster per prompt than the same maths in
NumPy at 12 and 300 tokens (NumPy's BLAS spends most of a skinny matmul synchronising its threads), for
about 0.13 GB more peak RSS (the library, which the graph backends load anyway)."""

import itertools
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from anima_ui.errors import Cancelled, UserError
from anima_ui.model.host import rms_norm
from anima_ui.model.tensor_file import STORED_DTYPES, TensorFile

# Not recoverable from shapes; fixed for Qwen3.
ROPE_THETA = 1_000_000.0
RMS_NORM_EPS = 1e-6


@dataclass(frozen=True)
class Qwen3Shape:
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int


QWEN3_06B = Qwen3Shape(vocab=151936, hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=3072)


def layer_shapes(shape: Qwen3Shape) -> dict[str, tuple]:
    """One decoder layer's tensors, named without the `model.layers.{i}.` prefix."""
    hidden, head_dim, inter = shape.hidden, shape.head_dim, shape.intermediate
    q_out, kv_out = shape.heads * head_dim, shape.kv_heads * head_dim
    return {
        "self_attn.q_proj.weight": (q_out, hidden),
        "self_attn.k_proj.weight": (kv_out, hidden),
        "self_attn.v_proj.weight": (kv_out, hidden),
        "self_attn.o_proj.weight": (hidden, q_out),
        "self_attn.q_norm.weight": (head_dim,),
        "self_attn.k_norm.weight": (head_dim,),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
    }


def qwen3_param_shapes(shape: Qwen3Shape) -> dict[str, tuple]:
    """Every tensor of qwen_3_06b_base.safetensors, with the file's HF Qwen3ForCausalLM names (tied
    embeddings: no lm_head): 310 tensors at full size."""
    shapes = {"model.embed_tokens.weight": (shape.vocab, shape.hidden)}
    for i in range(shape.layers):
        shapes.update({f"model.layers.{i}.{name}": s for name, s in layer_shapes(shape).items()})
    shapes["model.norm.weight"] = (shape.hidden,)
    return shapes


def qwen3_shape_from(shapes: dict[str, tuple]) -> Qwen3Shape:
    """The dimensions from tensor shapes keyed by the file's names (`model.` prefix)."""
    try:
        vocab, hidden = shapes["model.embed_tokens.weight"]
        head_dim = shapes["model.layers.0.self_attn.q_norm.weight"][0]
        return Qwen3Shape(
            vocab=vocab,
            hidden=hidden,
            layers=1 + max(int(key.split(".")[2]) for key in shapes if key.startswith("model.layers.")),
            heads=shapes["model.layers.0.self_attn.q_proj.weight"][0] // head_dim,
            kv_heads=shapes["model.layers.0.self_attn.k_proj.weight"][0] // head_dim,
            head_dim=head_dim,
            intermediate=shapes["model.layers.0.mlp.gate_proj.weight"][0],
        )
    except (KeyError, ValueError, IndexError) as exc:
        raise UserError(f"text encoder is not a Qwen3 model (bad or missing tensor {exc}); use qwen_3_06b_base.safetensors") from None


class Qwen3:
    """`Qwen3(path)` checks the file (names and shapes) and reads nothing else; `final_hidden_states(ids)`
    streams the layers."""

    def __init__(self, path):
        self.file = TensorFile(path)
        shapes = self.file.shapes
        self.shape = qwen3_shape_from(shapes)
        for name, expected in qwen3_param_shapes(self.shape).items():
            if name not in shapes:
                raise UserError(f"text encoder {path} lacks tensor {name}; download qwen_3_06b_base.safetensors again")
            if shapes[name] != expected:
                raise UserError(f"text encoder {path}: {name} has shape {list(shapes[name])}, expected {list(expected)}")
        if self.shape.heads % self.shape.kv_heads:
            raise UserError(f"text encoder {path}: {self.shape.heads} query heads do not split over {self.shape.kv_heads} KV heads")
        options = ort.SessionOptions()
        options.log_severity_level = 3
        self.session = ort.InferenceSession(layer_graph(self.shape), options, providers=["CPUExecutionProvider"])

    def final_hidden_states(self, sequences: list[list[int]], cancel=None) -> list[np.ndarray]:
        """The last layer's output after the final RMSNorm, float32 [1, len(ids), hidden] per sequence of
        token ids. Each sequence runs alone under the causal mask with no other mask, as ComfyUI computes it;
        each layer is read once for all of them. Once `cancel` (a threading.Event) is set, the pass stops before its
        next layer with Cancelled (Stop in the text phase)."""
        for ids in sequences:
            bad = [i for i in ids if not 0 <= i < self.shape.vocab]
            if bad:
                raise UserError(f"Qwen token id {bad[0]} is outside the text encoder's {self.shape.vocab} rows: the tokenizer does not match the model")
        xs = [self.file.read_rows("model.embed_tokens.weight", ids) for ids in sequences]
        feeds = [{"cos": cos, "sin": sin, "mask": np.triu(np.full((len(ids), len(ids)), -np.inf, np.float32), k=1)}
                 for ids in sequences for cos, sin in [rope_tables(len(ids), self.shape.head_dim)]]
        # one layer's float32 weights (and its bits as stored) at a time, in buffers every layer reuses
        shapes = layer_shapes(self.shape)
        weights = {name: np.zeros(shape, np.float32) for name, shape in shapes.items()}
        stored = {name: self.file.entries[f"model.layers.0.{name}"]["dtype"] for name in shapes}
        staging = {name: np.empty(shape, STORED_DTYPES[stored[name]]) for name, shape in shapes.items()}
        inputs = {f"w{j}": weights[name] for j, name in enumerate(shapes)}
        for i in range(self.shape.layers):
            if cancel is not None and cancel.is_set():
                raise Cancelled("cancelled")
            for name in shapes:
                self.file.read_into(f"model.layers.{i}.{name}", weights[name], staging[name])
            xs = [self.session.run(None, {"x": x, **feed, **inputs})[0] for x, feed in zip(xs, feeds)]
        norm = self.file.read("model.norm.weight")
        return [rms_norm(x, norm, RMS_NORM_EPS)[None].astype(np.float32, copy=False) for x in xs]


def rope_tables(length: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Split-half RoPE at positions 0..length-1, θ = 1e6: cos, sin float32 [length, head_dim]. Every step
    in float32 as transformers computes it: at position 500 one float32 ulp of the angle is 3e-5."""
    exponents = np.arange(0, head_dim, 2).astype(np.float32) / np.float32(head_dim)
    inv_freq = np.float32(1.0) / np.float32(ROPE_THETA) ** exponents
    angles = np.arange(length, dtype=np.float32)[:, None] * inv_freq[None, :]
    angles = np.concatenate([angles, angles], axis=1)
    return np.cos(angles), np.sin(angles)


def layer_graph(shape: Qwen3Shape) -> bytes:
    """One Qwen3 decoder layer as an ONNX graph (opset 18): x [L, hidden], the RoPE tables [L, head_dim], an
    additive causal mask [L, L] and the layer's 11 tensors (inputs w0.. in layer_shapes order) -> y [L, hidden].
    Pre-norm GQA self-attention with per-head q/k RMSNorm before RoPE, then the SwiGLU MLP."""
    names = list(layer_shapes(shape))
    w = {name: f"w{j}" for j, name in enumerate(names)}
    nodes, inits = [], []
    counter = itertools.count()

    def node(op, inputs, **attrs):
        out = f"t{next(counter)}"
        nodes.append(helper.make_node(op, inputs, [out], **attrs))
        return out

    def const(name, values, dtype=TensorProto.FLOAT):
        inits.append(helper.make_tensor(name, dtype, [len(values)], values))
        return name

    const("eps", [RMS_NORM_EPS])
    const("scale", [shape.head_dim**-0.5])
    const("q_shape", [0, shape.heads, shape.head_dim], TensorProto.INT64)
    const("kv_shape", [0, shape.kv_heads, shape.head_dim], TensorProto.INT64)
    const("group_shape", [0, shape.kv_heads, shape.heads // shape.kv_heads, shape.head_dim], TensorProto.INT64)
    const("merged_shape", [0, shape.heads * shape.head_dim], TensorProto.INT64)
    const("axis1", [1], TensorProto.INT64)
    const("minus1", [-1], TensorProto.INT64)

    def rms(x, weight):
        mean = node("ReduceMean", [node("Mul", [x, x]), "minus1"], keepdims=1)
        return node("Mul", [node("Div", [x, node("Sqrt", [node("Add", [mean, "eps"])])]), weight])

    def rope(x):  # x [L, heads, hd]; tables [L, hd] broadcast over heads
        first, second = f"t{next(counter)}", f"t{next(counter)}"
        nodes.append(helper.make_node("Split", [x], [first, second], axis=-1, num_outputs=2))
        rotated = node("Concat", [node("Neg", [second]), first], axis=-1)
        cos, sin = node("Unsqueeze", ["cos", "axis1"]), node("Unsqueeze", ["sin", "axis1"])
        return node("Add", [node("Mul", [x, cos]), node("Mul", [rotated, sin])])

    def linear(x, weight):
        return node("Gemm", [x, weight], transB=1)

    h = rms("x", w["input_layernorm.weight"])
    q = rope(rms(node("Reshape", [linear(h, w["self_attn.q_proj.weight"]), "q_shape"]), w["self_attn.q_norm.weight"]))
    k = rope(rms(node("Reshape", [linear(h, w["self_attn.k_proj.weight"]), "kv_shape"]), w["self_attn.k_norm.weight"]))
    v = node("Reshape", [linear(h, w["self_attn.v_proj.weight"]), "kv_shape"])
    q = node("Transpose", [node("Reshape", [q, "group_shape"])], perm=[1, 2, 0, 3])  # [kv, r, L, hd]
    k = node("Unsqueeze", [node("Transpose", [k], perm=[1, 2, 0]), "axis1"])  # [kv, 1, hd, L]
    v = node("Unsqueeze", [node("Transpose", [v], perm=[1, 0, 2]), "axis1"])  # [kv, 1, L, hd]
    scores = node("Add", [node("Mul", [node("MatMul", [q, k]), "scale"]), "mask"])
    attended = node("MatMul", [node("Softmax", [scores], axis=-1), v])  # [kv, r, L, hd]
    merged = node("Reshape", [node("Transpose", [attended], perm=[2, 0, 1, 3]), "merged_shape"])
    x = node("Add", ["x", linear(merged, w["self_attn.o_proj.weight"])])
    h = rms(x, w["post_attention_layernorm.weight"])
    gate = linear(h, w["mlp.gate_proj.weight"])
    act = node("Mul", [node("Mul", [gate, node("Sigmoid", [gate])]), linear(h, w["mlp.up_proj.weight"])])
    nodes.append(helper.make_node("Add", [x, linear(act, w["mlp.down_proj.weight"])], ["y"]))

    length, hd = "L", shape.head_dim
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [length, shape.hidden]),
              helper.make_tensor_value_info("cos", TensorProto.FLOAT, [length, hd]),
              helper.make_tensor_value_info("sin", TensorProto.FLOAT, [length, hd]),
              helper.make_tensor_value_info("mask", TensorProto.FLOAT, [length, length])]
    inputs += [helper.make_tensor_value_info(w[name], TensorProto.FLOAT, list(s)) for name, s in layer_shapes(shape).items()]
    graph = helper.make_graph(nodes, "qwen3_layer", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [length, shape.hidden])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()
