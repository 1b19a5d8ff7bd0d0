"""The LLM adapter inside the DiT checkpoint, in NumPy float32: T5-token queries cross-attend to Qwen3
hidden states and become the DiT's cross-attention context. ComfyUI semantics: no attention masks,
zero-padded to 512."""

from collections.abc import Mapping

import numpy as np

from anima_ui.errors import UserError
from anima_ui.model.checkpoint import ADAPTER_PREFIX, dit_param_shapes, open_dit
from anima_ui.model.host import rms_norm
from anima_ui.model.tensor_file import FileTensors, embedding_rows

ROPE_THETA = 10000.0


def llm_adapter_forward(weights: Mapping[str, np.ndarray], source: np.ndarray, t5_ids: np.ndarray) -> np.ndarray:
    """weights: the adapter's tensors without `llm_adapter.` (`split_adapter(state)`, or a FileTensors
    that reads each one when it is used); source [B,Ls,Cs] Qwen3 final hidden states; t5_ids [B,Lt] int
    -> [B,Lt,C] float32 (not padded; see pad_context)."""
    source = np.asarray(source, dtype=np.float32)
    ids = np.asarray(t5_ids, dtype=np.int64)
    try:
        x = embedding_rows(weights, "embed.weight", ids.ravel()).reshape(*ids.shape, -1)
    except IndexError as exc:
        raise UserError(f"T5 token id out of range ({exc}): the T5 tokenizer does not match this model") from None
    head_dim = weights["blocks.0.self_attn.q_norm.weight"].shape[0]
    target_rope = _rope(ids.shape[1], head_dim)
    source_rope = _rope(source.shape[1], head_dim)
    for j in range(_num_layers(weights)):
        p = f"blocks.{j}."
        h = rms_norm(x, weights[p + "norm_self_attn.weight"])
        x = x + _attention(weights, p + "self_attn.", h, h, target_rope, target_rope)
        h = rms_norm(x, weights[p + "norm_cross_attn.weight"])
        x = x + _attention(weights, p + "cross_attn.", h, source, target_rope, source_rope)
        h = rms_norm(x, weights[p + "norm_mlp.weight"])
        h = gelu(h @ weights[p + "mlp.0.weight"].T + weights[p + "mlp.0.bias"])
        x = x + h @ weights[p + "mlp.2.weight"].T + weights[p + "mlp.2.bias"]
    out = rms_norm(x @ weights["out_proj.weight"].T + weights["out_proj.bias"], weights["norm.weight"])
    return out.astype(np.float32, copy=False)


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


def gelu(x: np.ndarray) -> np.ndarray:
    """Exact (erf) GELU, x·Φ(x), float32 in and out."""
    return (x * (0.5 + 0.5 * erf(x.astype(np.float64) * 0.5**0.5))).astype(np.float32)


# erf(x) ≈ x·P(x²)/Q(x²) on [-4, 4] (±1 beyond): the rational fit Eigen and XLA use for float32, within
# 2 float32 ulps of the true erf. NumPy has no erf; this runs in float64, so only the fit's error remains.
_ERF_P = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
          -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02)
_ERF_Q = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
          -1.42647390514189e-02)


def erf(x: np.ndarray) -> np.ndarray:
    x = np.clip(x, -4.0, 4.0)
    x2 = x * x
    return x * np.polyval(_ERF_P, x2) / np.polyval(_ERF_Q, x2)


def _num_layers(weights: Mapping) -> int:
    return sum(1 for key in weights if key.startswith("blocks.") and key.endswith(".norm_mlp.weight"))


def _rope(length: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """1-D split-half RoPE over positions 0..length-1: cos, sin [length, head_dim]."""
    inv_freq = ROPE_THETA ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = np.arange(length, dtype=np.float64)[:, None] * inv_freq
    angles = np.concatenate([angles, angles], axis=1)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def _apply_rope(x: np.ndarray, rope: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """x [B,H,L,hd]."""
    cos, sin = rope
    half = x.shape[-1] // 2
    return x * cos + np.concatenate([-x[..., half:], x[..., :half]], axis=-1) * sin


def _attention(weights: Mapping, prefix: str, x: np.ndarray, context: np.ndarray, rope_q, rope_k) -> np.ndarray:
    """q from x, k/v from context; per-head RMSNorm on q and k, RoPE on both (q at target positions, k at
    context positions — also in the cross-attention), no mask, then o_proj."""
    head_dim = weights[prefix + "q_norm.weight"].shape[0]
    b, lq, _ = x.shape
    lk = context.shape[1]
    q = (x @ weights[prefix + "q_proj.weight"].T).reshape(b, lq, -1, head_dim)
    k = (context @ weights[prefix + "k_proj.weight"].T).reshape(b, lk, -1, head_dim)
    v = (context @ weights[prefix + "v_proj.weight"].T).reshape(b, lk, -1, head_dim).transpose(0, 2, 1, 3)
    q = _apply_rope(rms_norm(q, weights[prefix + "q_norm.weight"]).transpose(0, 2, 1, 3), rope_q)
    k = _apply_rope(rms_norm(k, weights[prefix + "k_norm.weight"]).transpose(0, 2, 1, 3), rope_k)
    scores = (q @ k.transpose(0, 1, 3, 2)) * np.float32(head_dim**-0.5)
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    scores /= scores.sum(axis=-1, keepdims=True)
    out = (scores @ v).transpose(0, 2, 1, 3).reshape(b, lq, -1)
    return out @ weights[prefix + "o_proj.weight"].T
