"""One DiT forward pass, split the way the board runs it: NumPy host ops around 3 branch calls per block.

`dit_forward` does not know where branches run: `run_branch(block, kind, inputs)` may be the torch
reference (`TorchBranches`), onnxruntime, or the NPU. Visit order is fixed — block 0 self_attn,
cross_attn, mlp, block 1 self_attn, … — and every visit carries the whole batch (CFG = batch 2)."""

from collections.abc import Callable

import numpy as np

from anima_ui.errors import UserError
from anima_ui.model import host
from anima_ui.model.config import BRANCH_KINDS, AnimaConfig

RunBranch = Callable[[int, str, dict], np.ndarray]
CROSS_ATTENTION_KV_TENSORS = ("cross_attn.k_proj.weight", "cross_attn.v_proj.weight", "cross_attn.k_norm.weight")


def dit_forward(
    weights: dict[str, np.ndarray],
    run_branch: RunBranch,
    x: np.ndarray,
    sigma: np.ndarray,
    kv: list[tuple[np.ndarray, np.ndarray]],
    rope: tuple[np.ndarray, np.ndarray],
    on_block: Callable[[int, np.ndarray], None] | None = None,
    ffn_input_scales: dict[int, np.ndarray] | None = None,
) -> np.ndarray:
    """x [B,C,h,w] model-space latent, sigma [B] -> velocity [B,C,h,w] (float32).

    kv: per block (k, v) [B,S,D] from `prepare_kv`; rope: (cos, sin) [N,hd] from `prepare_rope`.
    on_block(i, X) sees the residual stream [B,N,D] after block i (a live array: copy it to keep it).
    ffn_input_scales: block -> λ [D] for the blocks whose FFN graph takes its input divided by λ (a smoothed
    W8A8 FFN); the division is folded into that block's FFN modulation, so it costs nothing per token."""
    b, channels, h, w = x.shape
    patch = _patch_size(weights, channels)
    residual = host.patchify(np.asarray(x, np.float32), patch) @ weights["x_embedder.proj.1.weight"].T
    e, lora = host.t_embedding(weights, np.asarray(sigma, np.float32))
    modulations = host.block_modulations(weights, len(kv), e, lora)
    rope_cos, rope_sin = rope
    for i, (k, v) in enumerate(kv):
        branch_inputs = {
            "self_attn": {"rope_cos": rope_cos, "rope_sin": rope_sin},
            "cross_attn": {"k": k, "v": v},
            "mlp": {},
        }
        for kind in BRANCH_KINDS:
            shift, scale, gate = modulations[i][kind]
            if kind == "mlp" and ffn_input_scales and i in ffn_input_scales:
                shift, scale = host.fold_input_scale(shift, scale, ffn_input_scales[i])
            out = run_branch(i, kind, {"h": host.adaln(residual, shift, scale), **branch_inputs[kind]})
            host.add_gated(residual, gate, out)
        if on_block is not None:
            on_block(i, residual)
    y = host.final_layer(weights, residual, e, lora)
    return host.unpatchify(y, h, w, patch, channels)


def _patch_size(weights: dict, channels: int) -> int:
    """p from the patch embed: its input is (channels + 1 mask channel)·p·p."""
    patch_area = weights["x_embedder.proj.1.weight"].shape[1] // (channels + 1)
    return round(patch_area**0.5)


def prepare_rope(cfg: AnimaConfig, h: int, w: int) -> tuple[np.ndarray, np.ndarray]:
    """RoPE cos/sin [N, head_dim] for a latent of h×w (image size / 8)."""
    if h % cfg.patch or w % cfg.patch:
        raise UserError(f"latent size {h}x{w} must be a multiple of {cfg.patch}: use image sizes that are multiples of 16")
    return host.rope_tables(cfg, h, w)


def num_blocks(weights: dict) -> int:
    return sum(1 for key in weights if key.startswith("blocks.") and key.endswith(".cross_attn.k_proj.weight"))


def prepare_kv(weights: dict[str, np.ndarray], contexts: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """Cross-attention k, v of every block for contexts [B,S,C] (cond and uncond stacked for CFG).
    The zero padding rows after the prompt give k = v = 0 exactly (k_norm of a zero row is zero), so only
    the rows up to the last non-zero one are projected: a short prompt costs a fraction of the 512 (CONTEXT_LEN) rows."""
    contexts = np.asarray(contexts, np.float32)
    used = _used_rows(contexts)
    kv = []
    for i in range(num_blocks(weights)):
        block = {name: weights[f"blocks.{i}.{name}"] for name in CROSS_ATTENTION_KV_TENSORS}
        k, v = host.cross_attention_kv(block, contexts[:, :used])
        # np.zeros leaves the padding rows' pages untouched (calloc), so they cost no memory until read
        padded = np.zeros((2, *contexts.shape[:2], k.shape[2]), np.float32)
        padded[0, :, :used], padded[1, :, :used] = k, v
        kv.append((padded[0], padded[1]))
    return kv


def _used_rows(contexts: np.ndarray) -> int:
    nonzero_rows = np.flatnonzero(np.any(contexts != 0, axis=(0, 2)))
    return int(nonzero_rows[-1]) + 1 if nonzero_rows.size else 0
