"""The LLM adapter inside the DiT checkpoint: T5-token queries cross-attend to Qwen3 hidden states and
become the DiT's cross-attention context. ComfyUI semantics: no attention masks, zero-padded to 512."""

import numpy as np
import torch
import torch.nn.functional as F

from anima_ui.errors import UserError
from anima_ui.model.host import EPS

ROPE_THETA = 10000.0


def llm_adapter_forward(adapter_weights: dict[str, np.ndarray], source: np.ndarray, t5_ids: np.ndarray) -> np.ndarray:
    """adapter_weights: `split_adapter(state)`; source [B,Ls,Cs] Qwen3 final hidden states; t5_ids [B,Lt] int
    -> [B,Lt,C] float32 (not padded; see pad_context). Float32 throughout."""
    w = {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)) for k, v in adapter_weights.items()}
    source = torch.from_numpy(np.ascontiguousarray(source, dtype=np.float32))
    ids = torch.from_numpy(np.asarray(t5_ids, dtype=np.int64))
    vocab = w["embed.weight"].shape[0]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise UserError(f"T5 token id out of range 0..{vocab - 1}: the T5 tokenizer does not match this model")
    head_dim = w["blocks.0.self_attn.q_norm.weight"].shape[0]
    target_rope = _rope(ids.shape[1], head_dim)
    source_rope = _rope(source.shape[1], head_dim)
    with torch.inference_mode():
        x = w["embed.weight"][ids]
        for j in range(_num_layers(w)):
            p = f"blocks.{j}."
            h = _rms_norm(x, w[p + "norm_self_attn.weight"])
            x = x + _attention(w, p + "self_attn.", h, h, target_rope, target_rope)
            h = _rms_norm(x, w[p + "norm_cross_attn.weight"])
            x = x + _attention(w, p + "cross_attn.", h, source, target_rope, source_rope)
            h = _rms_norm(x, w[p + "norm_mlp.weight"])
            h = F.gelu(F.linear(h, w[p + "mlp.0.weight"], w[p + "mlp.0.bias"]))
            x = x + F.linear(h, w[p + "mlp.2.weight"], w[p + "mlp.2.bias"])
        out = _rms_norm(F.linear(x, w["out_proj.weight"], w["out_proj.bias"]), w["norm.weight"])
    return out.numpy()


def pad_context(x: np.ndarray, length: int = 512) -> np.ndarray:
    """Zero rows appended along the sequence up to `length` (the DiT attends to them; their keys are 0).
    ComfyUI does not truncate longer contexts, and the exported graphs have a fixed length, so that is an error."""
    if x.shape[1] > length:
        raise UserError(f"the prompt is {x.shape[1]} T5 tokens long, the limit is {length}: shorten the prompt")
    return np.pad(x, ((0, 0), (0, length - x.shape[1]), (0, 0)))


def _num_layers(w: dict) -> int:
    return sum(1 for key in w if key.startswith("blocks.") and key.endswith(".norm_mlp.weight"))


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + EPS) * weight


def _rope(length: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """1-D split-half RoPE over positions 0..length-1: cos, sin [length, head_dim]."""
    inv_freq = ROPE_THETA ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = np.arange(length, dtype=np.float64)[:, None] * inv_freq
    angles = np.concatenate([angles, angles], axis=1)
    return torch.from_numpy(np.cos(angles).astype(np.float32)), torch.from_numpy(np.sin(angles).astype(np.float32))


def _apply_rope(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x [B,H,L,hd]."""
    cos, sin = rope
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def _attention(w: dict, prefix: str, x: torch.Tensor, context: torch.Tensor, rope_q, rope_k) -> torch.Tensor:
    """q from x, k/v from context; per-head RMSNorm on q and k, RoPE on both (q at target positions, k at
    context positions — also in the cross-attention), no mask, then o_proj."""
    head_dim = w[prefix + "q_norm.weight"].shape[0]
    b, lq, _ = x.shape
    lk = context.shape[1]
    q = F.linear(x, w[prefix + "q_proj.weight"]).reshape(b, lq, -1, head_dim)
    k = F.linear(context, w[prefix + "k_proj.weight"]).reshape(b, lk, -1, head_dim)
    v = F.linear(context, w[prefix + "v_proj.weight"]).reshape(b, lk, -1, head_dim)
    q = _apply_rope(_rms_norm(q, w[prefix + "q_norm.weight"]).transpose(1, 2), rope_q)
    k = _apply_rope(_rms_norm(k, w[prefix + "k_norm.weight"]).transpose(1, 2), rope_k)
    out = F.scaled_dot_product_attention(q, k, v.transpose(1, 2))
    return F.linear(out.transpose(1, 2).reshape(b, lq, -1), w[prefix + "o_proj.weight"])
