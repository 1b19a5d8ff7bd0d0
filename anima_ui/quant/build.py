"""From a calibration folder to gated W8A8 + low-rank FFN graphs: per block the gate, the ONNX graph and (in
.venv-rknn) the hybrid RKNN build with its op-table and simulator checks, then the end-to-end gate.

Output folder (`<models>/quant/<W>x<H>/`, replaced whole at the end):
  report.json                    per-block gate tries, conversion checks, the end-to-end rows and thresholds, `passed`
  block<i>_mlp_w8a8.npz          the transform (λ1 for the host's AdaLN fold, weights, ranges) of each passing block
  block<i>_mlp_w8a8.onnx         its graph (input h = x/λ1, output out, as the FFN branch graph)
  block<i>_mlp_w8a8.rknn         with convert: the hybrid build
  block<i>_mlp_w8a8.check.npz    with convert: simulator inputs and outputs, for the board-vs-simulator check
A block that fails its gate, its conversion checks or whose simulator output disagrees with the emulator
stays FP16 (it is listed in the report with the reason)."""

import json
import time
from functools import partial
from pathlib import Path

import numpy as np

from anima_ui.files import write_folder_atomically
from anima_ui.errors import UserError
from anima_ui.model.checkpoint import load_dit
from anima_ui.modelfiles import ModelPaths
from anima_ui.pipeline import Pipeline
from anima_ui.model.onnx_graph import write_model
from anima_ui.runtime import open_runtime
from anima_ui.runtime.graphs import graphs_ready
from anima_ui.runtime.manifest import sha256_file
from anima_ui.vae.decode import decode_latent
from anima_ui.quant.capture import BlockCalibration, read_calibration
from anima_ui.quant.convert import convert_ffn, hybrid_op_problems
from anima_ui.quant.ffn import QuantizedFfn, emulate
from anima_ui.quant.e2e import PROMPTS, emulators_of
from anima_ui.quant.e2e import end_to_end as run_end_to_end
from anima_ui.quant.graph import quantized_ffn_model
from anima_ui.quant.gate import RANKS, BlockGate, gate_block, onnx_reference, rel_error

# The emulator must reproduce the simulator to within this share of the quantization error itself.
MAX_EMULATOR_GAP = 0.1
CHECK_SAMPLES = 2


def ffn_weights(dit_path, block: int) -> tuple[np.ndarray, np.ndarray]:
    """(w1 [D, F], w2 [F, D]) of one block, read from the checkpoint alone."""
    keys = (f"blocks.{block}.mlp.layer1.weight", f"blocks.{block}.mlp.layer2.weight")
    state = load_dit(dit_path, keep=lambda k: k in keys)[1]
    return np.ascontiguousarray(state[keys[0]].T), np.ascontiguousarray(state[keys[1]].T)


def graph_inputs(x: np.ndarray, q: QuantizedFfn, shape: tuple[int, int, int], count: int, offset: int = 0) -> list[np.ndarray]:
    """`count` graph inputs of `shape` filled with captured tokens (the FFN is token-wise), divided by λ1."""
    tokens = shape[0] * shape[1]
    index = (offset + np.arange(count * tokens)) % len(x)
    return [(x[index[i * tokens:(i + 1) * tokens]] / q.smooth_in).reshape(shape).astype(np.float32) for i in range(count)]


def check_conversion(q: QuantizedFfn, conversion, check_inputs: list[np.ndarray], reference) -> dict:
    """Op table as intended, and the simulator's outputs against the emulator's on the same inputs."""
    gaps, errors = [], []
    for x_hat, simulated in zip(check_inputs, conversion.sim_outputs):
        emulated = emulate(q, x_hat)
        x = x_hat * q.smooth_in
        ref = reference(x.reshape(-1, x.shape[-1])).reshape(x.shape)
        gaps.append(rel_error(emulated, simulated))
        errors.append(rel_error(simulated, ref))
    problems = hybrid_op_problems(conversion.ops)
    if max(gaps) > MAX_EMULATOR_GAP * max(min(errors), 1e-6):
        problems.append(f"the emulator differs from the simulator by {max(gaps):.2e}, more than {MAX_EMULATOR_GAP:.0%} of "
                        f"the quantization error {min(errors):.2e}")
    return {"problems": problems, "emulator_vs_simulator": gaps, "simulator_error": errors, "toolkit": conversion.toolkit,
            "build_seconds": conversion.build_seconds, "cycles": conversion.cycles,
            "rknn_bytes": conversion.rknn_file.stat().st_size}


def build_block(folder: Path, block: int, gate: BlockGate, calib: BlockCalibration, shape, convert: bool, reference) -> dict:
    """Writes the passing block's files into `folder`; returns its report entry (with `quantized`)."""
    entry = {"block": block, "fp16": gate.fp16, "tries": gate.tries, "quantized": gate.passed}
    if not gate.passed:
        entry["reason"] = "no rank/α passed the per-block gate"
        return entry
    q = gate.chosen
    stem = f"block{block:02d}_mlp_w8a8"
    q.save(folder / f"{stem}.npz")
    write_model(quantized_ffn_model(q, shape), folder / f"{stem}.onnx")
    entry.update(rank=q.rank, alpha1=q.alpha1, alpha2=q.alpha2, files=[f"{stem}.npz", f"{stem}.onnx"])
    if convert:
        dataset = graph_inputs(calib.calib_x, q, shape, 4)
        checks = graph_inputs(calib.heldout_x, q, shape, CHECK_SAMPLES)
        conversion = convert_ffn(folder / f"{stem}.onnx", folder / f"{stem}.rknn", "hybrid", dataset, checks, q=q)
        entry["conversion"] = check_conversion(q, conversion, checks, reference)
        np.savez(folder / f"{stem}.check.npz", inputs=np.stack(checks), outputs=np.stack(conversion.sim_outputs))
        entry["files"] += [f"{stem}.rknn", f"{stem}.check.npz"]
        if entry["conversion"]["problems"]:
            entry.update(quantized=False, reason="; ".join(entry["conversion"]["problems"]))
    return entry


def quantize_model(dit_path, blocks: list[BlockCalibration], shape, out_dir, convert: bool = False, ranks=RANKS,
                   end_to_end=None, progress=None) -> dict:
    """Gate and build every block; end_to_end(emulators) -> EndToEnd runs the whole-generation gate over the
    blocks that passed (None: skipped, and the report does not pass). Writes out_dir; returns the report."""
    started = time.perf_counter()
    report = {}

    def fill(temp: Path) -> None:
        entries, chosen = [], {}
        for block, calib in enumerate(blocks):
            w1, w2 = ffn_weights(dit_path, block)
            gate = gate_block(block, w1, w2, calib, ranks)
            entry = build_block(temp, block, gate, calib, shape, convert, partial(onnx_reference, w1, w2))
            entries.append(entry)
            if entry["quantized"]:
                chosen[block] = gate.chosen
            else:
                for name in entry.get("files", []):
                    (temp / name).unlink(missing_ok=True)
                entry["files"] = []
            if progress:
                best = entry["tries"][-1] if entry["tries"] else {}
                progress(f"block {block}: {'quantized' if entry['quantized'] else 'stays FP16'} "
                         f"(rank {best.get('rank')}, FFN rel error {best.get('rel_error', float('nan')):.4f}, "
                         f"{time.perf_counter() - started:.0f} s)")
        report.update(shape=list(shape), converted=convert, checkpoint_sha256=sha256_file(dit_path), blocks=entries,
                      quantized_blocks=sorted(chosen))
        if end_to_end is not None and chosen:
            e2e = end_to_end(emulators_of(chosen))
            report["end_to_end"] = {"rows": e2e.rows, "seed_spread": e2e.seed_spread, "thresholds": e2e.thresholds(),
                                    "failures": e2e.failures(), "passed": e2e.passed}
        report["passed"] = bool(chosen) and report.get("end_to_end", {}).get("passed", False)
        report["seconds"] = round(time.perf_counter() - started, 1)
        (temp / "report.json").write_text(json.dumps(report, indent=1, default=_json_default) + "\n")

    write_folder_atomically(out_dir, fill)
    return report


def _json_default(value):
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def quantize_models_folder(models, width: int, height: int, convert: bool = False, ranks=RANKS, backend: str = "onnx",
                           prompts: int = 4, steps: int = 20, cfg: float = 4.0, end_to_end: bool = True, calibration=None,
                           out=None, progress=None) -> tuple[dict, Path]:
    """`anima-ui quantize-ffn` (and `prepare --ffn w8a8-lowrank`): read MODELS/calibration/WxH, gate and build every
    block, run the end-to-end gate with the attention branches on `backend` ("torch": the fp32 DiT in memory;
    "onnx": the exported fp32 graphs), and write MODELS/quant/WxH. Returns (report, folder)."""
    paths = ModelPaths.find(models)
    size = f"{width}x{height}"
    calibration = Path(calibration) if calibration else paths.root / "calibration" / size
    meta, blocks = read_calibration(calibration)  # before loading anything: a missing calibration fails at once
    if (meta["width"], meta["height"]) != (width, height):
        raise UserError(f"{calibration} was captured at {meta['width']}x{meta['height']}, not {size}: pass --width/--height to match")
    pipeline = Pipeline.load(models, backend=backend, decoder="sdcpp")
    config = pipeline.config
    if len(blocks) != config.num_blocks:
        raise UserError(f"{calibration} has {len(blocks)} blocks, the model {config.num_blocks}: calibrate this model again")
    shape = (1, (height // 16) * (width // 16), config.width)
    out = Path(out) if out else paths.root / "quant" / size

    def e2e(emulators):
        weights = {b: ffn_weights(paths.dit, b) for b in range(config.num_blocks)}
        run_branch, runtime = _attention_branches(pipeline, backend, width, height)
        decode = lambda latent: np.asarray(decode_latent(latent, paths.vae, prefer=pipeline.decoder)[0])
        try:
            return run_end_to_end(pipeline.weights, config, run_branch, lambda prompt: pipeline.contexts([prompt])[0], decode,
                                  weights, emulators, prompts=PROMPTS[:prompts], steps=steps, cfg=cfg, width=width,
                                  height=height, negative=meta["negative"], progress=progress)
        finally:
            if runtime is not None:
                runtime.close()

    report = quantize_model(paths.dit, blocks, shape, out, convert=convert, ranks=ranks,
                            end_to_end=e2e if end_to_end else None, progress=progress)
    return report, out


def _attention_branches(pipeline, backend: str, width: int, height: int):
    """(run_branch, runtime to close or None) for the end-to-end gate's attention branches."""
    if backend == "torch":
        from anima_ui.model.reference import TorchBranches  # torch (optional): only this backend needs it

        return TorchBranches(pipeline.weights, pipeline.config), None
    graphs = pipeline.paths.exported_dir(width, height)
    if not graphs_ready(graphs):
        raise UserError(f"no exported graphs in {graphs}: run `anima-ui export --width {width} --height {height}` first")
    runtime = open_runtime("onnx", graphs, ffn="fp16")
    return runtime, runtime
