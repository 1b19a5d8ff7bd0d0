"""Branch graphs built from NumPy weights (what `anima-ui export` writes) equal the torch branch modules and the
graphs torch used to export; they use plain ops only; cross_attention_kv and the branch bodies match a direct NumPy transcription of the spec."""

import math
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from anima_ui.model.branch_graphs import branch_graph
from anima_ui.model.branches import BRANCH_CLASSES
from anima_ui.model.config import BRANCH_INPUTS
from anima_ui.model.host import block_weights, cross_attention_kv
from anima_ui.model.forward import prepare_rope

# Static-shape plain ops (no Shape/Gather, no complex numbers, no fused attention): what the RKNN converter maps.
PLAIN_OPS = {
    "MatMul", "Mul", "Add", "Div", "Neg", "Pow", "Sqrt", "ReduceMean", "Softmax", "Erf",
    "Reshape", "Transpose", "Slice", "Concat", "Unsqueeze", "Constant",
}


def branch_inputs(cfg, kind, batch=2, height=8, width=12, seed=0):
    rng = np.random.default_rng(seed)
    tokens = (height // cfg.patch) * (width // cfg.patch)
    inputs = {"h": rng.standard_normal((batch, tokens, cfg.width)).astype(np.float32)}
    if kind == "self_attn":
        inputs["rope_cos"], inputs["rope_sin"] = prepare_rope(cfg, height, width)
    if kind == "cross_attn":
        inputs["k"] = rng.standard_normal((batch, cfg.context_len, cfg.width)).astype(np.float32)
        inputs["v"] = rng.standard_normal((batch, cfg.context_len, cfg.width)).astype(np.float32)
    return inputs


def run_torch(module, kind, inputs):
    with torch.inference_mode():
        return module(*[torch.from_numpy(inputs[n]) for n in BRANCH_INPUTS[kind]]).numpy()


def run_graph(model: onnx.ModelProto, inputs: dict, dtype=np.float32) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [i.name for i in model.graph.input]
    return session.run(["out"], {n: inputs[n].astype(dtype) for n in names})[0].astype(np.float64)


def built_graph(cfg, state, kind, batch, dtype="float32", block=1):
    tokens = (8 // cfg.patch) * (12 // cfg.patch)
    return branch_graph(kind, block_weights(state, block), batch, tokens, cfg.context_len, dtype)


def torch_exported_graph(module, kind, inputs, path, dtype=torch.float32) -> onnx.ModelProto:
    """What `anima-ui export` wrote before the graphs were built directly (TorchScript exporter, opset 19)."""
    with warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice
        torch.onnx.export(module.to(dtype), tuple(torch.from_numpy(inputs[n]).to(dtype) for n in BRANCH_INPUTS[kind]), str(path),
                          input_names=list(BRANCH_INPUTS[kind]), output_names=["out"], opset_version=19, dynamo=False)
    return onnx.load(str(path))


def cosine(a, b) -> float:
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("kind", ["self_attn", "cross_attn", "mlp"])
def test_built_graph_matches_torch_module(tiny_cfg, tiny_state, kind, batch):
    """The graph built from NumPy weights computes what the torch reference module computes, to fp32 rounding."""
    graph = built_graph(tiny_cfg, tiny_state, kind, batch)
    onnx.checker.check_model(graph)
    assert graph.opset_import[0].version == 19
    assert [i.name for i in graph.graph.input] == list(BRANCH_INPUTS[kind])
    assert [o.name for o in graph.graph.output] == ["out"]
    assert {node.op_type for node in graph.graph.node} <= PLAIN_OPS
    inputs = branch_inputs(tiny_cfg, kind, batch=batch)
    ours = run_graph(graph, inputs)
    reference = run_torch(BRANCH_CLASSES[kind](block_weights(tiny_state, 1)).eval(), kind, inputs)
    assert ours.shape == inputs["h"].shape
    assert np.linalg.norm(ours - reference) / np.linalg.norm(reference) < 2e-6


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("kind", ["self_attn", "cross_attn", "mlp"])
def test_built_graph_matches_the_torch_exported_graph(tiny_cfg, tiny_state, tmp_path, kind, dtype):
    """The built graphs replace the torch-exported ones: per graph, cosine >= 0.99999 between the two under
    onnxruntime, at both precisions (batch 2)."""
    inputs = branch_inputs(tiny_cfg, kind)
    old = torch_exported_graph(BRANCH_CLASSES[kind](block_weights(tiny_state, 1)).eval(), kind, inputs, tmp_path / "old.onnx",
                               torch.float16 if dtype == "float16" else torch.float32)
    new = built_graph(tiny_cfg, tiny_state, kind, 2, dtype)
    a, b = run_graph(new, inputs, dtype), run_graph(old, inputs, dtype)
    assert a.shape == b.shape and np.isfinite(a).all()
    assert cosine(a, b) >= 0.99999


def test_built_graphs_pin_the_kind_and_the_block(tiny_cfg, tiny_state):
    """Guards the comparisons above: another block's weights or another kind give a clearly different output."""
    inputs = branch_inputs(tiny_cfg, "mlp")
    same_kind_other_block = run_graph(built_graph(tiny_cfg, tiny_state, "mlp", 2, block=0), inputs)
    reference = run_torch(BRANCH_CLASSES["mlp"](block_weights(tiny_state, 1)).eval(), "mlp", inputs)
    assert cosine(same_kind_other_block, reference) < 0.9


def _rms(x, w, eps=1e-6):
    return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + eps) * w


def _softmax_attention(q, k, v):
    """q [B,H,N,hd], k/v [B,H,S,hd], float64."""
    logits = q @ k.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1])
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    return (weights / weights.sum(-1, keepdims=True)) @ v


def _heads(x, head_dim):
    b, n, d = x.shape
    return x.reshape(b, n, d // head_dim, head_dim).transpose(0, 2, 1, 3)


def _merge(x):
    b, h, n, hd = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b, n, h * hd)


def test_self_attention_matches_spec_transcription(tiny_cfg, tiny_state):
    """§3.3-3.4 written out pair by pair: y[d] = x[d]cos − x[d+hd/2]sin, y[d+hd/2] = x[d]sin + x[d+hd/2]cos."""
    w = {k: v.astype(np.float64) for k, v in block_weights(tiny_state, 0).items()}
    inputs = branch_inputs(tiny_cfg, "self_attn")
    h, hd = inputs["h"].astype(np.float64), tiny_cfg.head_dim
    half = hd // 2
    angles = np.arctan2(inputs["rope_sin"][:, :half], inputs["rope_cos"][:, :half]).astype(np.float64)

    def rotate(x):
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * np.cos(angles) - x2 * np.sin(angles), x1 * np.sin(angles) + x2 * np.cos(angles)], -1)

    q = rotate(_rms(_heads(h @ w["self_attn.q_proj.weight"].T, hd), w["self_attn.q_norm.weight"]))
    k = rotate(_rms(_heads(h @ w["self_attn.k_proj.weight"].T, hd), w["self_attn.k_norm.weight"]))
    v = _heads(h @ w["self_attn.v_proj.weight"].T, hd)
    expected = _merge(_softmax_attention(q, k, v)) @ w["self_attn.output_proj.weight"].T

    ours = run_torch(BRANCH_CLASSES["self_attn"](block_weights(tiny_state, 0)), "self_attn", inputs)
    assert np.linalg.norm(ours - expected) / np.linalg.norm(expected) < 1e-5


def test_cross_attention_and_kv_match_spec_transcription(tiny_cfg, tiny_state):
    """k_norm'ed keys from cross_attention_kv + the branch = §3.4 CrossAttn; zero context rows give zero keys."""
    rng = np.random.default_rng(2)
    context = rng.standard_normal((2, tiny_cfg.context_len, tiny_cfg.context_dim)).astype(np.float32)
    context[:, 30:] = 0.0
    weights = block_weights(tiny_state, 1)
    k, v = cross_attention_kv(weights, context)
    assert k.shape == v.shape == (2, tiny_cfg.context_len, tiny_cfg.width)
    assert not k[:, 30:].any() and not v[:, 30:].any()

    w = {name: a.astype(np.float64) for name, a in weights.items()}
    hd = tiny_cfg.head_dim
    h = branch_inputs(tiny_cfg, "mlp")["h"].astype(np.float64)
    c = context.astype(np.float64)
    q = _rms(_heads(h @ w["cross_attn.q_proj.weight"].T, hd), w["cross_attn.q_norm.weight"])
    k64 = _rms(_heads(c @ w["cross_attn.k_proj.weight"].T, hd), w["cross_attn.k_norm.weight"])
    v64 = _heads(c @ w["cross_attn.v_proj.weight"].T, hd)
    expected = _merge(_softmax_attention(q, k64, v64)) @ w["cross_attn.output_proj.weight"].T

    ours = run_torch(BRANCH_CLASSES["cross_attn"](weights), "cross_attn", {"h": h.astype(np.float32), "k": k, "v": v})
    assert np.linalg.norm(ours - expected) / np.linalg.norm(expected) < 1e-5


def test_feed_forward_uses_exact_gelu(tiny_cfg, tiny_state):
    w = block_weights(tiny_state, 0)
    h = branch_inputs(tiny_cfg, "mlp")["h"]
    pre = h.astype(np.float64) @ w["mlp.layer1.weight"].T
    expected = (0.5 * pre * (1.0 + np.vectorize(math.erf)(pre / np.sqrt(2.0)))) @ w["mlp.layer2.weight"].T
    ours = run_torch(BRANCH_CLASSES["mlp"](w), "mlp", {"h": h})
    assert np.linalg.norm(ours - expected) / np.linalg.norm(expected) < 1e-6
