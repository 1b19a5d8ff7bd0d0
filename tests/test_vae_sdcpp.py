"""The native stable-diffusion.cpp decoder (native/build/libanima_vae.so, built by scripts/setup.sh)
against diffusers on the same random full-size weights (sd.cpp's WanVAE has the width 96 built in)."""

import threading

import numpy as np
import pytest

from anima_ui.errors import Cancelled, UserError
from anima_ui.metrics import psnr
from anima_ui.vae.sdcpp import LIBRARY, NativeDecoderUnavailable, SdcppDecoder, cpu_has_native_bf16
from anima_ui.vae.wan_decoder import load_vae_decoder
from vae_helpers import diffusers_decode, random_latent, write_vae_file

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# 12x12 latent (96x96 px): decoded untiled, and tiled with 8-latent-pixel tiles = 2x2 tiles, overlap 0.5
# (smaller tiles see too little context for 30 dB with random weights: 4-pixel tiles give 23 dB)
H = W = 12
TILE = 8


@pytest.fixture(scope="module")
def full_vae(tmp_path_factory):
    assert LIBRARY.is_file(), f"{LIBRARY} is missing: run scripts/build_sdcpp_vae.sh"
    path = tmp_path_factory.mktemp("vae") / "qwen_image_vae.safetensors"
    state = write_vae_file(path, 96)
    latent = random_latent(H, W)
    return path, latent, diffusers_decode(state, 96, latent)


@pytest.fixture(scope="module")
def sdcpp_images(full_vae):
    """(untiled, tiled) uint8 decodes with the default (auto) weight type, one thread."""
    path, latent, _ = full_vae
    with SdcppDecoder(path, threads=1) as decoder:
        return decoder.decode(latent, tiled=False), decoder.decode(latent, tiled=True, tile=TILE, overlap=0.5)


def test_untiled_matches_diffusers(full_vae, sdcpp_images):
    _, _, reference = full_vae
    pixels, _ = sdcpp_images
    assert pixels.dtype == np.uint8 and pixels.shape == (8 * H, 8 * W, 3)
    assert psnr(pixels / 255.0, reference) >= 35.0


def test_tiled_matches_diffusers_and_the_own_tiling(full_vae, sdcpp_images):
    path, latent, reference = full_vae
    untiled, tiled = (image / 255.0 for image in sdcpp_images)
    assert 30.0 <= psnr(tiled, reference)
    assert psnr(tiled, untiled) < 60.0  # the tiles really were decoded separately
    own_tiled = load_vae_decoder(path).decode(latent, tiled=True, tile=TILE, overlap=0.5) / 255.0
    assert psnr(tiled, own_tiled) >= 45.0  # same tile plan and smootherstep blending


@pytest.mark.parametrize("weight_type", ["f16", "f32"])
def test_other_weight_types_agree(full_vae, weight_type):
    path, latent, reference = full_vae
    with SdcppDecoder(path, threads=1, weight_type=weight_type) as decoder:
        assert decoder.weight_type == weight_type
        assert psnr(decoder.decode(latent, tiled=False) / 255.0, reference) >= 35.0


def test_non_finite_latent_and_bad_files_are_user_errors(full_vae, tmp_path):
    path, latent, _ = full_vae
    bad = latent.copy()
    bad[0, 0, 0, 0] = np.inf
    with SdcppDecoder(path, threads=1) as decoder, pytest.raises(UserError, match="NaN or Inf"):
        decoder.decode(bad)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(UserError, match="cannot load the VAE junk.safetensors"):
        SdcppDecoder(junk, threads=1)


def test_missing_library_is_reported_as_unavailable(full_vae, tmp_path):
    path, _, _ = full_vae
    with pytest.raises(NativeDecoderUnavailable, match="not built"):
        SdcppDecoder(path, library=tmp_path / "libanima_vae.so")
    not_a_library = tmp_path / "broken.so"
    not_a_library.write_text("garbage")
    with pytest.raises(NativeDecoderUnavailable, match="cannot load"):
        SdcppDecoder(path, library=not_a_library)


def test_bf16_detection_reads_cpu_flags():
    assert cpu_has_native_bf16("processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16 avx512_vnni\n")
    assert not cpu_has_native_bf16("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f\n")
    assert cpu_has_native_bf16("processor\t: 0\nFeatures\t: fp asimd fphp asimdhp bf16 i8mm\n")
    assert not cpu_has_native_bf16("processor\t: 0\nFeatures\t: fp asimd fphp asimdhp asimddp\n")  # Cortex-A76


def test_stop_ends_a_decode_inside_the_library(full_vae, sdcpp_images):
    path, latent, _ = full_vae
    stop = threading.Event()
    stop.set()  # set before the call: the library must not decode a single graph node
    with SdcppDecoder(path, threads=1) as decoder:
        assert hasattr(decoder._lib, "anima_vae_set_cancel"), "the library predates its cancel hook: run scripts/build_sdcpp_vae.sh"
        with pytest.raises(Cancelled):
            decoder.decode(latent, tiled=True, tile=TILE, overlap=0.5, cancel=stop)
        assert decoder._lib.anima_vae_last_error()  # the compute was stopped: the library reports a failed decode
        # The stop is for that decode only: the next one runs to the end, as before.
        np.testing.assert_array_equal(decoder.decode(latent, tiled=False, cancel=threading.Event()), sdcpp_images[0])
