"""The three per-block branch bodies that run on the accelerator, as fixed-shape torch modules.

The same modules are the float32 reference and what `anima-ui export` writes to ONNX (opset 19), so they
use plain ops only: MatMul, Mul/Add, ReduceMean, Sqrt, Softmax, Erf, Slice/Concat, Reshape/Transpose.
Weights are shared with a float32 NumPy state dict (torch.from_numpy), not copied."""

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from anima_ui.model.host import EPS


def _frozen(array: np.ndarray) -> nn.Parameter:
    return nn.Parameter(torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)), requires_grad=False)


def head_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """RMSNorm over the last (head) axis in torch (host.rms_norm is the NumPy one), written out so it exports as
    plain ops."""
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + EPS) * weight


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int) -> torch.Tensor:
    """q [B, N, H, hd], k/v [B, S, H, hd] -> [B, N, H·hd]; full bidirectional softmax attention, no mask.
    head_dim is a Python int so the scale is a constant in the exported graph, not Shape/Sqrt ops."""
    b, n, heads, _ = q.shape
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=head_dim**-0.5)
    return out.transpose(1, 2).reshape(b, n, heads * head_dim)


class SelfAttentionBranch(nn.Module):
    """h [B,N,D], rope_cos/rope_sin [N,hd] -> [B,N,D]: q/k/v, per-head RMSNorm on q and k, 3-D RoPE, attention, output proj."""

    def __init__(self, weights: dict[str, np.ndarray]):
        super().__init__()
        self.q_proj = _frozen(weights["self_attn.q_proj.weight"])
        self.k_proj = _frozen(weights["self_attn.k_proj.weight"])
        self.v_proj = _frozen(weights["self_attn.v_proj.weight"])
        self.output_proj = _frozen(weights["self_attn.output_proj.weight"])
        self.q_norm = _frozen(weights["self_attn.q_norm.weight"])
        self.k_norm = _frozen(weights["self_attn.k_norm.weight"])
        self.head_dim = self.q_norm.shape[0]

    def forward(self, h: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor) -> torch.Tensor:
        b, n, d = h.shape
        heads = (b, n, d // self.head_dim, self.head_dim)
        q = head_rms_norm(F.linear(h, self.q_proj).reshape(heads), self.q_norm)
        k = head_rms_norm(F.linear(h, self.k_proj).reshape(heads), self.k_norm)
        v = F.linear(h, self.v_proj).reshape(heads)
        cos, sin = rope_cos[None, :, None, :], rope_sin[None, :, None, :]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return F.linear(_attention(q, k, v, self.head_dim), self.output_proj)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class CrossAttentionBranch(nn.Module):
    """h [B,N,D], k/v [B,S,D] (k already k_norm'ed per head, see cross_attention_kv) -> [B,N,D]. No RoPE, no mask."""

    def __init__(self, weights: dict[str, np.ndarray]):
        super().__init__()
        self.q_proj = _frozen(weights["cross_attn.q_proj.weight"])
        self.output_proj = _frozen(weights["cross_attn.output_proj.weight"])
        self.q_norm = _frozen(weights["cross_attn.q_norm.weight"])
        self.head_dim = self.q_norm.shape[0]

    def forward(self, h: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, n, d = h.shape
        heads = d // self.head_dim
        q = head_rms_norm(F.linear(h, self.q_proj).reshape(b, n, heads, self.head_dim), self.q_norm)
        s = k.shape[1]
        k = k.reshape(b, s, heads, self.head_dim)
        v = v.reshape(b, s, heads, self.head_dim)
        return F.linear(_attention(q, k, v, self.head_dim), self.output_proj)


class FeedForwardBranch(nn.Module):
    """h [B,N,D] -> layer2(GELU(layer1(h))), exact (erf) GELU, no biases."""

    def __init__(self, weights: dict[str, np.ndarray]):
        super().__init__()
        self.layer1 = _frozen(weights["mlp.layer1.weight"])
        self.layer2 = _frozen(weights["mlp.layer2.weight"])

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(F.gelu(F.linear(h, self.layer1)), self.layer2)


BRANCH_CLASSES = {"self_attn": SelfAttentionBranch, "cross_attn": CrossAttentionBranch, "mlp": FeedForwardBranch}

