"""The torch-free VAE decoder: the decoder graph (graphs.py) built from the safetensors and run by
onnxruntime on the CPU, untiled or with stable-diffusion.cpp's tiles and blending. decode_latent falls
back to it when sd.cpp cannot run (library not built, or a VAE width other than the release's)."""

import numpy as np
import onnxruntime

from anima_ui.vae.graphs import build_decoder_graph
from anima_ui.vae.latent import check_latent, to_uint8
from anima_ui.vae.tiling import decode_tiled
from anima_ui.vae.weights import load_decoder_weights


def ort_session(model, threads: int | None = None) -> onnxruntime.InferenceSession:
    """An onnxruntime CPU session for an in-memory onnx.ModelProto."""
    return _session(model.SerializeToString(), threads)


def ort_file_session(path, threads: int | None = None) -> onnxruntime.InferenceSession:
    return _session(str(path), threads)


def _session(model, threads: int | None) -> onnxruntime.InferenceSession:
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads or 0
    return onnxruntime.InferenceSession(model, options, providers=["CPUExecutionProvider"])


class OnnxDecoder:
    """The decoder weights of one VAE file; one onnxruntime session per graph shape, built on first use."""

    def __init__(self, vae_path, threads: int | None = None):
        self.base_dim, self.weights = load_decoder_weights(vae_path)
        self.threads = threads
        self._sessions = {}

    def _run(self, latent: np.ndarray, clip: bool) -> np.ndarray:
        _, _, h, w = latent.shape
        if (h, w, clip) not in self._sessions:
            graph = build_decoder_graph(self.weights, self.base_dim, h, w, clip=clip)
            self._sessions[h, w, clip] = ort_session(graph, self.threads)
        return self._sessions[h, w, clip].run(None, {"latent": latent})[0]

    def decode_float(self, latent, tiled: bool = False, tile: int = 32, overlap: float = 0.5,
                     cancel=None) -> np.ndarray:
        """Model-space latent [1,16,h,w] -> float image [8h,8w,3] in [0,1]. `cancel` (a threading.Event) stops a
        tiled decode between tiles."""
        latent = check_latent(latent)
        if tiled:
            # tiles are blended before clamping, as sd.cpp does
            out = decode_tiled(lambda t: self._run(t, clip=False), latent, tile, overlap, cancel)
        else:
            out = self._run(latent, clip=True)
        return np.clip(out[0].transpose(1, 2, 0), 0.0, 1.0)

    def decode(self, latent, tiled: bool = False, tile: int = 32, overlap: float = 0.5, cancel=None) -> np.ndarray:
        """Model-space latent [1,16,h,w] -> uint8 RGB [8h,8w,3]."""
        return to_uint8(self.decode_float(latent, tiled, tile, overlap, cancel))
