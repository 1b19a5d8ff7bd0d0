"""The final decode: stable-diffusion.cpp's tiled VAE by default, the own torch decoder when the native
library is missing or cannot be loaded (with a warning the UI shows)."""

from pathlib import Path

from PIL import Image

from anima_ui.errors import UserError
from anima_ui.vae.latent import check_latent
from anima_ui.vae.sdcpp import NativeDecoderUnavailable, SdcppDecoder

DECODERS = ("sdcpp", "torch")


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
            warning = f"stable-diffusion.cpp VAE unavailable ({exc}); decoded with the torch decoder"
    pixels = _torch_decode(latent, Path(vae_path), tiled, threads, tile, overlap)
    return Image.fromarray(pixels, "RGB"), "torch", warning


def _torch_decode(latent, vae_path: Path, tiled: bool, threads: int | None, tile: int, overlap: float):
    import torch

    from anima_ui.vae.wan_decoder import load_vae_decoder

    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return load_vae_decoder(vae_path).decode(latent, tiled=tiled, tile=tile, overlap=overlap)
    finally:
        torch.set_num_threads(previous)
