"""The LLM adapter inside the DiT checkpoint, in float32 on onnxruntime: T5-token queries cross-attend to Qwen3
hidden states and become the DiT's cross-attention context. ComfyUI semantics: no attention masks, zero-padded
to 512.

Like the text encoder (text/qwen3.py), nothing is held between prompts: each call reads one adapter block at a
time from the DiT file (0.07 GB in float32 at full size), into buffers every block reuses, and runs it through
one block graph built here with onnx.helper that takes the block's tensors as inputs. `anima-ui bench text`
compares it with the same maths in NumPy, which was several times slower per prompt (NumPy's BLAS spends most
of a skinny matmul synchronising its threads, as it does for Qwen3)."""

import functools
import itertools
from collections.abc import Mapping

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from anima_ui.errors import UserError
from anima_ui.model.checkpoint import ADAPTER_PREFIX, dit_param_shapes, open_dit
from anima_ui.model.host import EPS
from anima_ui.model.tensor_file import STORED_DTYPES, FileTensors, embedding_rows

ROPE_THETA = 10000.0
# One block's tensors, named without `blocks.{j}.`, in the order of the block graph's inputs w0..w18.
BLOCK_TENSORS = tuple(
    [f"{part}.weight" for part in ("norm_self_attn", "norm_cross_attn", "norm_mlp")]
    + [f"{attn}.{name}.weight" for attn in ("self_attn", "cross_attn")
       for name in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")]
    + ["mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias"]
)
HEAD_TENSORS = ("out_proj.weight", "out_proj.bias", "norm.weight")


def llm_adapter_forward(weights: Mapping[str, np.ndarray], source: np.ndarray, t5_ids: np.ndarray) -> np.ndarray:
    """weights: the adapter's tensors without `llm_adapter.` (`split_adapter(state)`, or `open_adapter(path)`,
    which reads each block from the file as it runs); source [B,Ls,Cs] Qwen3 final hidden states; t5_ids [B,Lt]
    int -> [B,Lt,C] float32 (not padded; see pad_context). The rows of a batch run one at a time (no masks)."""
    source = np.asarray(source, dtype=np.float32)
    ids = np.asarray(t5_ids, dtype=np.int64)
    return np.stack(adapt_sequences(weights, list(zip(source, ids))))


def adapt_sequences(weights: Mapping[str, np.ndarray], sequences: list[tuple[np.ndarray, np.ndarray]]) -> list[np.ndarray]:
    """[(source [Ls,Cs], t5_ids [Lt])] -> [[Lt,C]] float32; each block is read once for all the sequences."""
    shape = adapter_shape(weights)
    xs = []
    for source, ids in sequences:
        try:
            xs.append(embedding_rows(weights, "embed.weight", np.asarray(ids, np.int64)))
        except IndexError as exc:
            raise UserError(f"T5 token id out of range ({exc}): the T5 tokenizer does not match this model") from None
    feeds = []
    for (source, _), x in zip(sequences, xs):
        target_cos, target_sin = rope_tables(x.shape[0], shape["head_dim"])
        source_cos, source_sin = rope_tables(source.shape[0], shape["head_dim"])
        feeds.append({"source": np.asarray(source, np.float32), "target_cos": target_cos, "target_sin": target_sin,
                      "source_cos": source_cos, "source_sin": source_sin})
    block, head = _sessions(*shape.values())
    read = _block_reader(weights)
    for j in range(shape["layers"]):
        inputs = read(j)
        xs = [block.run(None, {"x": x, **feed, **inputs})[0] for x, feed in zip(xs, feeds)]
    head_inputs = {f"w{i}": weights[name] for i, name in enumerate(HEAD_TENSORS)}
    return [head.run(None, {"x": x, **head_inputs})[0] for x in xs]


def adapter_shape(weights: Mapping) -> dict[str, int]:
    """The dimensions the graphs are built for, from the tensors' shapes."""
    dims = weights.shape if isinstance(weights, FileTensors) else (lambda name: weights[name].shape)
    dim, source_dim = dims("blocks.0.cross_attn.k_proj.weight")
    head_dim = dims("blocks.0.self_attn.q_norm.weight")[0]
    return {"dim": dim, "source_dim": source_dim, "head_dim": head_dim, "mlp_dim": dims("blocks.0.mlp.0.weight")[0],
            "context_dim": dims("out_proj.weight")[0],
            "layers": sum(1 for key in weights if key.startswith("blocks.") and key.endswith(".norm_mlp.weight"))}


def open_adapter(dit_path) -> FileTensors:
    """The adapter's tensors in the DiT file (names without `llm_adapter.`), each read when it is used."""
    cfg, file = open_dit(dit_path)
    return FileTensors(file, {k[len(ADAPTER_PREFIX):]: k for k in dit_param_shapes(cfg) if k.startswith(ADAPTER_PREFIX)})


def pad_context(x: np.ndarray, length: int = 512) -> np.ndarray:
    """Zero rows appended along the sequence up to `length` (the DiT attends to them; their keys are 0).
    ComfyUI does not truncate longer contexts, and the exported graphs have a fixed length, so that is an error."""
    if x.shape[1] > length:
        raise UserError(f"the prompt is {x.shape[1]} T5 tokens long, the limit is {length}: shorten the prompt")
    return np.pad(x, ((0, 0), (0, length - x.shape[1]), (0, 0)))


def rope_tables(length: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """1-D split-half RoPE over positions 0..length-1: cos, sin float32 [length, head_dim]."""
    inv_freq = ROPE_THETA ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = np.arange(length, dtype=np.float64)[:, None] * inv_freq
    angles = np.concatenate([angles, angles], axis=1)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def _block_reader(weights: Mapping):
    """j -> block j's tensors as the block graph's inputs. From a file, each block is read into float32 buffers
    (and staging buffers of the stored dtype) that every block reuses."""
    if not isinstance(weights, FileTensors):
        return lambda j: {f"w{i}": np.asarray(weights[f"blocks.{j}.{name}"], np.float32) for i, name in enumerate(BLOCK_TENSORS)}
    file, names = weights.file, weights.names
    first = [file.entries[names[f"blocks.0.{name}"]] for name in BLOCK_TENSORS]
    buffers = [np.zeros(entry["shape"], np.float32) for entry in first]
    staging = [np.empty(entry["shape"], STORED_DTYPES.get(entry["dtype"], np.float32)) for entry in first]

    def read(j):
        for i, name in enumerate(BLOCK_TENSORS):
            file.read_into(names[f"blocks.{j}.{name}"], buffers[i], staging[i])
        return {f"w{i}": buffer for i, buffer in enumerate(buffers)}

    return read


@functools.lru_cache(maxsize=2)
def _sessions(dim: int, source_dim: int, head_dim: int, mlp_dim: int, context_dim: int, layers: int):
    """(block session, head session) for one adapter shape; a session holds no weights, so keeping them is cheap."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return tuple(ort.InferenceSession(graph, options, providers=["CPUExecutionProvider"])
                 for graph in (block_graph(dim, source_dim, head_dim, mlp_dim), head_graph(dim, context_dim)))


class _Builder:
    """Nodes of one graph whose weights are inputs (only the few scalars and shapes are constants)."""

    def __init__(self):
        self.nodes, self.constants = [], []
        self._count = itertools.count()

    def node(self, op, inputs, out=None, **attrs):
        out = out or f"t{next(self._count)}"
        self.nodes.append(helper.make_node(op, inputs, [out], **attrs))
        return out

    def const(self, name, values, dtype=TensorProto.FLOAT):
        self.constants.append(helper.make_tensor(name, dtype, [len(values)], values))
        return name

    def rms(self, x, weight):
        mean = self.node("ReduceMean", [self.node("Mul", [x, x]), "minus1"], keepdims=1)
        return self.node("Mul", [self.node("Div", [x, self.node("Sqrt", [self.node("Add", [mean, "eps"])])]), weight])

    def model(self, name, inputs, outputs) -> bytes:
        floats = lambda names_shapes: [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(s)) for n, s in names_shapes]
        graph = helper.make_graph(self.nodes, name, floats(inputs), floats(outputs), self.constants)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()


def block_graph(dim: int, source_dim: int, head_dim: int, mlp_dim: int) -> bytes:
    """One adapter block as an ONNX graph (opset 18): x [Lt, dim], source [Ls, source_dim], the RoPE tables of
    both ([L, head_dim]) and the block's 19 tensors (inputs w0.. in BLOCK_TENSORS order) -> y [Lt, dim].
    Pre-norm self-attention, then cross-attention to the source (RoPE on q at target positions and on k at
    source positions, per-head RMSNorm on q and k before it), then the exact-GELU MLP; no masks."""
    b = _Builder()
    w = {name: f"w{i}" for i, name in enumerate(BLOCK_TENSORS)}
    heads = dim // head_dim
    b.const("eps", [EPS])
    b.const("scale", [head_dim**-0.5])
    b.const("heads_shape", [0, heads, head_dim], TensorProto.INT64)
    b.const("merged_shape", [0, dim], TensorProto.INT64)
    b.const("axis1", [1], TensorProto.INT64)
    b.const("minus1", [-1], TensorProto.INT64)
    b.const("sqrt_half", [0.5**0.5])
    b.const("one", [1.0])
    b.const("half", [0.5])

    def rope(x, cos, sin):  # x [L, heads, hd]; tables [L, hd] broadcast over heads
        first, second = f"t{next(b._count)}", f"t{next(b._count)}"
        b.nodes.append(helper.make_node("Split", [x], [first, second], axis=-1, num_outputs=2))
        rotated = b.node("Concat", [b.node("Neg", [second]), first], axis=-1)
        cos, sin = b.node("Unsqueeze", [cos, "axis1"]), b.node("Unsqueeze", [sin, "axis1"])
        return b.node("Add", [b.node("Mul", [x, cos]), b.node("Mul", [rotated, sin])])

    def linear(x, weight, bias=None):
        return b.node("Gemm", [x, weight] + ([bias] if bias else []), transB=1)

    def attention(prefix, x, context, target_rope, context_rope):
        def heads_of(value, proj):
            return b.node("Reshape", [linear(value, w[f"{prefix}.{proj}.weight"]), "heads_shape"])

        q = rope(b.rms(heads_of(x, "q_proj"), w[f"{prefix}.q_norm.weight"]), *target_rope)
        k = rope(b.rms(heads_of(context, "k_proj"), w[f"{prefix}.k_norm.weight"]), *context_rope)
        v = heads_of(context, "v_proj")
        scores = b.node("Mul", [b.node("MatMul", [b.node("Transpose", [q], perm=[1, 0, 2]),
                                                  b.node("Transpose", [k], perm=[1, 2, 0])]), "scale"])
        attended = b.node("MatMul", [b.node("Softmax", [scores], axis=-1), b.node("Transpose", [v], perm=[1, 0, 2])])
        merged = b.node("Reshape", [b.node("Transpose", [attended], perm=[1, 0, 2]), "merged_shape"])
        return linear(merged, w[f"{prefix}.o_proj.weight"])

    target, source = ("target_cos", "target_sin"), ("source_cos", "source_sin")
    h = b.rms("x", w["norm_self_attn.weight"])
    x = b.node("Add", ["x", attention("self_attn", h, h, target, target)])
    h = b.rms(x, w["norm_cross_attn.weight"])
    x = b.node("Add", [x, attention("cross_attn", h, "source", target, source)])
    h = linear(b.rms(x, w["norm_mlp.weight"]), w["mlp.0.weight"], w["mlp.0.bias"])
    erf = b.node("Erf", [b.node("Mul", [h, "sqrt_half"])])
    h = b.node("Mul", [b.node("Mul", [h, b.node("Add", [erf, "one"])]), "half"])
    b.node("Add", [x, linear(h, w["mlp.2.weight"], w["mlp.2.bias"])], out="y")

    inputs = [("x", ["Lt", dim]), ("source", ["Ls", source_dim]), ("target_cos", ["Lt", head_dim]), ("target_sin", ["Lt", head_dim]),
              ("source_cos", ["Ls", head_dim]), ("source_sin", ["Ls", head_dim])]
    shapes = _block_shapes(dim, source_dim, head_dim, mlp_dim)
    inputs += [(w[name], shapes[name]) for name in BLOCK_TENSORS]
    return b.model("llm_adapter_block", inputs, [("y", ["Lt", dim])])


def head_graph(dim: int, context_dim: int) -> bytes:
    """The adapter's output: RMSNorm(x @ out_proj.T + bias), x [Lt, dim] -> y [Lt, context_dim]."""
    b = _Builder()
    b.const("eps", [EPS])
    b.const("minus1", [-1], TensorProto.INT64)
    b.rms(b.node("Gemm", ["x", "w0", "w1"], transB=1), "w2")
    b.nodes[-1].output[0] = "y"
    return b.model("llm_adapter_head", [("x", ["Lt", dim]), ("w0", [context_dim, dim]), ("w1", [context_dim]), ("w2", [context_dim])],
                   [("y", ["Lt", context_dim])])


def _block_shapes(dim: int, source_dim: int, head_dim: int, mlp_dim: int) -> dict[str, list[int]]:
    shapes = {f"{part}.weight": [dim] for part in ("norm_self_attn", "norm_cross_attn", "norm_mlp")}
    for attn, kv_in in (("self_attn", dim), ("cross_attn", source_dim)):
        shapes.update({f"{attn}.q_proj.weight": [dim, dim], f"{attn}.k_proj.weight": [dim, kv_in],
                       f"{attn}.v_proj.weight": [dim, kv_in], f"{attn}.o_proj.weight": [dim, dim],
                       f"{attn}.q_norm.weight": [head_dim], f"{attn}.k_norm.weight": [head_dim]})
    shapes.update({"mlp.0.weight": [mlp_dim, dim], "mlp.0.bias": [mlp_dim], "mlp.2.weight": [dim, mlp_dim], "mlp.2.bias": [dim]})
    return shapes
