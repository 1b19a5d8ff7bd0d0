"""The limits of a generation request, each written down once. Every entry point (the form, the job manager,
`anima-ui generate`, the pipeline) checks a request through `GenerationRequest`, and the samplers check their own
arguments against the same numbers."""

import math
from numbers import Integral, Real

from anima_ui.errors import UserError

MAX_STEPS = 200
MAX_SEED = 2**64 - 1  # torch.Generator("cpu").manual_seed accepts 0 .. 2^64 - 1, as ComfyUI's seed widget does
SIZE_MULTIPLE = 16  # the VAE's stride 8 times the DiT's patch 2: one latent patch per 16x16 pixels
MIN_SIDE, MAX_SIDE = 64, 2048
MIN_CFG, MAX_CFG = 0.0, 30.0


def _whole(value) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def check_steps(steps):
    if not _whole(steps) or not 1 <= steps <= MAX_STEPS:
        raise UserError(f"steps must be a whole number from 1 to {MAX_STEPS}, got {steps!r}")
    return steps


def check_seed(seed):
    if not _whole(seed) or not 0 <= seed <= MAX_SEED:
        raise UserError(f"seed must be from 0 to {MAX_SEED} (a whole number), got {seed!r}")
    return seed


def check_cfg(cfg):
    if isinstance(cfg, bool) or not isinstance(cfg, Real) or not math.isfinite(cfg) or not MIN_CFG <= cfg <= MAX_CFG:
        raise UserError(f"CFG must be between {MIN_CFG:g} and {MAX_CFG:g}, got {cfg!r}")
    return cfg


def check_side(name: str, side):
    """`name` is "width" or "height", for the message."""
    if not _whole(side) or side % SIZE_MULTIPLE or not MIN_SIDE <= side <= MAX_SIDE:
        raise UserError(f"{name} must be a multiple of {SIZE_MULTIPLE} from {MIN_SIDE} to {MAX_SIDE} pixels, got {side!r}")
    return side
