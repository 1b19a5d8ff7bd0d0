"""The final decode: stable-diffusion.cpp's tiled VAE by default; the project's decoder graphs on
onnxruntime (no torch) when the native library is missing, cannot be loaded or cannot run this VAE
(with a warning the UI shows), or on request; the decoder graphs on the NPU (or the simulated board)
with "npu". The torch decoder (wan_decoder.py) is the tests' reference, not a choice here: the graphs
compute the same image faster (anima-ui bench vae)."""

from PIL import Image

from anima_ui.errors import UserError
from anima_ui.vae.latent import check_latent
from anima_ui.vae.npu_decoder import decode_for_model
from anima_ui.vae.onnx_decoder import OnnxDecoder
from anima_ui.vae.sdcpp import NativeDecoderUnavailable, SdcppDecoder

DECODERS = ("sdcpp", "onnx", "npu")


def decode_latent(latent, vae_path, prefer: str = "sdcpp", tiled: bool = True, threads: int | None = None,
                  tile: int = 32, overlap: float = 0.5, npu: dict | None = None,
                  cancel=None) -> tuple[Image.Image, str, str | None]:
    """Model-space latent [1,16,h,w] -> (RGB image, decoder name, warning or None).
    npu: the NPU decoder's options (backend, layout, time_scale, core_mask; see npu_decoder.decode_for_model);
    cancel: a threading.Event; once set, the decode stops with Cancelled (between graphs or tiles, and within a
    tile where the native library can)."""
    if prefer not in DECODERS:
        raise UserError(f"unknown VAE decoder {prefer!r}; use one of {', '.join(DECODERS)}")
    latent = check_latent(latent)
    if prefer == "npu":
        pixels = decode_for_model(latent, vae_path, cancel=cancel, **(npu or {}))
        return Image.fromarray(pixels, "RGB"), "npu", None
    warning = None
    if prefer == "sdcpp":
        try:
            with SdcppDecoder(vae_path, threads=threads) as decoder:
                pixels = decoder.decode(latent, tiled=tiled, tile=tile, overlap=overlap, cancel=cancel)
            return Image.fromarray(pixels, "RGB"), "sdcpp", None
        except NativeDecoderUnavailable as exc:
            warning = f"stable-diffusion.cpp VAE unavailable ({exc}); decoded with the onnx decoder"
    pixels = OnnxDecoder(vae_path, threads=threads).decode(latent, tiled=tiled, tile=tile, overlap=overlap,
                                                           cancel=cancel)
    return Image.fromarray(pixels, "RGB"), "onnx", warning

