"""The native stable-diffusion.cpp VAE decoder (native/build/libanima_vae.so, built by
scripts/build_sdcpp_vae.sh) through ctypes.

The library receives the MODEL-space latent: it applies the Wan-2.1 mean/std itself, exactly once,
as sd.cpp's decode_first_stage does.
"""

import ctypes
import os
import threading
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from anima_ui.errors import Cancelled, UserError
from anima_ui.vae.latent import SCALE, check_latent

LIBRARY = Path(__file__).resolve().parents[2] / "native" / "build" / "libanima_vae.so"

# sd_type_t values (include/stable-diffusion.h) for the weight type chosen at load
WEIGHT_TYPES = {"f32": 0, "f16": 1, "bf16": 30}

RELEASE_BASE_DIM = 96  # sd.cpp 0.4.7's WanVAE has the release width built in (tiny test models differ)


class NativeDecoderUnavailable(Exception):
    """The native library is not built or cannot be loaded on this machine, or the VAE is not the
    release width sd.cpp has built in (decode.py falls back to the onnx decoder)."""


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """True when the CPU computes bf16 dot products natively (x86 AVX512_BF16, Arm FEAT_BF16)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    flags = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return "avx512_bf16" in flags or "bf16" in flags


def auto_weight_type() -> str:
    """bf16 (as the release file stores it) where the CPU has native bf16, else f16."""
    return "bf16" if cpu_has_native_bf16() else "f16"


def vae_base_dim(vae_path: Path) -> int | None:
    """The VAE's base width from the file header (decoder.head.2.weight is [3, base_dim, 3, 3, 3])."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(vae_path), framework="numpy") as handle:
            if "decoder.head.2.weight" not in handle.keys():
                return None
            return int(handle.get_slice("decoder.head.2.weight").get_shape()[1])
    except (SafetensorError, OSError):
        return None  # unreadable: the loader that follows names the problem


def _load_library(path: Path) -> ctypes.CDLL:
    if not path.is_file():
        raise NativeDecoderUnavailable(f"{path} is not built (run scripts/build_sdcpp_vae.sh)")
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise NativeDecoderUnavailable(f"cannot load {path}: {exc}") from exc
    lib.anima_vae_load.restype = ctypes.c_void_p
    lib.anima_vae_load.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int]
    lib.anima_vae_decode.restype = ctypes.c_int
    lib.anima_vae_decode.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                     ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_void_p]
    lib.anima_vae_free.restype = None
    lib.anima_vae_free.argtypes = [ctypes.c_void_p]
    lib.anima_vae_last_error.restype = ctypes.c_char_p
    lib.anima_vae_last_error.argtypes = []
    if hasattr(lib, "anima_vae_set_cancel"):  # a library built before it existed decodes to the end
        lib.anima_vae_set_cancel.restype = None
        lib.anima_vae_set_cancel.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
    return lib


class SdcppDecoder:
    """sd.cpp's WanVAERunner with the decoder weights of one VAE file loaded; use as a context manager."""

    def __init__(self, vae_path, threads: int | None = None, weight_type: str = "auto",
                 library: Path | None = None):
        vae_path = Path(vae_path)
        if not vae_path.is_file():
            raise UserError(f"VAE file not found: {vae_path}; put qwen_image_vae.safetensors in the model's vae/ folder")
        if weight_type == "auto":
            weight_type = auto_weight_type()
        if weight_type not in WEIGHT_TYPES:
            raise UserError(f"unknown VAE weight type {weight_type!r}; use one of auto, {', '.join(WEIGHT_TYPES)}")
        self.weight_type = weight_type
        self._lib = _load_library(Path(library or os.environ.get("ANIMA_VAE_LIB", LIBRARY)))
        base_dim = vae_base_dim(vae_path)
        if base_dim not in (None, RELEASE_BASE_DIM):
            raise NativeDecoderUnavailable(f"{vae_path.name} has VAE width {base_dim}, stable-diffusion.cpp "
                                           f"supports only the release width {RELEASE_BASE_DIM}")
        self._ctx = self._lib.anima_vae_load(str(vae_path).encode(), threads or 0, WEIGHT_TYPES[weight_type])
        if not self._ctx:
            reason = self._lib.anima_vae_last_error().decode(errors="replace").strip()
            raise UserError(f"stable-diffusion.cpp cannot load the VAE {vae_path.name}: {reason}; "
                            "use vae/qwen_image_vae.safetensors from the Anima release")

    def decode(self, latent, tiled: bool = True, tile: int = 32, overlap: float = 0.5, cancel=None) -> np.ndarray:
        """Model-space latent [1,16,h,w] -> uint8 RGB [8h, 8w, 3]. Once `cancel` (a threading.Event) is set, the
        library stops at its next graph node and this raises Cancelled."""
        if not self._ctx:
            raise RuntimeError("decode() after close()")
        latent = check_latent(latent)
        _, _, h, w = latent.shape
        out = np.empty((h * SCALE, w * SCALE, 3), dtype=np.uint8)
        with _cancel_flag(self._lib, self._ctx, cancel):
            status = self._lib.anima_vae_decode(self._ctx, latent.ctypes.data, w, h, int(tiled), tile, overlap,
                                                out.ctypes.data)
        if cancel is not None and cancel.is_set():
            raise Cancelled("cancelled")
        if status != 0:
            reason = self._lib.anima_vae_last_error().decode(errors="replace").strip()
            raise RuntimeError(f"stable-diffusion.cpp VAE decode failed: {reason}")
        return out

    def close(self) -> None:
        if self._ctx:
            self._lib.anima_vae_free(self._ctx)
            self._ctx = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()



@contextmanager
def _cancel_flag(lib, ctx, cancel):
    """While a decode runs, a thread copies `cancel` (a threading.Event) into the int the library polls between
    graph nodes: the decode runs without the GIL, so the flag must be readable without Python."""
    if cancel is None or not hasattr(lib, "anima_vae_set_cancel"):
        yield
        return
    flag, done = ctypes.c_int(int(cancel.is_set())), threading.Event()

    def relay():
        while not done.is_set():
            if cancel.wait(0.05):
                flag.value = 1
                return

    lib.anima_vae_set_cancel(ctx, ctypes.byref(flag))
    thread = threading.Thread(target=relay, name="anima-vae-cancel", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        lib.anima_vae_set_cancel(ctx, None)
