"""The initial latent noise: the numbers `torch.randn((1, 16, 1, h, w), generator=torch.Generator("cpu").manual_seed(seed))`
gives (ComfyUI and diffusers draw it that way), computed in NumPy so the board needs no torch and a seed means
the same image everywhere.

torch's CPU generator is MT19937 seeded with the seed's low 32 bits (standard init_genrand). A float tensor of
16 or more contiguous elements is filled by `normal_fill`: one uniform per element from the low 24 bits of a
32-bit draw (u = bits·2⁻²⁴), then Box-Muller on blocks of 16, where element j < 8 takes u1 = 1 − u[j] and
u2 = u[j + 8] and becomes r·cos θ, element j + 8 becomes r·sin θ, r = sqrt(−2 log u1), θ = 2π·u2. When the size
is not a multiple of 16, 16 more uniforms redo the last 16 elements.

This follows torch's portable scalar kernel (float32 log/sqrt/cos/sin, θ rounded from double). torch builds
for x86 CPUs with AVX2 (and not AVX-512) take a vectorised kernel whose log/sin/cos approximations differ in the
last bits: a few 1e-7 at most (tests/test_sampling.py measures it)."""

import numpy as np

from anima_ui.errors import UserError
from anima_ui.limits import MAX_SEED

LATENT_CHANNELS = 16
VAE_STRIDE = 8
_MT_N = 624


def initial_noise(seed: int, height: int, width: int) -> np.ndarray:
    """float32 [1, 16, height/8, width/8]: `torch.randn((1, 16, 1, height/8, width/8), generator=...)` with
    the single video frame squeezed out."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed <= MAX_SEED:
        raise UserError(f"seed must be a whole number from 0 to {MAX_SEED}, got {seed!r}")
    for name, side in (("height", height), ("width", width)):
        if isinstance(side, bool) or not isinstance(side, (int, np.integer)) or side <= 0 or side % VAE_STRIDE:
            raise UserError(f"{name} must be a positive multiple of {VAE_STRIDE} pixels, got {side!r}")
    return torch_randn((1, LATENT_CHANNELS, height // VAE_STRIDE, width // VAE_STRIDE), int(seed))


def torch_randn(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """float32 array of `shape` (at least 16 elements): torch.randn(shape, generator=Generator("cpu").manual_seed(seed))."""
    size = int(np.prod(shape))
    if size < 16:
        raise ValueError("torch draws fewer than 16 normals another way; this reproduces only normal_fill")
    bits = mt19937(seed).random_raw(size + (16 if size % 16 else 0))
    uniforms = (bits & 0xFFFFFF).astype(np.float32) * np.float32(2.0**-24)
    out = np.empty(size, np.float32)
    blocks = size // 16
    out[: blocks * 16] = _box_muller(uniforms[: blocks * 16])
    if size % 16:
        out[size - 16 :] = _box_muller(uniforms[size:])
    return out.reshape(shape)


def mt19937(seed: int) -> np.random.MT19937:
    """NumPy's MT19937 in the state torch's `manual_seed(seed)` leaves its generator: the standard
    init_genrand of the low 32 bits, no draw made yet."""
    key = np.empty(_MT_N, np.uint32)
    key[0] = previous = seed & 0xFFFFFFFF
    for i in range(1, _MT_N):
        previous = (1812433253 * (previous ^ (previous >> 30)) + i) & 0xFFFFFFFF
        key[i] = previous
    generator = np.random.MT19937()
    generator.state = {"bit_generator": "MT19937", "state": {"key": key, "pos": _MT_N}}
    return generator


def _box_muller(uniforms: np.ndarray) -> np.ndarray:
    """Blocks of 16 uniforms -> 16 normals each. The float32 libm calls are computed in float64 and rounded
    once, which is what a correctly rounded logf/sqrtf/cosf/sinf returns."""
    blocks = uniforms.reshape(-1, 2, 8)
    u1 = np.float32(1.0) - blocks[:, 0]  # [0, 1) -> (0, 1]; exact in float32
    radius = np.sqrt(np.float32(-2.0) * np.log(u1.astype(np.float64)).astype(np.float32), dtype=np.float64).astype(np.float32)
    theta = (2.0 * np.pi * blocks[:, 1].astype(np.float64)).astype(np.float32).astype(np.float64)
    out = np.empty_like(blocks)
    out[:, 0] = radius * np.cos(theta).astype(np.float32)
    out[:, 1] = radius * np.sin(theta).astype(np.float32)
    return out.reshape(-1)
