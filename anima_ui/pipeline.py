"""One generation as an iterator of events: (export) → text → context → denoise (CFG, optional Spectrum) → decode.

The pipeline knows nothing of Gradio. The job engine (`anima_ui/jobs.py`) and `anima-ui generate` both consume
`Pipeline.generate`, which yields a `PhaseEvent` when a phase starts, a `StepEvent` after every sampler step (computed
or forecast, with the step's x0 for previews) and one `ResultEvent` at the end. A size whose ONNX graphs are not
exported yet gets an explicit "export" phase first (minutes at full size); nothing else is done behind the caller's
back.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from anima_ui.convert.model_graphs import export_model_graphs
from anima_ui.errors import Cancelled, UserError
from anima_ui.model.checkpoint import ADAPTER_PREFIX, load_dit
from anima_ui.model.forward import prepare_kv, prepare_rope
from anima_ui.modelfiles import ModelPaths
from anima_ui.request import GenerationRequest
from anima_ui.runtime import BACKENDS, Plan, open_runtime
from anima_ui.runtime.graphs import graphs_dir, graphs_ready
from anima_ui.runtime.host_weights import load_host_weights
from anima_ui.runtime.manifest import Manifest
from anima_ui.runtime.profile import read_profile
from anima_ui.runtime.quantized_ffn import quantized_blocks
from anima_ui.sampling.cfg import cfg_x0_predictor
from anima_ui.sampling.euler import StepInfo, euler_steps
from anima_ui.sampling.noise import initial_noise
from anima_ui.sampling.schedule import simple_sigmas
from anima_ui.sampling.spectrum import Spectrum
from anima_ui.text.encoder import TextEncoder, open_networks
from anima_ui.vae.decode import DECODERS, decode_latent
from anima_ui.vae.latent import SCALE
from anima_ui.vae.npu_decoder import model_layout

CACHED_CONTEXTS = 4  # positive + negative of the current job and of the previous one

# Pipeline.load's runtime keyword arguments (commands/pipeline_flags.py makes them from the flags):
#   variants: {kind: variant} chosen by flags, or None (the tune profile's, else prefetch everywhere)
#   contexts (K, None: the profile's or 2), core_mask, wait_for_inference, use_profile: the plan
#   time_scale, contention, resident, threads: the simulated board's and onnxruntime's;
#   mem_floor_gib, swap_policy, gate_wait_seconds: the memory gate
RUNTIME_OPTIONS = ("variants", "contexts", "core_mask", "wait_for_inference", "use_profile", "time_scale", "contention",
                   "resident", "threads", "mem_floor_gib", "swap_policy", "gate_wait_seconds", "ffn")
OPEN_OPTIONS = ("time_scale", "contention", "resident", "threads", "mem_floor_gib", "swap_policy", "gate_wait_seconds", "ffn")

# torch is optional (requirements-dev.txt; the board installs none): only the torch backend imports it, and it is
# imported where it is used, so the app starts and reports a missing torch as a failed job instead of not starting.


@dataclass
class PhaseEvent:
    phase: str  # "export" | "text" | "denoise" | "decode"


@dataclass(frozen=True)
class StepEvent:
    """One sampler step: the sampler's own record, and what the step cost."""

    info: StepInfo  # index0, total, sigma, x, x0 (model space, for previews), computed (False: Spectrum forecast)
    seconds: float  # wall time of the step
    timings: dict  # the runtime's counters over a computed step (npu/host/lifecycle seconds); {} when it has none

    @property
    def step(self) -> int:
        """1-based."""
        return self.info.index0 + 1

    def record(self) -> dict:
        """The step as JSON-able numbers (the ResultEvent summary's `per_step`)."""
        return {"step": self.step, "computed": self.info.computed, "seconds": round(self.seconds, 3), **self.timings}


@dataclass
class ResultEvent:
    image: object  # PIL.Image.Image, or None when the request asked for no decode
    latent: np.ndarray  # [1, 16, h, w], model space
    summary: dict


Event = PhaseEvent | StepEvent | ResultEvent


@dataclass
class RuntimeChoice:
    """How the branch graphs will run for one size, and why: flags, the tune profile, or the default."""

    plan: object  # anima_ui.runtime.Plan
    source: str
    notes: list = field(default_factory=list)
    decoder: str | None = None  # the profile's faster correct final decoder at this size
    ffn: str = "fp16"  # open_runtime's ffn: "fp16", "w8a8-lowrank", or "auto" (tune found the installed ones faster)

    def describe(self) -> str:
        return "runtime: " + self.summary()

    def summary(self) -> str:
        ffn = {"auto": "; quantized FFNs (the tune profile's)", "w8a8-lowrank": "; quantized FFNs (--ffn)"}.get(self.ffn, "")
        return f"{self.plan.describe()} ({self.source}){ffn}" + "".join(f"; {note}" for note in self.notes)


class Pipeline:
    """The loaded model: DiT host weights, the branch runtime choice, the VAE path, and the contexts of the
    last few prompts. The text encoder is opened only to encode a prompt that is not among them."""

    def __init__(self, paths, config, weights, backend: str, runtime_options: dict, decoder: str | None = None):
        self.paths = paths
        self.config = config
        self.weights = weights
        self._contexts: OrderedDict[str, np.ndarray] = OrderedDict()
        self.backend = backend
        self.runtime_options = runtime_options
        self.decoder = decoder
        self.runtime = None  # the branch runtime of the running generation (the UI's status panel reads it)
        self.choice = None  # how its graphs run and why (RuntimeChoice; the status panel shows it)

    @classmethod
    def load(cls, models_dir, backend: str = "torch", decoder: str | None = None, **runtime_options) -> "Pipeline":
        """decoder: "sdcpp" (stable-diffusion.cpp's tiled VAE, falling back to the onnx decoder with a warning),
        "onnx" (the decoder graphs on onnxruntime) or "npu" (the decoder graphs on the backend's runtime); None:
        the tune profile's choice at the generation's size, else sdcpp. runtime_options: see RUNTIME_OPTIONS."""
        if backend not in BACKENDS:
            raise UserError(f"unknown backend {backend!r}: choose one of {', '.join(BACKENDS)}")
        unknown = set(runtime_options) - set(RUNTIME_OPTIONS)
        if unknown:
            raise TypeError(f"unknown runtime options {sorted(unknown)}")
        if decoder is not None and decoder not in DECODERS:
            raise UserError(f"unknown VAE decoder {decoder!r}: choose one of {', '.join(DECODERS)}")
        paths = ModelPaths.find(models_dir)
        # Graph backends hold the branch weights in their graphs: the host keeps only its own tensors (0.4 GB of
        # bf16 at full size instead of 8.4 GB of float32), which is what fits next to the NPU on an 8 GB board.
        # No backend keeps the LLM adapter's: the text encoder reads them from the file while it runs.
        if backend == "torch":
            config, state = load_dit(paths.dit, keep=lambda key: not key.startswith(ADAPTER_PREFIX))
        else:
            config, state = load_host_weights(paths.dit)
        open_networks(paths)  # a broken text encoder file fails here, not at the first prompt
        return cls(paths, config, state, backend, runtime_options, decoder)

    # -- one generation ---------------------------------------------------------------------------------------------
    def generate(self, request: GenerationRequest, cancel: threading.Event | None = None) -> Iterator[Event]:
        cancel = cancel or threading.Event()
        started = time.perf_counter()
        seconds = {}

        choice = self.choice = self.runtime_choice(request.width, request.height)
        graphs = {} if choice is None else {batch: graphs_dir(self.paths, self.backend, request.width, request.height, batch)
                                            for batch in sorted(choice.plan.graph_batches())}
        missing = {batch: folder for batch, folder in graphs.items() if not graphs_ready(folder)}
        if missing:
            yield PhaseEvent("export")
            t0 = time.perf_counter()
            for batch, folder in missing.items():
                export_model_graphs(self.paths, request.width, request.height, folder, batch=batch)
            seconds["export"] = time.perf_counter() - t0
            _check(cancel)

        yield PhaseEvent("text")
        t0 = time.perf_counter()
        kv, rope = self._conditioning(request, cancel)
        seconds["text"] = time.perf_counter() - t0
        _check(cancel)

        yield PhaseEvent("denoise")
        t0 = time.perf_counter()
        latent, steps, ffn = yield from self._denoise(request, kv, rope, graphs, choice, cancel)
        seconds["denoise"] = time.perf_counter() - t0

        image, decoder, warning = None, None, None
        if request.decode:
            _check(cancel)
            yield PhaseEvent("decode")
            t0 = time.perf_counter()
            image, decoder, warning = self._decode(latent, choice, cancel)
            seconds["decode"] = time.perf_counter() - t0
        seconds["total"] = time.perf_counter() - started

        model_evals = sum(step["computed"] for step in steps)
        summary = {
            "width": request.width,
            "height": request.height,
            "steps": request.steps,
            "cfg": request.cfg,
            "seed": request.seed,
            "spectrum": request.spectrum,
            "backend": self.backend,
            "runtime": choice.describe() if choice else None,
            "ffn": ffn,
            "model_evals": model_evals,
            "transformer_passes": (2 if request.uses_uncond else 1) * model_evals,
            "decoder": decoder,
            "decoder_layout": self.npu_options(request.width, request.height)["layout"] if decoder == "npu" else None,
            "warning": warning,
            "seconds": {k: round(v, 3) for k, v in seconds.items()},
            "per_step": steps,
        }
        yield ResultEvent(image=image, latent=latent, summary=summary)

    def x0_predictor(self, request: GenerationRequest):
        """predict_x0(x, σ) of this request's prompts and CFG on the torch backend, for studies that run their own
        sampler (`anima-ui bench spectrum`)."""
        if self.backend != "torch":
            raise UserError(f"x0_predictor runs the torch backend only, this pipeline is {self.backend}")
        kv, rope = self._conditioning(request)
        return self._x0_predictor(request, kv, rope, self.open_runtime({}, None, threading.Event()))

    def contexts(self, prompts: list[str], cancel: threading.Event | None = None) -> list[np.ndarray]:
        """Read-only contexts [1, 512, C], from the cache when the prompt was encoded recently; a text encoder
        is opened for the others and dropped once they are encoded."""
        missing = [p for p in dict.fromkeys(prompts) if p not in self._contexts]
        if missing:
            for prompt, context in zip(missing, TextEncoder.load(self.paths).encode(missing, cancel)):
                context.flags.writeable = False
                self._contexts[prompt] = context
        for prompt in prompts:
            self._contexts.move_to_end(prompt)
        contexts = [self._contexts[p] for p in prompts]
        while len(self._contexts) > CACHED_CONTEXTS:
            self._contexts.popitem(last=False)
        return contexts

    def _conditioning(self, request, cancel: threading.Event | None = None):
        contexts = self.contexts([request.prompt, request.negative] if request.uses_uncond else [request.prompt],
                                 cancel)
        kv = prepare_kv(self.weights, np.concatenate(contexts, axis=0))
        rope = prepare_rope(self.config, request.height // 8, request.width // 8)
        return kv, rope

    def _x0_predictor(self, request, kv, rope, runtime):
        """The sampler's CFG over the runtime's forward (cond and uncond in one batch of 2 unless CFG is 1)."""
        return cfg_x0_predictor(lambda xs, sigmas: runtime.forward(self.weights, xs, sigmas, kv, rope), request.cfg)

    def open_runtime(self, graphs: dict[int, Path], choice: RuntimeChoice | None, cancel: threading.Event):
        """The branch runtime of one generation (its forward runs the DiT), closed when the generation ends."""
        if self.backend == "torch":
            from anima_ui.runtime.torch_runtime import TorchRuntime  # torch: see the note at the top

            return TorchRuntime(self.weights, self.config, cancel)
        options = {k: v for k, v in self.runtime_options.items() if k in OPEN_OPTIONS}
        return open_runtime(self.backend, graphs, choice.plan, cancel=cancel, **{**options, "ffn": choice.ffn})

    def runtime_choice(self, width: int, height: int) -> RuntimeChoice | None:
        """The plan the branch graphs run with at width x height (None for the torch backend): the variants the
        flags chose, else the tune profile's (`anima-ui tune` writes it into the graphs folder), else prefetch."""
        if self.backend == "torch":
            return None
        options = self.runtime_options
        plan_options = {"core_mask": options.get("core_mask", "auto"), "wait_for_inference": options.get("wait_for_inference", False)}
        if options.get("contexts") is not None:
            plan_options["contexts"] = options["contexts"]
        folder = self.paths.rknn_dir if self.backend == "rknn" else self.paths.exported_dir
        profile, notes = None, []
        if options.get("use_profile", True):
            profile = read_profile(folder(width, height))
            if profile is not None and profile.backend != self.backend:
                notes.append(f"the tune profile {profile.path} was measured on the {profile.backend} backend, not used")
                profile = None
        ffn, ffn_notes = self._ffn_choice(profile, folder(width, height))
        if options.get("variants"):
            if profile is not None:
                notes.append(f"the tune profile {profile.path} is not used: the flags chose the variants")
            return RuntimeChoice(Plan(dict(options["variants"]), **plan_options), "chosen by flags", notes + ffn_notes, ffn=ffn)
        if profile is not None:
            # onnx and sim export a missing graph set in the export phase; the board needs it converted beforehand
            present = {1, 2} if self.backend != "rknn" else {b for b in (1, 2) if graphs_ready(folder(width, height, b))}
            plan, missing = profile.plan(present, **plan_options)
            return RuntimeChoice(plan, f"from the tune profile {profile.path}, {profile.created}", notes + missing + ffn_notes,
                                 profile.decoder, ffn)
        return RuntimeChoice(Plan.uniform("prefetch", **plan_options), "the default; `anima-ui tune` measures the fastest",
                             notes + ffn_notes, ffn=ffn)

    def _ffn_choice(self, profile, folder) -> tuple[str, list[str]]:
        """Which FFNs run: --ffn fp16 or w8a8-lowrank as given; under auto the quantized ones (where installed)
        only when the tune profile timed them faster than FP16 and they passed its checks, else FP16."""
        asked = self.runtime_options.get("ffn", "auto")
        if asked != "auto":
            return asked, []
        verdict = profile.ffn if profile is not None else None
        if verdict == "w8a8-lowrank":
            return "auto", []
        installed = graphs_ready(folder) and quantized_blocks(Manifest.read(folder))
        if not installed:
            return "fp16", []
        if verdict == "fp16":
            why = profile.data["ffn"]["measured"]["w8a8-lowrank"].get("dropped") or "slower than FP16 there"
            return "fp16", [f"FP16 FFNs: the tune profile found the installed quantized ones {why}"]
        return "fp16", ["FP16 FFNs: quantized ones are installed but `anima-ui tune` has not timed them against FP16 "
                        "(run it, or pass --ffn w8a8-lowrank)"]

    def _denoise(self, request, kv, rope, graphs, choice, cancel):
        """Generator: yields StepEvents, returns (final latent, the steps' records, which FFNs ran)."""
        sigmas = simple_sigmas(request.steps)
        x = initial_noise(request.seed, request.height, request.width)
        spectrum = Spectrum.from_config(request.steps, request.spectrum_params) if request.spectrum else None
        runtime = self.runtime = self.open_runtime(graphs, choice, cancel)
        predict_x0 = self._x0_predictor(request, kv, rope, runtime)

        records = []
        try:
            t_step, before = time.perf_counter(), runtime.timings
            for info in euler_steps(predict_x0, x, sigmas, spectrum):
                _check(cancel)
                after = runtime.timings
                step = StepEvent(info, time.perf_counter() - t_step, _step_timings(before, after) if info.computed else {})
                records.append(step.record())
                yield step
                x = info.x
                t_step, before = time.perf_counter(), after
        finally:
            runtime.close()
        if not np.all(np.isfinite(x)):
            raise UserError("the denoised latent contains NaN or Inf; nothing was saved (try another seed or fewer steps)")
        return x, records, runtime.ffn

    def npu_options(self, width: int, height: int) -> dict:
        """The NPU decoder's options: the branches' runtime (onnxruntime when the branches run in torch) and the
        layout its graphs folder for this size runs (model_layout)."""
        backend = "onnx" if self.backend == "torch" else self.backend
        return {"backend": backend, "layout": model_layout(self.paths.vae, backend, width, height),
                **{k: self.runtime_options[k] for k in ("time_scale", "core_mask") if k in self.runtime_options}}

    def _decode(self, latent, choice: RuntimeChoice | None, cancel):
        """The flag's decoder, else the tune profile's faster correct one at this size, else sd.cpp."""
        prefer = self.decoder or (choice and choice.decoder) or "sdcpp"
        _, _, h, w = np.shape(latent)
        npu = self.npu_options(w * SCALE, h * SCALE)
        return decode_latent(latent, self.paths.vae, prefer=prefer, npu=npu, cancel=cancel)


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
