"""One generation as an iterator of events: text → context → denoise (CFG, optional Spectrum) → decode.

The pipeline knows nothing of Gradio. The job engine (`anima_ui/jobs.py`) and `anima-ui generate` both consume
`Pipeline.generate`, which yields a `PhaseEvent` when a phase starts, a `StepEvent` after every sampler step (computed
or forecast, with the step's x0 for previews) and one `ResultEvent` at the end.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from anima_ui.errors import Cancelled, UserError
from anima_ui.request import GenerationRequest

BACKENDS = ("torch", "onnx", "sim", "rknn")


@dataclass
class PhaseEvent:
    phase: str  # "text" | "denoise" | "decode"


@dataclass
class StepEvent:
    step: int  # 1-based
    total: int
    computed: bool  # False: Spectrum forecast this step's x0 without a model evaluation
    sigma: float
    x0: np.ndarray  # [1, 16, h, w], model space
    seconds: float
    timings: dict


@dataclass
class ResultEvent:
    image: object  # PIL.Image.Image, or None when the request asked for no decode
    latent: np.ndarray  # [1, 16, h, w], model space
    summary: dict


Event = PhaseEvent | StepEvent | ResultEvent


class Pipeline:
    """The loaded model: DiT host weights, the text encoder, the branch runtime choice and the VAE path."""

    def __init__(self, paths, config, weights, text_encoder, backend: str, runtime_options: dict, decoder: str = "sdcpp"):
        self.paths = paths
        self.config = config
        self.weights = weights
        self.text_encoder = text_encoder
        self.backend = backend
        self.runtime_options = runtime_options
        self.decoder = decoder
        self.runtime = None  # the branch runtime of the running generation (the UI's status panel reads it)
        self._torch_branches = None

    @classmethod
    def load(cls, models_dir, backend: str = "torch", decoder: str = "sdcpp", **runtime_options) -> "Pipeline":
        """decoder: "sdcpp" (stable-diffusion.cpp's tiled VAE, falling back to torch with a warning) or "torch"."""
        from anima_ui.vae.decode import DECODERS

        if backend not in BACKENDS:
            raise UserError(f"unknown backend {backend!r}: choose one of {', '.join(BACKENDS)}")
        if decoder not in DECODERS:
            raise UserError(f"unknown VAE decoder {decoder!r}: choose one of {', '.join(DECODERS)}")
        from anima_ui.model.checkpoint import load_dit, split_adapter
        from anima_ui.modelfiles import ModelPaths
        from anima_ui.runtime.host_weights import load_host_weights
        from anima_ui.text.encoder import TextEncoder

        paths = ModelPaths.find(models_dir)
        # Graph backends hold the branch weights in their graphs: the host keeps only its own tensors
        # (1.2 GB instead of 8.4 GB in fp32 at full size), which is what fits next to the NPU on an 8 GB board.
        config, state = load_dit(paths.dit) if backend == "torch" else load_host_weights(paths.dit)
        text_encoder = TextEncoder.load(paths, split_adapter(state))
        return cls(paths, config, state, text_encoder, backend, runtime_options, decoder)

    # -- one generation ---------------------------------------------------------------------------------------------
    def generate(self, request: GenerationRequest, cancel: threading.Event | None = None) -> Iterator[Event]:
        cancel = cancel or threading.Event()
        started = time.perf_counter()
        seconds = {}

        yield PhaseEvent("text")
        t0 = time.perf_counter()
        contexts = [self.text_encoder.encode(request.prompt)]
        if request.uses_uncond:
            contexts.append(self.text_encoder.encode(request.negative))
        kv, rope = self._prepare_conditioning(contexts, request)
        seconds["text"] = time.perf_counter() - t0
        _check(cancel)

        yield PhaseEvent("denoise")
        t0 = time.perf_counter()
        latent, steps, model_evals = yield from self._denoise(request, kv, rope, cancel)
        seconds["denoise"] = time.perf_counter() - t0

        image, decoder, warning = None, None, None
        if request.decode:
            _check(cancel)
            yield PhaseEvent("decode")
            t0 = time.perf_counter()
            image, decoder, warning = self._decode(latent)
            seconds["decode"] = time.perf_counter() - t0
        seconds["total"] = time.perf_counter() - started

        passes_per_eval = len(contexts)
        summary = {
            "width": request.width,
            "height": request.height,
            "steps": request.steps,
            "cfg": request.cfg,
            "seed": request.seed,
            "spectrum": request.spectrum,
            "backend": self.backend,
            "model_evals": model_evals,
            "transformer_passes": passes_per_eval * model_evals,
            "decoder": decoder,
            "warning": warning,
            "seconds": {k: round(v, 3) for k, v in seconds.items()},
            "per_step": steps,
        }
        yield ResultEvent(image=image, latent=latent, summary=summary)

    def _prepare_conditioning(self, contexts, request):
        from anima_ui.model.forward import prepare_kv, prepare_rope

        context = np.concatenate(contexts, axis=0)
        kv = prepare_kv(self.weights, context)
        rope = prepare_rope(self.config, request.height // 8, request.width // 8)
        return kv, rope

    def _denoise(self, request, kv, rope, cancel):
        """Generator: yields StepEvents, returns (final latent, per-step records, model evaluations)."""
        from anima_ui.model.forward import dit_forward
        from anima_ui.sampling.cfg import cfg_combine
        from anima_ui.sampling.euler import euler_steps
        from anima_ui.sampling.noise import initial_noise
        from anima_ui.sampling.schedule import simple_sigmas
        from anima_ui.sampling.spectrum import Spectrum

        batch = 2 if request.uses_uncond else 1
        sigmas = simple_sigmas(request.steps)
        x = initial_noise(request.seed, request.height, request.width)
        spectrum = Spectrum(request.steps, **request.spectrum_params) if request.spectrum else None
        run_branch = self._open_runtime(request, cancel)

        def predict_x0(x_t, sigma):
            xs = np.repeat(x_t, batch, axis=0)
            velocity = dit_forward(self.weights, run_branch, xs, np.full(batch, sigma, np.float32), kv, rope)
            x0 = xs - sigma * velocity
            return cfg_combine(x0[:1], x0[1:], request.cfg) if batch == 2 else x0

        records, model_evals = [], 0
        try:
            t_step = time.perf_counter()
            before = _runtime_timings(self.runtime)
            for info in euler_steps(predict_x0, x, sigmas, spectrum):
                _check(cancel)
                step_seconds = time.perf_counter() - t_step
                after = _runtime_timings(self.runtime)
                timings = _step_timings(before, after) if info.computed else {}
                model_evals += int(info.computed)
                record = {"step": info.index0 + 1, "computed": info.computed, "seconds": round(step_seconds, 3), **timings}
                records.append(record)
                yield StepEvent(
                    step=info.index0 + 1,
                    total=request.steps,
                    computed=info.computed,
                    sigma=float(info.sigma),
                    x0=info.x0,
                    seconds=step_seconds,
                    timings=timings,
                )
                x = info.x
                t_step, before = time.perf_counter(), after
        finally:
            self._close_runtime()
        if not np.all(np.isfinite(x)):
            raise UserError("the denoised latent contains NaN or Inf; nothing was saved (try another seed or fewer steps)")
        return x, records, model_evals

    def _open_runtime(self, request, cancel):
        """The run_branch callable for dit_forward: torch modules directly, or a branch runtime over exported graphs."""
        if self.backend == "torch":
            from anima_ui.model.forward import TorchBranches

            if self._torch_branches is None:
                self._torch_branches = TorchBranches(self.weights, self.config)

            def run_branch(block, kind, inputs):
                _check(cancel)
                return self._torch_branches(block, kind, inputs)

            self.runtime = None
            return run_branch
        from anima_ui.runtime import open_runtime

        self.runtime = open_runtime(
            self.backend, self._graphs_dir(request), cancel=cancel, **self.runtime_options
        )
        return self.runtime

    def _graphs_dir(self, request) -> Path:
        if self.backend == "rknn":
            graphs = self.paths.rknn_dir(request.width, request.height)
            if not (graphs / "manifest.json").exists():
                raise UserError(
                    f"no RKNN graphs for {request.width}x{request.height} in {graphs}: run `anima-ui export` then "
                    "`anima-ui convert-rknn` for this size (README, 'On the board')"
                )
            return graphs
        graphs = self.paths.exported_dir(request.width, request.height)
        if not (graphs / "manifest.json").exists():
            from anima_ui.convert.export import export_graphs
            from anima_ui.model.checkpoint import load_dit

            _, full_weights = load_dit(self.paths.dit)  # the branch weights, only for as long as the export takes
            export_graphs(self.paths, self.config, full_weights, request.width, request.height, graphs)
        return graphs

    def _close_runtime(self):
        if self.runtime is not None:
            self.runtime.close()

    def _decode(self, latent):
        from anima_ui.vae.decode import decode_latent

        return decode_latent(latent, self.paths.vae, prefer=self.decoder)


def _check(cancel: threading.Event) -> None:
    if cancel.is_set():
        raise Cancelled("cancelled")


def _step_timings(before: dict, after: dict) -> dict:
    """Seconds of one step from two snapshots of the runtime's additive counters."""
    if not after:
        return {}
    delta = {k: after[k] - before.get(k, 0.0) for k in ("inference", "host", "lifecycle", "lifecycle_exposed")}
    return {
        "npu_seconds": round(delta["inference"], 4),
        "host_seconds": round(delta["host"], 4),
        "lifecycle_seconds": round(delta["lifecycle"], 4),
        # a context prefetched late in one step for the next can make the exposed share exceed this step's own
        "lifecycle_hidden_seconds": round(max(0.0, delta["lifecycle"] - delta["lifecycle_exposed"]), 4),
    }


def _runtime_timings(runtime) -> dict:
    return dict(runtime.timings) if runtime is not None else {}
