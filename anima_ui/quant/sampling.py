"""One CFG sampling run over a `run_branch`, with hooks, for the calibration capture and the end-to-end gate.
(The app's own loop is Pipeline._denoise; this one has no runtime, events or Spectrum.)"""

import numpy as np

from anima_ui.model.forward import dit_forward
from anima_ui.sampling.cfg import cfg_combine
from anima_ui.sampling.euler import euler_steps


def cfg_sample(weights: dict, run_branch, kv, rope, noise: np.ndarray, sigmas: np.ndarray, cfg: float,
               before_forward=None, on_block=None, last_step: int | None = None, ffn_input_scales=None) -> np.ndarray:
    """Euler with CFG (cond = kv batch item 0, uncond = item 1) from `noise` [1, C, h, w]; returns the latent after
    the last step, or after step `last_step` (0-based) to stop early. before_forward(step, sigma) runs before
    each model evaluation; on_block and ffn_input_scales are dit_forward's."""
    step = {"index": 0}

    def predict_x0(x, sigma):
        if before_forward is not None:
            before_forward(step["index"], sigma)
        xs = np.repeat(x, 2, axis=0)
        velocity = dit_forward(weights, run_branch, xs, np.full(2, sigma, np.float32), kv, rope, on_block=on_block,
                               ffn_input_scales=ffn_input_scales)
        x0 = xs - sigma * velocity
        return cfg_combine(x0[:1], x0[1:], cfg)

    x = noise
    for info in euler_steps(predict_x0, noise, sigmas):
        x = info.x
        step["index"] = info.index0 + 1
        if last_step is not None and info.index0 >= last_step:
            break
    return x
