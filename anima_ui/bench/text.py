"""`anima-ui bench text --models DIR`: the text-encoding engines side by side, per prompt length: Qwen3-0.6B,
then the LLM adapter.

- onnx: the app's engine (text/qwen3.py): each encode streams the bf16 file one layer at a time, widens it to
  float32 and runs one decoder-layer graph (built with onnx.helper) on onnxruntime.
- numpy: the same streaming with the layer's maths written in NumPy (below), the alternative to onnxruntime.
- torch: transformers' Qwen3Model with every weight in float32 in memory (the engine the app used before).

The adapter (T5 ids cross-attending to Qwen3 states, six blocks read from the DiT file per prompt):
- onnx: the app's engine (model/adapter.py): one block graph on onnxruntime, blocks streamed into reused buffers.
- numpy: the same maths in NumPy, each tensor read when it is used (the engine the app used before).

Seconds are medians over --repeats, measured in one process with the engines interleaved (the machine's
load hits all of them alike). Peak RSS comes from a fresh process per engine (load, then encode every
length once): the interpreter, the libraries the engine imports, its weights and its activations.
Token ids are random (encoding time depends only on the count)."""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from anima_ui.model.adapter import adapt_sequences, open_adapter, rope_tables as adapter_rope_tables
from anima_ui.model.host import rms_norm
from anima_ui.model.tensor_file import embedding_rows
from anima_ui.modelfiles import ModelPaths
from anima_ui.runtime.memory import peak_rss_bytes
from anima_ui.text.qwen3 import RMS_NORM_EPS, ROPE_THETA, STORED_DTYPES, Qwen3, Qwen3Shape, layer_shapes, rope_tables

ENGINES = ("onnx", "numpy", "torch")


def add_arguments(parser):
    parser.add_argument("--models", required=True, help="model folder (full-size random weights: anima-ui random-model --config full)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[12, 300], help="prompt lengths in Qwen tokens")
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-adapter", action="store_true", help="skip the adapter rows")
    parser.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)  # one engine's peak-RSS process


def run(args) -> int:
    path = ModelPaths.find(args.models).text_encoder
    sequences = _sequences(args.lengths, Qwen3(path).shape.vocab)
    if args.worker:
        print(json.dumps(_peak_worker(args.worker, path, sequences)))
        return 0
    peaks = {engine: _peak_in_subprocess(engine, args) for engine in args.engines}
    engines = {engine: _open(engine, path) for engine in args.engines}
    seconds = {(engine, len(ids)): [] for engine in engines for ids in sequences}
    outputs = {}
    for _ in range(args.repeats):
        for ids in sequences:
            for engine, encode in engines.items():
                started = time.perf_counter()
                outputs[engine, len(ids)] = encode(ids)
                seconds[engine, len(ids)].append(time.perf_counter() - started)
    print(f"Qwen3 text encoder, {path} (median of {args.repeats}; peak RSS of a fresh process encoding every length)")
    print(f"{'engine':>7} {'tokens':>7} {'seconds':>8} {'max |diff| vs torch':>20} {'load s':>7} {'peak RSS MB':>12}")
    for engine in engines:
        for ids in sequences:
            reference = outputs.get(("torch", len(ids)))
            diff = f"{np.abs(outputs[engine, len(ids)] - reference).max():.2e}" if reference is not None else "-"
            peak = peaks[engine]
            print(f"{engine:>7} {len(ids):>7} {np.median(seconds[engine, len(ids)]):8.2f} {diff:>20} "
                  f"{peak['load_seconds']:7.2f} {peak['peak_rss_mb']:12.0f}")
    if not args.no_adapter:
        _bench_adapter(args)
    return 0


def _bench_adapter(args) -> None:
    """The adapter engines interleaved in this process, on random Qwen3 states and T5 ids of each length."""
    weights = open_adapter(ModelPaths.find(args.models).dit)
    rng = np.random.default_rng(1)
    source_dim, vocab = weights.shape("blocks.0.cross_attn.k_proj.weight")[1], weights.shape("embed.weight")[0]
    inputs = [(rng.standard_normal((n, source_dim)).astype(np.float32), rng.integers(0, vocab, n)) for n in args.lengths]
    engines = {"onnx": lambda source, ids: adapt_sequences(weights, [(source, ids)])[0],
               "numpy": lambda source, ids: numpy_adapter(weights, source, ids)}
    seconds = {(engine, len(ids)): [] for engine in engines for _, ids in inputs}
    outputs = {}
    for _ in range(args.repeats):
        for source, ids in inputs:
            for engine, adapt in engines.items():
                started = time.perf_counter()
                outputs[engine, len(ids)] = adapt(source, ids)
                seconds[engine, len(ids)].append(time.perf_counter() - started)
    print(f"LLM adapter, {weights.file.path} (median of {args.repeats}; Qwen3 states and T5 ids of the same length)")
    print(f"{'engine':>7} {'tokens':>7} {'seconds':>8} {'max |diff| vs numpy':>20}")
    for engine in engines:
        for _, ids in inputs:
            diff = np.abs(outputs[engine, len(ids)] - outputs["numpy", len(ids)]).max()
            print(f"{engine:>7} {len(ids):>7} {np.median(seconds[engine, len(ids)]):8.2f} {diff:20.2e}")


def _sequences(lengths, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def _peak_in_subprocess(engine: str, args) -> dict:
    command = [sys.executable, "-m", "anima_ui", "bench", "text", "--models", str(args.models), "--worker", engine,
               "--lengths", *map(str, args.lengths)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{engine} worker failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.splitlines()[-1])


def _peak_worker(engine: str, path: Path, sequences) -> dict:
    started = time.perf_counter()
    encode = _open(engine, path)
    load_seconds = time.perf_counter() - started
    for ids in sequences:
        encode(ids)
    return {"load_seconds": load_seconds, "peak_rss_mb": peak_rss_bytes() / 2**20}


def _open(engine: str, path: Path):
    """A function ids -> float32 [len(ids), hidden] for the engine, loaded."""
    if engine == "onnx":
        qwen3 = Qwen3(path)
        return lambda ids: qwen3.final_hidden_states([ids])[0][0]
    if engine == "numpy":
        return _numpy_engine(path)
    return _torch_engine(path)


def _torch_engine(path: Path):
    import torch  # the PC-only comparison engine
    from safetensors.torch import load_file
    from transformers import Qwen3Config, Qwen3Model

    shape = Qwen3(path).shape
    config = Qwen3Config(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim, rms_norm_eps=RMS_NORM_EPS, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
    )
    state = {k[len("model."):]: v.float() for k, v in load_file(str(path)).items() if k.startswith("model.")}
    with torch.device("meta"):
        model = Qwen3Model(config)
    model.load_state_dict(state, strict=True, assign=True)
    model.rotary_emb = type(model.rotary_emb)(config)  # its tables are not in the file: build them on the CPU
    model.eval()

    def encode(ids):
        with torch.inference_mode():
            return model(input_ids=torch.tensor([ids]), use_cache=False).last_hidden_state[0].numpy()

    return encode


def _numpy_engine(path: Path):
    """The app's streaming (same file reads, same reused buffers) with the layer computed by decoder_layer."""
    qwen3 = Qwen3(path)
    file, shape = qwen3.file, qwen3.shape
    shapes = layer_shapes(shape)

    def encode(ids):
        weights = {name: np.zeros(s, np.float32) for name, s in shapes.items()}
        staging = {name: np.empty(s, STORED_DTYPES[file.entries[f"model.layers.0.{name}"]["dtype"]]) for name, s in shapes.items()}
        x = file.read_rows("model.embed_tokens.weight", ids)
        rope = rope_tables(len(ids), shape.head_dim)
        for i in range(shape.layers):
            for name in shapes:
                file.read_into(f"model.layers.{i}.{name}", weights[name], staging[name])
            x = decoder_layer(x, weights, shape, rope)
        return rms_norm(x, file.read("model.norm.weight"), RMS_NORM_EPS)

    return encode


def decoder_layer(x: np.ndarray, w: dict[str, np.ndarray], shape: Qwen3Shape, rope) -> np.ndarray:
    """One Qwen3 decoder layer in NumPy float32, x [L, hidden] -> [L, hidden]: pre-norm causal GQA
    self-attention, then the SwiGLU MLP."""
    x = x + _attention(rms_norm(x, w["input_layernorm.weight"], RMS_NORM_EPS), w, shape, rope)
    h = rms_norm(x, w["post_attention_layernorm.weight"], RMS_NORM_EPS)
    gate = h @ w["mlp.gate_proj.weight"].T
    return x + (gate / (1.0 + np.exp(-gate)) * (h @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T


def _attention(h: np.ndarray, w: dict, shape: Qwen3Shape, rope) -> np.ndarray:
    """q/k/v, per-head RMSNorm on q and k before RoPE, causal softmax; KV head g serves query heads
    g·r .. g·r+r-1 (r = heads / kv_heads)."""
    length, hd, groups = h.shape[0], shape.head_dim, shape.heads // shape.kv_heads
    q = rms_norm((h @ w["self_attn.q_proj.weight"].T).reshape(length, shape.heads, hd), w["self_attn.q_norm.weight"], RMS_NORM_EPS)
    k = rms_norm((h @ w["self_attn.k_proj.weight"].T).reshape(length, shape.kv_heads, hd), w["self_attn.k_norm.weight"], RMS_NORM_EPS)
    v = (h @ w["self_attn.v_proj.weight"].T).reshape(length, shape.kv_heads, hd)
    q, k = _rotate(q, rope), _rotate(k, rope)
    # one matrix per KV head holding its r query heads' rows (a broadcast matmul would leave BLAS)
    q = q.reshape(length, shape.kv_heads, groups, hd).transpose(1, 2, 0, 3).reshape(shape.kv_heads, groups * length, hd)
    scores = (q @ k.transpose(1, 2, 0)) * np.float32(hd**-0.5)  # [kv, r·L, L]
    scores += np.tile(np.triu(np.full((length, length), -np.inf, np.float32), k=1), (groups, 1))
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    scores /= scores.sum(axis=-1, keepdims=True)
    out = (scores @ v.transpose(1, 0, 2)).reshape(shape.kv_heads, groups, length, hd)
    return out.transpose(2, 0, 1, 3).reshape(length, shape.heads * hd) @ w["self_attn.o_proj.weight"].T


def _rotate(x: np.ndarray, rope) -> np.ndarray:
    """x [L, H, hd]: x·cos + rotate_half(x)·sin with rotate_half([a, b]) = [-b, a]."""
    cos, sin = rope[0][:, None, :], rope[1][:, None, :]
    half = x.shape[-1] // 2
    return x * cos + np.concatenate([-x[..., half:], x[..., :half]], axis=-1) * sin


def numpy_adapter(weights, source: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """The adapter in NumPy float32, each tensor read from the file when it is used: source [Ls, Cs], ids [Lt]
    -> [Lt, C]. The maths of model/adapter.py's graphs (exact-erf GELU, no masks)."""
    x = embedding_rows(weights, "embed.weight", np.asarray(ids, np.int64))
    head_dim = weights.shape("blocks.0.self_attn.q_norm.weight")[0]
    target_rope, source_rope = adapter_rope_tables(len(ids), head_dim), adapter_rope_tables(len(source), head_dim)
    blocks = sum(1 for key in weights if key.startswith("blocks.") and key.endswith(".norm_mlp.weight"))
    for j in range(blocks):
        p = f"blocks.{j}."
        h = rms_norm(x, weights[p + "norm_self_attn.weight"])
        x = x + _adapter_attention(weights, p + "self_attn.", h, h, target_rope, target_rope)
        h = rms_norm(x, weights[p + "norm_cross_attn.weight"])
        x = x + _adapter_attention(weights, p + "cross_attn.", h, source, target_rope, source_rope)
        h = rms_norm(x, weights[p + "norm_mlp.weight"]) @ weights[p + "mlp.0.weight"].T + weights[p + "mlp.0.bias"]
        h = (h * (0.5 + 0.5 * _erf(h.astype(np.float64) * 0.5**0.5))).astype(np.float32)
        x = x + h @ weights[p + "mlp.2.weight"].T + weights[p + "mlp.2.bias"]
    return rms_norm(x @ weights["out_proj.weight"].T + weights["out_proj.bias"], weights["norm.weight"])


# erf(x) ≈ x·P(x²)/Q(x²) on [-4, 4] (±1 beyond): the rational fit Eigen and XLA use for float32 (NumPy has no erf)
_ERF_P = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
          -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02)
_ERF_Q = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
          -1.42647390514189e-02)


def _erf(x: np.ndarray) -> np.ndarray:
    x = np.clip(x, -4.0, 4.0)
    return x * np.polyval(_ERF_P, x * x) / np.polyval(_ERF_Q, x * x)


def _adapter_attention(weights, prefix: str, x: np.ndarray, context: np.ndarray, rope_q, rope_k) -> np.ndarray:
    """x [Lq, C], context [Lk, Cs]: q/k/v, per-head RMSNorm on q and k, RoPE on both, no mask, then o_proj."""
    head_dim = weights.shape(prefix + "q_norm.weight")[0]
    q = (x @ weights[prefix + "q_proj.weight"].T).reshape(len(x), -1, head_dim)
    k = (context @ weights[prefix + "k_proj.weight"].T).reshape(len(context), -1, head_dim)
    v = (context @ weights[prefix + "v_proj.weight"].T).reshape(len(context), -1, head_dim).transpose(1, 0, 2)
    q = _rotate(rms_norm(q, weights[prefix + "q_norm.weight"]), rope_q).transpose(1, 0, 2)
    k = _rotate(rms_norm(k, weights[prefix + "k_norm.weight"]), rope_k).transpose(1, 0, 2)
    scores = (q @ k.transpose(0, 2, 1)) * np.float32(head_dim**-0.5)
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    scores /= scores.sum(axis=-1, keepdims=True)
    return (scores @ v).transpose(1, 0, 2).reshape(len(x), -1) @ weights[prefix + "o_proj.weight"].T
