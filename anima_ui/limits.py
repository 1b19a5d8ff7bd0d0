"""The limits of what a user may send, each written down once: a generation request's (every entry point checks a
request through `GenerationRequest`, and the samplers check their own arguments against the same numbers), its
prompt's, and those of the other things the app reads from strangers (the parameters text of a dropped PNG, a preset
name). Every check raises a one-line UserError that says the limit. The queue's limits (how many jobs, per device,
how large) depend on the backend and are the job manager's (anima_ui/jobs.py)."""

import math
from numbers import Integral, Real

from anima_ui.errors import UserError
from anima_ui.model.config import CONTEXT_LEN

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


# A prompt is checked in characters when the request is made, so nothing long reaches the tokenizer, then in tokens,
# after the tokenizer and before the text encoder runs (anima_ui.text.encoder).
MAX_PROMPT_CHARS = 5000  # well above what 512 tokens spell (about 2000 characters of English)
MAX_T5_TOKENS = CONTEXT_LEN  # the DiT attends to this many context rows: a longer prompt has no place to go
MAX_QWEN_TOKENS = 4 * CONTEXT_LEN  # the Qwen3 pass grows with its square; a prompt within the T5 limit stays far below
MAX_PROMPT_NESTING = 10  # `((x))` is depth 2, weight 1.1^2; depth 10 is weight 2.6
MAX_PROMPT_WEIGHT = 10.0  # `(x:w)` takes -10 <= w <= 10; larger weights only push the context out of its range
MAX_INFOTEXT_CHARS = 16384  # a PNG's parameters text: a picture made here has at most two prompts and one line
MAX_PRESET_NAME = 64  # characters
MAX_USER_PRESETS = 200  # presets users may save (the committed ones are read-only)


def check_prompt_length(name: str, text: str) -> str:
    """`name` is "prompt" or "negative prompt", for the message."""
    if len(text) > MAX_PROMPT_CHARS:
        raise UserError(f"the {name} is {len(text)} characters long; the limit is {MAX_PROMPT_CHARS}: shorten it")
    return text


def check_prompt_tokens(prompt: str, qwen_tokens: int, t5_tokens: int) -> None:
    """`prompt` is quoted (its start) in the message, so it names which of the two prompts is too long."""
    if t5_tokens > MAX_T5_TOKENS:
        raise UserError(f"the prompt {_excerpt(prompt)} is {t5_tokens} T5 tokens long; the limit is {MAX_T5_TOKENS}: "
                        "shorten it")
    if qwen_tokens > MAX_QWEN_TOKENS:
        raise UserError(f"the prompt {_excerpt(prompt)} is {qwen_tokens} Qwen tokens long; the limit is "
                        f"{MAX_QWEN_TOKENS}: shorten it")


def check_prompt_weight(group: str, weight: float) -> float:
    """`group` is the `(text:weight)` group as written, for the message."""
    if not math.isfinite(weight) or abs(weight) > MAX_PROMPT_WEIGHT:
        raise UserError(f"the weight in {_excerpt(group)} is out of range; use a number from {-MAX_PROMPT_WEIGHT:g} to "
                        f"{MAX_PROMPT_WEIGHT:g}")
    return weight


def check_prompt_nesting(depth: int) -> None:
    if depth > MAX_PROMPT_NESTING:
        raise UserError(f"the prompt nests parentheses {depth} deep; the limit is {MAX_PROMPT_NESTING} "
                        "(write (text:1.5) for a stronger weight)")


def check_infotext_length(text: str) -> str:
    if len(text) > MAX_INFOTEXT_CHARS:
        raise UserError(f"the image's parameters text is {len(text)} characters long; the limit is "
                        f"{MAX_INFOTEXT_CHARS} (a picture made here has far fewer), so it is not read")
    return text


def check_preset_name(name: str) -> str:
    if len(name) > MAX_PRESET_NAME:
        raise UserError(f"a preset name has at most {MAX_PRESET_NAME} characters; this one has {len(name)}")
    return name


def _excerpt(text: str, keep: int = 40) -> str:
    """A user's text quoted in a message, cut to `keep` characters: a message stays one short line."""
    return repr(text if len(text) <= keep else text[: keep - 1] + "…")
