"""The DiT + LLM-adapter checkpoint: its key layout and a torch-free loader."""

from pathlib import Path

import numpy as np

from anima_ui.errors import UserError
from anima_ui.model.config import BRANCH_KINDS, AnimaConfig
from anima_ui.model.tensor_file import TensorFile

# Release files root their keys at one of these (ComfyUI and diffusion-pipe strip the same ones).
KEY_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "net.")
ADAPTER_PREFIX = "llm_adapter."


def dit_param_shapes(cfg: AnimaConfig) -> dict[str, tuple]:
    """Every tensor of the official file (without its prefix), in file order: 567 DiT + 118 adapter at full size."""
    d, r = cfg.width, cfg.adaln_lora_dim
    shapes = {
        "x_embedder.proj.1.weight": (d, cfg.patch_features),
        "t_embedder.1.linear_1.weight": (d, d),
        "t_embedder.1.linear_2.weight": (3 * d, d),
        "t_embedding_norm.weight": (d,),
    }
    for i in range(cfg.num_blocks):
        b = f"blocks.{i}."
        for attn, kv_in in (("self_attn", d), ("cross_attn", cfg.context_dim)):
            shapes[f"{b}{attn}.q_proj.weight"] = (d, d)
            shapes[f"{b}{attn}.k_proj.weight"] = (d, kv_in)
            shapes[f"{b}{attn}.v_proj.weight"] = (d, kv_in)
            shapes[f"{b}{attn}.output_proj.weight"] = (d, d)
            shapes[f"{b}{attn}.q_norm.weight"] = (cfg.head_dim,)
            shapes[f"{b}{attn}.k_norm.weight"] = (cfg.head_dim,)
        shapes[f"{b}mlp.layer1.weight"] = (cfg.mlp_dim, d)
        shapes[f"{b}mlp.layer2.weight"] = (d, cfg.mlp_dim)
        for kind in BRANCH_KINDS:
            shapes[f"{b}adaln_modulation_{kind}.1.weight"] = (r, d)
            shapes[f"{b}adaln_modulation_{kind}.2.weight"] = (3 * d, r)
    shapes["final_layer.linear.weight"] = (cfg.out_features, d)
    shapes["final_layer.adaln_modulation.1.weight"] = (r, d)
    shapes["final_layer.adaln_modulation.2.weight"] = (2 * d, r)
    shapes.update({ADAPTER_PREFIX + k: v for k, v in _adapter_shapes(cfg).items()})
    return shapes


def _adapter_shapes(cfg: AnimaConfig) -> dict[str, tuple]:
    a, hd, src = cfg.adapter_dim, cfg.adapter_head_dim, cfg.adapter_source_dim
    shapes = {"embed.weight": (cfg.adapter_vocab, a)}
    for j in range(cfg.adapter_layers):
        b = f"blocks.{j}."
        for attn, kv_in in (("self_attn", a), ("cross_attn", src)):
            shapes[f"{b}norm_{attn}.weight"] = (a,)
            shapes[f"{b}{attn}.q_proj.weight"] = (a, a)
            shapes[f"{b}{attn}.k_proj.weight"] = (a, kv_in)
            shapes[f"{b}{attn}.v_proj.weight"] = (a, kv_in)
            shapes[f"{b}{attn}.o_proj.weight"] = (a, a)
            shapes[f"{b}{attn}.q_norm.weight"] = (hd,)
            shapes[f"{b}{attn}.k_norm.weight"] = (hd,)
        shapes[f"{b}norm_mlp.weight"] = (a,)
        shapes[f"{b}mlp.0.weight"] = (cfg.adapter_mlp_dim, a)
        shapes[f"{b}mlp.0.bias"] = (cfg.adapter_mlp_dim,)
        shapes[f"{b}mlp.2.weight"] = (a, cfg.adapter_mlp_dim)
        shapes[f"{b}mlp.2.bias"] = (a,)
    shapes["out_proj.weight"] = (cfg.context_dim, a)
    shapes["out_proj.bias"] = (cfg.context_dim,)
    shapes["norm.weight"] = (cfg.context_dim,)
    return shapes


def split_adapter(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The LLM-adapter tensors with `llm_adapter.` removed (diffusers' AnimaTextConditioner uses these names)."""
    return {k[len(ADAPTER_PREFIX):]: v for k, v in state.items() if k.startswith(ADAPTER_PREFIX)}


def strip_prefix(key: str) -> str:
    for prefix in KEY_PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


def open_dit(path) -> tuple[AnimaConfig, TensorFile]:
    """The DiT file with its keys' prefix stripped, every expected tensor's presence and shape checked
    (unknown keys are ignored); nothing is read yet."""
    path = Path(path)
    file = TensorFile(path, rename=strip_prefix)
    shapes = file.shapes
    cfg = AnimaConfig.from_shapes(shapes)
    for key, shape in dit_param_shapes(cfg).items():
        if key not in shapes:
            raise UserError(f"{path.name}: tensor {key!r} is missing; the file is incomplete or not an Anima model (re-download it)")
        if shapes[key] != shape:
            raise UserError(f"{path.name}: tensor {key!r} has shape {shapes[key]}, expected {shape} (re-download the file)")
    return cfg, file


def load_dit(path, dtype=np.float32, keep=None) -> tuple[AnimaConfig, dict[str, np.ndarray]]:
    """Read an Anima DiT safetensors file without torch. Unknown keys are ignored; a missing or misshapen
    tensor, or a damaged file, raises UserError. `keep(key) -> bool` reads only some tensors (every key is
    still checked): the graph backends need only the host's."""
    cfg, file = open_dit(path)
    return cfg, {key: file.read(key, dtype) for key in dit_param_shapes(cfg) if keep is None or keep(key)}
