"""A synthetic outlier model: a random-weight model folder whose FFNs see DiT-like outlier channels.

Random weights give FFN inputs of unit scale in every channel, which per-tensor int8 handles well; real DiT
FFN inputs have a few channels 20-50x larger (the reason the blog's W8A8 FFNs degraded the images). Per
block, this scales
- 4 channels of the FFN input by 20, 30, 40, 50: the rows of the FFN's AdaLN modulation that make that
  channel's shift and scale (x_c = LN(r)_c·(1 + k·scale_c) + k·shift_c), so the outliers come from the
  timestep like real ones and move with it;
- 2 other input columns of the first FFN weight by 20 and 30 (weight outliers, which per-output-channel
  weight quantization cannot isolate).
The model is its own float reference: the question is only how far a quantized FFN strays from it."""

from dataclasses import replace
from pathlib import Path

import numpy as np

from anima_ui import modelfiles
from anima_ui.commands.random_model import write_bf16_safetensors, write_random_model
from anima_ui.model.checkpoint import dit_param_shapes, load_dit, random_dit_state
from anima_ui.model.config import AnimaConfig

ACTIVATION_SCALES = (20.0, 30.0, 40.0, 50.0)
WEIGHT_SCALES = (20.0, 30.0)


def add_ffn_outliers(state: dict[str, np.ndarray], num_blocks: int, seed: int = 0) -> dict[str, dict]:
    """Scale the chosen channels in place; returns per block the channels chosen ({"activation": [...], "weight": [...]})."""
    rng = np.random.default_rng(seed)
    chosen = {}
    for i in range(num_blocks):
        modulation = state[f"blocks.{i}.adaln_modulation_mlp.2.weight"]  # [3·D, r]: shift, scale, gate rows
        width = modulation.shape[0] // 3
        channels = rng.choice(width, len(ACTIVATION_SCALES) + len(WEIGHT_SCALES), replace=False)
        activation, weight = channels[:len(ACTIVATION_SCALES)], channels[len(ACTIVATION_SCALES):]
        for c, k in zip(activation, ACTIVATION_SCALES):
            modulation[c] *= k  # shift
            modulation[width + c] *= k  # scale
        layer1 = state[f"blocks.{i}.mlp.layer1.weight"]  # [F, D]
        for c, k in zip(weight, WEIGHT_SCALES):
            layer1[:, c] *= k
        chosen[i] = {"activation": activation.tolist(), "weight": weight.tolist()}
    return chosen


def write_outlier_model(out, seed: int = 0, width: int | None = None, mlp_dim: int | None = None) -> tuple[Path, dict]:
    """The tiny random model folder (official layout) with FFN outliers; width / mlp_dim override the tiny
    DiT's (heads of the tiny head size), keeping its text encoder and adapter. Returns (folder, chosen channels)."""
    out = write_random_model(Path(out), "tiny", seed)
    tiny = AnimaConfig.tiny()
    cfg = replace(tiny, width=width or tiny.width, num_heads=(width or tiny.width) // tiny.head_dim,
                  mlp_dim=mlp_dim or tiny.mlp_dim)
    dit = next((out / modelfiles.DIT_DIR).glob("*.safetensors"))
    if cfg == tiny:
        _, state = load_dit(dit)
    else:
        state = random_dit_state(cfg, seed)
        _, written = load_dit(dit, keep=lambda key: key.startswith("llm_adapter."))
        state.update(written)  # the adapter the text encoder was written for
    chosen = add_ffn_outliers(state, cfg.num_blocks, seed)
    shapes = {"net." + key: shape for key, shape in dit_param_shapes(cfg).items()}
    write_bf16_safetensors(dit, shapes, lambda name: state.pop(name[len("net."):]))
    return out, chosen
