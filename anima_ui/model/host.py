"""The DiT's host-side ops in NumPy float32: everything between the three branch graphs of each block.

The residual stream stays float32 here whatever precision the branches run in (ComfyUI: "the residual
stream for this model has large values")."""

import numpy as np

from anima_ui.errors import UserError
from anima_ui.model.config import BRANCH_KINDS, AnimaConfig

EPS = 1e-6


def patchify(x: np.ndarray, patch: int) -> np.ndarray:
    """[B, C, h, w] -> [B, N, (C+1)·p·p] with the zero padding-mask channel appended; feature order
    (c, m, n) = channel-major, tokens row-major over the patch grid."""
    b, c, h, w = x.shape
    if h % patch or w % patch:
        raise UserError(f"latent size {h}x{w} is not a multiple of the patch size {patch}: use image sizes that are multiples of 16")
    with_mask = np.concatenate([x, np.zeros((b, 1, h, w), x.dtype)], axis=1)
    grid = with_mask.reshape(b, c + 1, h // patch, patch, w // patch, patch)
    return np.ascontiguousarray(grid.transpose(0, 2, 4, 1, 3, 5)).reshape(b, (h // patch) * (w // patch), (c + 1) * patch * patch)


def unpatchify(y: np.ndarray, h: int, w: int, patch: int, channels: int) -> np.ndarray:
    """[B, N, p·p·C] -> [B, C, h, w]; the output features are ordered (p1, p2, c), unlike the input's (c, m, n)."""
    b = y.shape[0]
    grid = y.reshape(b, h // patch, w // patch, patch, patch, channels)
    return np.ascontiguousarray(grid.transpose(0, 5, 1, 3, 2, 4)).reshape(b, channels, h, w)


def timestep_embedding(sigma: np.ndarray, dim: int) -> np.ndarray:
    """Sinusoid of t = σ (multiplier 1.0, not ×1000): [cos(t·ω), sin(t·ω)], ω_k = 10000^(−k/(dim/2))."""
    half = dim // 2
    freqs = np.exp(-np.log(10000.0) * np.arange(half, dtype=np.float64) / half)
    angles = np.asarray(sigma, np.float64)[:, None] * freqs[None, :]
    return np.concatenate([np.cos(angles), np.sin(angles)], axis=1).astype(np.float32)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float = EPS) -> np.ndarray:
    return x / np.sqrt(np.mean(np.square(x), axis=-1, keepdims=True) + eps) * weight


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def t_embedding(weights: dict, sigma: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(e, L): e = RMSNorm(sinusoid) conditions every AdaLN; L = W2·SiLU(W1·sinusoid) is the AdaLN-LoRA
    term added to every modulation. Both [B, ·] float32."""
    w1 = weights["t_embedder.1.linear_1.weight"]
    s = timestep_embedding(sigma, w1.shape[1])
    e = rms_norm(s, weights["t_embedding_norm.weight"])
    lora = silu(s @ w1.T) @ weights["t_embedder.1.linear_2.weight"].T
    return e.astype(np.float32), lora.astype(np.float32)


def modulation(weights: dict, prefix: str, silu_e: np.ndarray, lora: np.ndarray, chunks: int) -> list[np.ndarray]:
    """W2·(W1·SiLU(e)) + L, split into `chunks` pieces of the model width (shift, scale[, gate])."""
    w1 = weights[f"{prefix}.1.weight"]
    w2 = weights[f"{prefix}.2.weight"]
    out = (silu_e @ w1.T) @ w2.T + lora[:, :w2.shape[0]]
    return np.split(out, chunks, axis=1)


def block_modulations(weights: dict, num_blocks: int, e: np.ndarray, lora: np.ndarray) -> list[dict]:
    """Per block and branch kind: (shift, scale, gate), each [B, D]. Computed once per forward."""
    silu_e = silu(e)
    return [
        {kind: modulation(weights, f"blocks.{i}.adaln_modulation_{kind}", silu_e, lora, 3) for kind in BRANCH_KINDS}
        for i in range(num_blocks)
    ]


def layer_norm(x: np.ndarray, eps: float = EPS) -> np.ndarray:
    """Weightless LayerNorm over the last axis (a new array)."""
    centered = x - x.mean(axis=-1, keepdims=True)
    variance = np.einsum("...d,...d->...", centered, centered)[..., None] / x.shape[-1]
    centered *= 1.0 / np.sqrt(variance + eps)
    return centered


def adaln(x: np.ndarray, shift: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """LN(x)·(1 + scale) + shift, with [B, D] modulation broadcast over the tokens of x [B, N, D]."""
    h = layer_norm(x)
    h *= 1.0 + scale[:, None, :]
    h += shift[:, None, :]
    return h


def fold_input_scale(shift: np.ndarray, scale: np.ndarray, lam: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(shift, scale) such that adaln(x, shift, scale) = adaln(x, shift₀, scale₀) / λ: ((1 + scale)/λ − 1, shift/λ)."""
    lam = np.asarray(lam, np.float32)
    return shift / lam, (1.0 + scale) / lam - 1.0


def add_gated(x: np.ndarray, gate: np.ndarray, branch_out: np.ndarray) -> None:
    """The residual update x += gate ⊙ branch, in place, in float32."""
    x += gate[:, None, :] * branch_out


def rope_tables(cfg: AnimaConfig, h: int, w: int) -> tuple[np.ndarray, np.ndarray]:
    """3-D RoPE for an image latent of h×w: cos, sin [N, head_dim] float32 over the patch grid (row-major).
    Layout is split-half (pairs d, d + hd/2): each half holds the angles [t | h | w], so the branch computes
    q·cos + rotate_half(q)·sin with rotate_half([a, b]) = [−b, a]."""
    dim_t, dim_h, dim_w = cfg.rope_dims
    rows, cols = h // cfg.patch, w // cfg.patch
    theta_h = cfg.rope_theta * cfg.rope_hw_extrapolation ** (dim_h / (dim_h - 2))  # NTK-scaled
    theta_w = cfg.rope_theta * cfg.rope_hw_extrapolation ** (dim_w / (dim_w - 2))
    freqs_h = theta_h ** (-np.arange(0, dim_h, 2, dtype=np.float64) / dim_h)
    freqs_w = theta_w ** (-np.arange(0, dim_w, 2, dtype=np.float64) / dim_w)
    i, j = np.meshgrid(np.arange(rows, dtype=np.float64), np.arange(cols, dtype=np.float64), indexing="ij")
    angles = np.concatenate(
        [
            np.zeros((rows * cols, dim_t // 2)),  # frame 0: temporal angles are 0 whatever their frequencies
            i.reshape(-1, 1) * freqs_h,
            j.reshape(-1, 1) * freqs_w,
        ],
        axis=1,
    )
    angles = np.concatenate([angles, angles], axis=1)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def final_layer(weights: dict, x: np.ndarray, e: np.ndarray, lora: np.ndarray) -> np.ndarray:
    """AdaLN (shift, scale; L's first 2·D entries) then the linear to p·p·C features: [B, N, p·p·C]."""
    shift, scale = modulation(weights, "final_layer.adaln_modulation", silu(e), lora, 2)
    return adaln(x, shift, scale) @ weights["final_layer.linear.weight"].T


def block_weights(state, block: int) -> dict[str, np.ndarray]:
    """One block's tensors with the `blocks.{i}.` prefix removed (only those are looked up: `state` may read
    or widen a tensor on every lookup)."""
    prefix = f"blocks.{block}."
    return {k[len(prefix):]: state[k] for k in state if k.startswith(prefix)}


def cross_attention_kv(weights: dict[str, np.ndarray], context: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """context [B,S,C] -> (k, v) [B,S,D] for one block: k_proj then per-head k_norm; v_proj. Once per prompt."""
    k = context @ weights["cross_attn.k_proj.weight"].T
    v = context @ weights["cross_attn.v_proj.weight"].T
    norm = weights["cross_attn.k_norm.weight"]
    b, s, d = k.shape
    heads = rms_norm(k.reshape(b, s, d // norm.shape[0], norm.shape[0]), norm)
    return heads.reshape(b, s, d).astype(np.float32), v.astype(np.float32)
