"""The final decode: stable-diffusion.cpp's tiled VAE by default; the project's decoder graphs on
onnxruntime (no torch) when the native library is missing, cannot be loaded or cannot run this VAE
(with a warning the UI shows), or on request. The torch decoder (wan_decoder.py) is the tests' reference,
not a choice here: the graphs compute the same image faster (anima-ui bench vae)."""

from PIL import Image

from anima_ui.errors import UserError
from anima_ui.vae.latent import check_latent
from anima_ui.vae.onnx_decoder import OnnxDecoder
from anima_ui.vae.sdcpp import NativeDecoderUnavailable, SdcppDecoder

DECODERS = ("sdcpp", "onnx")


def decode_latent(latent, vae_path, prefer: str = "sdcpp", tiled: bool = True, threads: int | None = None,
                  tile: int = 32, overlap: float = 0.5) -> tuple[Image.Image, str, str | None]:
    """Model-space latent [1,16,h,w] -> (RGB image, decoder name, warning or None)."""
    if prefer not in DECODERS:
        raise UserError(f"unknown VAE decoder {prefer!r}; use one of {', '.join(DECODERS)}")
    latent = check_latent(latent)
    warning = None
    if prefer == "sdcpp":
        try:
            with SdcppDecoder(vae_path, threads=threads) as decoder:
                pixels = decoder.decode(latent, tiled=tiled, tile=tile, overlap=overlap)
            return Image.fromarray(pixels, "RGB"), "sdcpp", None
        except NativeDecoderUnavailable as exc:
            warning = f"stable-diffusion.cpp VAE unavailable ({exc}); decoded with the onnx decoder"
    pixels = OnnxDecoder(vae_path, threads=threads).decode(latent, tiled=tiled, tile=tile, overlap=overlap)
    return Image.fromarray(pixels, "RGB"), "onnx", warning

