"""Host ops against the spec's index formulas, its Appendix C constants, and diffusers' Cosmos pieces."""

import numpy as np
import pytest
import torch
from diffusers.models.embeddings import Timesteps
from diffusers.models.transformers.transformer_cosmos import CosmosRotaryPosEmbed

from anima_ui.errors import UserError
from anima_ui.model import host
from anima_ui.model.config import AnimaConfig
from anima_ui.model.forward import prepare_rope


def test_patchify_is_channel_major_with_zero_mask_channel():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 16, 6, 10)).astype(np.float32)
    f = host.patchify(x, 2)
    assert f.shape == (2, 3 * 5, 68)
    for b, i, j, c, m, n in [(0, 0, 0, 0, 0, 0), (1, 2, 4, 15, 1, 0), (0, 1, 3, 7, 0, 1), (1, 2, 1, 3, 1, 1)]:
        assert f[b, i * 5 + j, c * 4 + m * 2 + n] == x[b, c, 2 * i + m, 2 * j + n]
    assert not f[:, :, 64:].any()  # channel 16, the padding mask


def test_unpatchify_reads_p1_p2_c_order():
    rng = np.random.default_rng(1)
    y = rng.standard_normal((2, 3 * 5, 64)).astype(np.float32)
    v = host.unpatchify(y, 6, 10, 2, 16)
    assert v.shape == (2, 16, 6, 10)
    for b, i, j, c, p1, p2 in [(0, 0, 0, 0, 0, 0), (1, 2, 4, 15, 1, 0), (0, 1, 3, 7, 0, 1), (1, 0, 2, 9, 1, 1)]:
        assert v[b, c, 2 * i + p1, 2 * j + p2] == y[b, i * 5 + j, p1 * 32 + p2 * 16 + c]


def test_odd_latent_size_is_a_user_error():
    with pytest.raises(UserError, match="multiples of 16"):
        host.patchify(np.zeros((1, 16, 7, 8), np.float32), 2)
    with pytest.raises(UserError, match="multiples of 16"):
        prepare_rope(AnimaConfig.tiny(), 8, 9)


def test_timestep_embedding_matches_diffusers_cos_first():
    sigma = np.array([1.0, 0.5, 0.0123], np.float32)
    ours = host.timestep_embedding(sigma, 2048)
    theirs = Timesteps(2048, flip_sin_to_cos=True, downscale_freq_shift=0.0)(torch.from_numpy(sigma)).numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-6)
    np.testing.assert_allclose(ours[:, 0], np.cos(sigma), rtol=1e-6)  # first entry: cos(t·ω_0), ω_0 = 1
    assert ours.dtype == np.float32


def test_rope_constants_of_appendix_c():
    cfg = AnimaConfig.full()
    assert cfg.rope_dims == (44, 42, 42)
    cos, sin = prepare_rope(cfg, 6, 8)  # 3 x 4 tokens
    angles = np.arctan2(sin, cos).astype(np.float64)
    assert cos.shape == (12, 128)
    assert np.array_equal(angles[:, :64], angles[:, 64:])  # split-half: pairs (d, d + 64)
    assert not angles[:, :22].any()  # t = 0 for an image
    token = 1 * 4 + 1  # (i, j) = (1, 1)
    omega_h = angles[token, 22:43]
    omega_w = angles[token, 43:64]
    theta_h = 10000 * 4.0 ** (42 / 40)
    assert theta_h == pytest.approx(42870.938501451725, rel=1e-12)
    np.testing.assert_allclose(omega_h, theta_h ** (-np.arange(21) * 2 / 42), rtol=1e-6)
    np.testing.assert_allclose(omega_w, omega_h, rtol=0)
    assert omega_h[20] == pytest.approx(3.8762893e-05, rel=1e-6)
    token = 2 * 4 + 3  # (i, j) = (2, 3): h angles = 2ω, w angles = 3ω
    np.testing.assert_allclose(angles[token, 22:43], 2 * omega_h, rtol=1e-6)
    np.testing.assert_allclose(angles[token, 43:64], 3 * omega_h, rtol=1e-6)


@pytest.mark.parametrize("h,w", [(64, 64), (48, 80)])
def test_rope_tables_match_diffusers(h, w):
    cfg = AnimaConfig.full()
    cos, sin = prepare_rope(cfg, h, w)
    rope = CosmosRotaryPosEmbed(hidden_size=128, patch_size=(1, 2, 2), rope_scale=(1.0, 4.0, 4.0))
    their_cos, their_sin = rope(torch.zeros(1, 17, 1, h, w))
    np.testing.assert_allclose(cos, their_cos.numpy(), atol=2e-5)  # diffusers builds the angles in float32
    np.testing.assert_allclose(sin, their_sin.numpy(), atol=2e-5)


def test_layer_norm_and_adaln_match_torch():
    rng = np.random.default_rng(2)
    x = (5.0 + 3.0 * rng.standard_normal((2, 7, 64))).astype(np.float32)
    shift, scale = rng.standard_normal((2, 2, 64)).astype(np.float32)
    ln = torch.nn.functional.layer_norm(torch.from_numpy(x), (64,), eps=1e-6).numpy()
    np.testing.assert_allclose(host.layer_norm(x), ln, atol=1e-5)
    expected = ln * (1 + scale[:, None]) + shift[:, None]
    np.testing.assert_allclose(host.adaln(x, shift, scale), expected, atol=1e-5)


def test_add_gated_updates_in_place_in_float32():
    x = np.ones((2, 3, 4), np.float32)
    gate = np.array([[1, 2, 3, 4], [0, 0, 0, 0]], np.float32)
    host.add_gated(x, gate, np.full((2, 3, 4), 0.5, np.float16))
    assert x.dtype == np.float32
    np.testing.assert_array_equal(x[0, 2], [1.5, 2.0, 2.5, 3.0])
    np.testing.assert_array_equal(x[1], np.ones((3, 4)))


def test_t_embedding_uses_normalized_sinusoid_and_lora_of_raw_sinusoid(tiny_state):
    sigma = np.array([0.7], np.float32)
    e, lora = host.t_embedding(tiny_state, sigma)
    s = host.timestep_embedding(sigma, 64).astype(np.float64)
    g = tiny_state["t_embedding_norm.weight"]
    np.testing.assert_allclose(e, s / np.sqrt(np.mean(s**2) + 1e-6) * g, rtol=1e-5)
    pre = s @ tiny_state["t_embedder.1.linear_1.weight"].T
    np.testing.assert_allclose(lora, (pre / (1 + np.exp(-pre))) @ tiny_state["t_embedder.1.linear_2.weight"].T, rtol=1e-4, atol=1e-6)
    assert lora.shape == (1, 3 * 64)
