"""The own torch Wan-2.1 decoder against diffusers' AutoencoderKLQwenImage on the same random weights."""

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from anima_ui.errors import UserError
from anima_ui.metrics import psnr
from anima_ui.vae.tiling import decode_tiled, tile_axis
from anima_ui.vae.wan_decoder import load_vae_decoder
from anima_ui.vae.weights import vae_param_shapes
from vae_helpers import SMALL_VAE_DIM, diffusers_decode, random_latent, small_vae_file, write_vae_file

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BASE_DIM = SMALL_VAE_DIM


@pytest.fixture(scope="module")
def small_vae(tmp_path_factory):
    return small_vae_file(tmp_path_factory)


def test_key_layout_matches_the_release_file():
    shapes = vae_param_shapes(96)
    assert len(shapes) == 194
    assert sum(k.startswith("decoder.") for k in shapes) == 106
    assert sum(k.startswith("encoder.") for k in shapes) == 84
    assert sum(int(np.prod(s)) for s in shapes.values()) == 126_892_531  # spec §9
    assert shapes["decoder.conv1.weight"] == (384, 16, 3, 3, 3)
    assert shapes["decoder.upsamples.4.shortcut.weight"] == (384, 192, 1, 1, 1)
    assert shapes["decoder.upsamples.7.time_conv.weight"] == (768, 384, 3, 1, 1)
    assert shapes["decoder.upsamples.11.resample.1.weight"] == (96, 192, 3, 3)
    assert "decoder.upsamples.11.time_conv.weight" not in shapes
    assert shapes["encoder.downsamples.5.time_conv.weight"] == (192, 192, 3, 1, 1)
    assert shapes["encoder.head.2.weight"] == (32, 384, 3, 3, 3)
    assert shapes["conv1.weight"] == (32, 32, 1, 1, 1) and shapes["conv2.weight"] == (16, 16, 1, 1, 1)


@pytest.fixture(scope="module")
def latent_and_reference(small_vae):
    """diffusers' conv3d path is slow on CPU: one 16x16 latent (128x128 px) decoded once per module."""
    _, state = small_vae
    latent = random_latent(16, 16)
    return latent, diffusers_decode(state, BASE_DIM, latent)


def test_untiled_decode_matches_diffusers(small_vae, latent_and_reference):
    path, _ = small_vae
    latent, reference = latent_and_reference
    decoder = load_vae_decoder(path)
    assert decoder.base_dim == BASE_DIM
    ours = decoder.decode_float(latent)
    assert ours.shape == reference.shape == (128, 128, 3)
    assert reference.std() > 0.05  # a real image, not a saturated or flat one
    assert psnr(ours, reference) >= 45.0
    pixels = decoder.decode(latent)
    assert pixels.dtype == np.uint8 and pixels.shape == (128, 128, 3)


def test_tiled_decode_stays_close_to_untiled(small_vae, latent_and_reference):
    path, _ = small_vae
    latent, reference = latent_and_reference
    tiled = load_vae_decoder(path).decode_float(latent, tiled=True, tile=8, overlap=0.5)  # 3x3 tiles
    assert 30.0 <= psnr(tiled, reference) < 100.0  # close, but really tiled (not identical)


def test_one_tile_covering_the_latent_is_the_untiled_decode(small_vae):
    path, _ = small_vae
    latent = random_latent(8, 12)
    decoder = load_vae_decoder(path)
    np.testing.assert_array_equal(decoder.decode(latent, tiled=True, tile=32), decoder.decode(latent))


def test_tile_plan_matches_sdcpp():
    assert tile_axis(64, 32, 0.5).count == 3 and tile_axis(64, 32, 0.5).overlap_factor == 0.5  # 512 px
    assert tile_axis(128, 32, 0.5).count == 7  # 1024 px
    assert tile_axis(32, 32, 0.5).count == 1
    assert (tile_axis(40, 32, 0.5).count, tile_axis(40, 32, 0.5).overlap_factor) == (2, 0.75)


def test_tiles_blend_to_a_partition_of_unity():
    """A decoder that returns constant ones: the smootherstep weights must sum to exactly 1 everywhere."""
    ones = lambda tile: np.ones((1, 3, tile.shape[2] * 8, tile.shape[3] * 8), np.float32)
    for h, w, tile in [(64, 64, 32), (48, 80, 32), (40, 40, 32), (30, 22, 8)]:
        out = decode_tiled(ones, np.zeros((1, 16, h, w), np.float32), tile, 0.5)
        np.testing.assert_allclose(out, 1.0, atol=1e-5)


def test_non_finite_latent_is_a_user_error(small_vae):
    path, _ = small_vae
    latent = random_latent(8, 8)
    latent[0, 3, 2, 2] = np.nan
    with pytest.raises(UserError, match="NaN"):
        load_vae_decoder(path).decode(latent)


def test_missing_and_misshapen_keys_are_named(small_vae, tmp_path):
    _, state = small_vae
    broken = {k: torch.from_numpy(v) for k, v in state.items() if k != "decoder.middle.1.proj.bias"}
    broken["decoder.upsamples.2.residual.2.bias"] = torch.zeros(7)
    path = tmp_path / "broken.safetensors"
    save_file(broken, str(path))
    with pytest.raises(UserError, match=r"missing decoder\.middle\.1\.proj\.bias.*misshapen decoder\.upsamples\.2"):
        load_vae_decoder(path)
    with pytest.raises(UserError, match="not found"):
        load_vae_decoder(tmp_path / "absent.safetensors")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"truncated download")
    with pytest.raises(UserError, match="not a complete safetensors file"):
        load_vae_decoder(junk)


@pytest.mark.slow
def test_full_size_decoder_matches_diffusers(tmp_path):
    path = tmp_path / "qwen_image_vae.safetensors"
    state = write_vae_file(path, 96)
    latent = random_latent(16, 16)
    ours = load_vae_decoder(path).decode_float(latent)
    assert psnr(ours, diffusers_decode(state, 96, latent)) >= 45.0
