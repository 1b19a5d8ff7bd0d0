"""decode_latent: sd.cpp by default, the own graph decoder on onnxruntime (with a warning) when the library is
unusable, or on request."""

import numpy as np
import pytest

from anima_ui.errors import UserError
from anima_ui.metrics import psnr
from anima_ui.vae.decode import decode_latent
from anima_ui.vae.onnx_decoder import OnnxDecoder
from anima_ui.vae.wan_decoder import load_vae_decoder
from vae_helpers import random_latent, small_vae_file, write_vae_file

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def small_vae(tmp_path_factory):
    return small_vae_file(tmp_path_factory)[0]


@pytest.mark.parametrize("library", ["absent", "garbage"])
def test_unusable_native_library_falls_back_to_onnx(small_vae, tmp_path, monkeypatch, library):
    lib = tmp_path / "libanima_vae.so"
    if library == "garbage":
        lib.write_text("not an ELF file")
    monkeypatch.setenv("ANIMA_VAE_LIB", str(lib))
    latent = random_latent(12, 16)
    image, name, warning = decode_latent(latent, small_vae, threads=1)
    assert name == "onnx"
    assert "stable-diffusion.cpp VAE unavailable" in warning and str(lib) in warning
    assert image.size == (128, 96) and image.mode == "RGB"
    expected = OnnxDecoder(small_vae).decode(latent, tiled=True)
    np.testing.assert_array_equal(np.asarray(image), expected)


def test_a_non_release_width_falls_back_to_onnx(small_vae):
    """sd.cpp's WanVAE is fixed at width 96; the tiny random models (width 16) decode with the graph decoder."""
    image, name, warning = decode_latent(random_latent(4, 4), small_vae, threads=1)
    assert name == "onnx" and "VAE width 16" in warning and "release width 96" in warning
    assert image.size == (32, 32)


def test_onnx_decoder_on_request_has_no_warning(small_vae):
    latent = random_latent(8, 8)
    image, name, warning = decode_latent(latent, small_vae, prefer="onnx", tiled=False)
    assert (name, warning) == ("onnx", None)
    np.testing.assert_array_equal(np.asarray(image), OnnxDecoder(small_vae).decode(latent))
    assert psnr(np.asarray(image) / 255.0, load_vae_decoder(small_vae).decode_float(latent)) >= 45.0


def test_sdcpp_is_the_default(tmp_path):
    path = tmp_path / "qwen_image_vae.safetensors"
    write_vae_file(path, 96)
    image, name, warning = decode_latent(random_latent(4, 6), path, threads=1)
    assert (name, warning) == ("sdcpp", None)
    assert image.size == (48, 32)


def test_bad_input_is_a_user_error(small_vae):
    for unknown in ("gpu", "torch"):  # the torch decoder is the tests' reference only
        with pytest.raises(UserError, match="unknown VAE decoder"):
            decode_latent(random_latent(4, 4), small_vae, prefer=unknown)
    with pytest.raises(UserError, match=r"expected \[1, 16, h, w\]"):
        decode_latent(np.zeros((1, 4, 8, 8), np.float32), small_vae)
    latent = random_latent(4, 4)
    latent[0, 0, 0, 0] = np.nan
    with pytest.raises(UserError, match="NaN"):
        decode_latent(latent, small_vae)
