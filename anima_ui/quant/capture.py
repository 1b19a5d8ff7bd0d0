"""Calibration capture: the FFN inputs (after AdaLN) of every block, recorded from real generations.

A recorder wraps any `run_branch` (torch, onnx, sim or rknn graphs) around the unchanged `dit_forward`, so
no fp32 DiT has to be in memory. For each prompt it samples the whole schedule (cond with the prompt,
uncond with the negative prompt, CFG) and, at the chosen steps, records per block and per batch item:
- a random subset of the tokens' FFN inputs, as FP16 (the FFN is token-wise, so a token is a sample);
- the FFN's gate and the residual stream's norm after the block at those tokens, to measure later how much
  a quantized FFN's error moves the residual stream;
- per-channel |max| of the input and of GELU(x·W1) over all tokens (W1 is read from the checkpoint one block
  at a time).
Prompts are split: the calibration set fits the quantized FFNs, the held-out set (other prompts) gates them.

Folder (`<models>/calibration/<W>x<H>/`): calibration.json, and block<i>.npz with per split s ("calib",
"heldout"): s_x [T, D] fp16, s_capture [T] (index into s_gate), s_gate [C, D], s_residual_norm [T],
s_amax_x [D], s_amax_hidden [F]."""

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from anima_ui.errors import UserError
from anima_ui.files import write_folder_atomically
from anima_ui.model import host
from anima_ui.model.checkpoint import load_dit
from anima_ui.model.forward import prepare_kv, prepare_rope
from anima_ui.quant.numerics import gelu
from anima_ui.quant.sampling import cfg_sample
from anima_ui.sampling.noise import initial_noise
from anima_ui.sampling.schedule import simple_sigmas

SPLITS = ("calib", "heldout")
CALIBRATION_JSON = "calibration.json"
# Varied subjects, styles and compositions; the empty prompt is the one most uncond passes see.
CALIB_PROMPTS = (
    "",
    "1girl, solo, long silver hair, red eyes, school uniform, cherry blossoms, smiling, masterpiece, best quality",
    "a lighthouse on a rocky coast at dusk, crashing waves, dramatic clouds, painterly",
    "2boys, samurai duel in a bamboo forest, rain, dynamic angle, motion blur",
    "close-up portrait of an old fisherman, wrinkles, golden hour, detailed skin, photorealistic",
    "chibi cat wizard casting a spell, pastel colors, simple background, flat shading",
    "futuristic city street at night, neon signs, reflections on wet asphalt, crowd, cyberpunk",
    "still life of fruit and a glass vase on a wooden table, oil painting, soft light",
)
HELDOUT_PROMPTS = (
    "1girl, knight in silver armor holding a sword, castle courtyard, banners, sunny day",
    "a small red fox sleeping in the snow under pine trees, watercolor",
    "interior of a cozy library with tall bookshelves, warm lamp light, rainy window",
    "mecha robot standing in a desert, dust storm, low angle, highly detailed",
)
SEED_BASE = 20260812  # the blog's seed; prompt k uses SEED_BASE + k


@dataclass
class CaptureSettings:
    width: int = 512
    height: int = 512
    steps: int = 20
    cfg: float = 4.0
    negative: str = ""
    capture_steps: tuple[int, ...] = ()  # 0-based step indices; default: 8 spread over the schedule, first and last included
    tokens_per_capture: int = 64
    calib_prompts: tuple[str, ...] = CALIB_PROMPTS
    heldout_prompts: tuple[str, ...] = HELDOUT_PROMPTS
    seed: int = SEED_BASE
    extra: dict = field(default_factory=dict)

    def steps_to_capture(self) -> tuple[int, ...]:
        if self.capture_steps:
            return tuple(sorted(set(self.capture_steps)))
        return tuple(int(s) for s in np.unique(np.round(np.linspace(0, self.steps - 1, min(8, self.steps)))))


class _Split:
    """What one split accumulates for one block."""

    def __init__(self):
        self.x, self.capture, self.residual_norm, self.gates = [], [], [], []
        self.amax_x = self.amax_hidden = None

    def arrays(self, prefix: str) -> dict:
        if not self.x:
            raise UserError(f"no {prefix} captures were recorded: give at least one prompt for each split")
        return {
            f"{prefix}_x": np.concatenate(self.x).astype(np.float16),
            f"{prefix}_capture": np.concatenate(self.capture).astype(np.int32),
            f"{prefix}_gate": np.stack(self.gates).astype(np.float32),
            f"{prefix}_residual_norm": np.concatenate(self.residual_norm).astype(np.float32),
            f"{prefix}_amax_x": self.amax_x.astype(np.float32),
            f"{prefix}_amax_hidden": self.amax_hidden.astype(np.float32),
        }


class FfnRecorder:
    """`run_branch` for dit_forward that passes every call through and records the FFN inputs while `active`
    (a split name); `on_block` (dit_forward's hook) completes each block's record with the residual norms."""

    def __init__(self, run_branch, weights: dict, layer1, num_blocks: int, tokens: int, seed: int):
        self.run_branch = run_branch
        self.weights = weights
        self.layer1 = layer1  # block -> W1 [F, D] float32
        self.tokens = tokens
        self.rng = np.random.default_rng(seed)
        self.blocks = [{s: _Split() for s in SPLITS} for _ in range(num_blocks)]
        self.active = None
        self._token_index = None
        self._gates = None
        self._pending = {}

    def start_forward(self, split: str | None, sigma: np.ndarray, num_tokens: int) -> None:
        """Before a forward: record it into `split` (None: pass through), with a fresh token subset."""
        self.active = split
        if split is None:
            return
        self._token_index = np.sort(self.rng.choice(num_tokens, min(self.tokens, num_tokens), replace=False))
        e, lora = host.t_embedding(self.weights, np.asarray(sigma, np.float32))
        self._gates = [m["mlp"][2] for m in host.block_modulations(self.weights, len(self.blocks), e, lora)]

    def __call__(self, block: int, kind: str, inputs: dict) -> np.ndarray:
        out = self.run_branch(block, kind, inputs)
        if kind == "mlp" and self.active is not None:
            self._record(block, inputs["h"])
        return out

    def _record(self, block: int, h: np.ndarray) -> None:
        split = self.blocks[block][self.active]
        w1 = self.layer1(block)
        for b in range(h.shape[0]):
            amax_x = np.abs(h[b]).max(axis=0)
            amax_hidden = np.abs(gelu(h[b] @ w1.T)).max(axis=0)
            split.amax_x = amax_x if split.amax_x is None else np.maximum(split.amax_x, amax_x)
            split.amax_hidden = amax_hidden if split.amax_hidden is None else np.maximum(split.amax_hidden, amax_hidden)
            split.x.append(h[b, self._token_index].astype(np.float16))
            split.capture.append(np.full(len(self._token_index), len(split.gates), np.int32))
            split.gates.append(self._gates[block][b])
        self._pending[block] = h.shape[0]

    def on_block(self, block: int, residual: np.ndarray) -> None:
        if self.active is None:
            return
        split = self.blocks[block][self.active]
        for b in range(self._pending.pop(block)):
            split.residual_norm.append(np.linalg.norm(residual[b, self._token_index], axis=-1))

    def write(self, folder: Path) -> None:
        for i, splits in enumerate(self.blocks):
            arrays = {k: v for s in SPLITS for k, v in splits[s].arrays(s).items()}
            np.savez(folder / f"block{i:02d}.npz", **arrays)


def checkpoint_layer1(dit_path):
    """block -> its first FFN weight [F, D], read from the checkpoint on demand (one block in memory at a time)."""
    cache = {}

    def layer1(block: int) -> np.ndarray:
        if block not in cache:
            cache.clear()
            key = f"blocks.{block}.mlp.layer1.weight"
            cache[block] = load_dit(dit_path, keep=lambda k: k == key)[1][key]
        return cache[block]

    return layer1


def capture(weights: dict, config, run_branch, encode, layer1, settings: CaptureSettings, out_dir, progress=None) -> Path:
    """Sample every prompt through the whole schedule and write the calibration folder `out_dir` (replaced
    whole at the end). encode(prompt) -> context [1, S, C]; weights: the host tensors (`load_host_weights`)."""
    steps = settings.steps_to_capture()
    if any(not 0 <= s < settings.steps for s in steps):
        raise UserError(f"capture steps {steps} must lie in 0..{settings.steps - 1}")
    if not settings.calib_prompts or not settings.heldout_prompts:
        raise UserError("calibration needs at least one calibration prompt and one held-out prompt")
    recorder = FfnRecorder(run_branch, weights, layer1, config.num_blocks, settings.tokens_per_capture, settings.seed)
    h, w = settings.height // 8, settings.width // 8
    rope = prepare_rope(config, h, w)
    num_tokens = (h // config.patch) * (w // config.patch)
    sigmas = simple_sigmas(settings.steps)
    negative = encode(settings.negative)
    prompts = [("calib", p) for p in settings.calib_prompts] + [("heldout", p) for p in settings.heldout_prompts]
    started = time.perf_counter()
    for k, (split, prompt) in enumerate(prompts):
        kv = prepare_kv(weights, np.concatenate([encode(prompt), negative], axis=0))

        def before_forward(step, sigma, split=split):
            recorder.start_forward(split if step in steps else None, np.full(2, sigma, np.float32), num_tokens)

        noise = initial_noise(settings.seed + k, settings.height, settings.width)
        cfg_sample(weights, recorder, kv, rope, noise, sigmas, settings.cfg, before_forward, recorder.on_block, last_step=max(steps))
        if progress:
            progress(f"prompt {k + 1}/{len(prompts)} ({split}) captured, {time.perf_counter() - started:.0f} s")
    recorder.active = None
    return _write_folder(recorder, settings, steps, sigmas, out_dir)


def _write_folder(recorder: FfnRecorder, settings: CaptureSettings, steps, sigmas, out_dir) -> Path:
    def fill(folder: Path) -> None:
        recorder.write(folder)
        meta = {**asdict(settings), "capture_steps": list(steps), "capture_sigmas": [float(sigmas[s]) for s in steps],
                "num_blocks": len(recorder.blocks)}
        (folder / CALIBRATION_JSON).write_text(json.dumps(meta, indent=1) + "\n")

    write_folder_atomically(out_dir, fill)
    return Path(out_dir)


@dataclass
class BlockCalibration:
    """One block's captures: x [T, D] float32 per split, and what the gate needs."""

    calib_x: np.ndarray
    heldout_x: np.ndarray
    amax_x: np.ndarray  # calibration split only: the held-out prompts stay unseen by the transform
    amax_hidden: np.ndarray
    heldout_gate: np.ndarray  # [T, D]: each held-out token's FFN gate
    heldout_residual_norm: np.ndarray  # [T]


def read_calibration(folder) -> tuple[dict, list[BlockCalibration]]:
    folder = Path(folder)
    meta_path = folder / CALIBRATION_JSON
    if not meta_path.is_file():
        raise UserError(f"no {CALIBRATION_JSON} in {folder}: run `anima-ui calibrate` first")
    meta = json.loads(meta_path.read_text())
    blocks = []
    for i in range(meta["num_blocks"]):
        path = folder / f"block{i:02d}.npz"
        if not path.is_file():
            raise UserError(f"{path} is missing: run `anima-ui calibrate` again")
        with np.load(path) as d:
            blocks.append(BlockCalibration(
                calib_x=d["calib_x"].astype(np.float32), heldout_x=d["heldout_x"].astype(np.float32),
                amax_x=d["calib_amax_x"], amax_hidden=d["calib_amax_hidden"],
                heldout_gate=d["heldout_gate"][d["heldout_capture"]], heldout_residual_norm=d["heldout_residual_norm"],
            ))
    return meta, blocks
