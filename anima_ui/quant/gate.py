"""The gates a quantized FFN must pass, per block on held-out activations and end to end.

Per block, on the held-out prompts' FFN inputs, against the float32 FFN run by onnxruntime:
- the FFN output's cosine and relative L2 error;
- the error it adds to the residual stream, ‖g ⊙ (y_q − y_fp32)‖ / ‖residual after the block‖ (g: the FFN's
  AdaLN gate at each captured token); the same measure for the FP16 graph is reported beside it. (Their ratio
  alone is no gate: both scale with the FFN's share of the stream, so it is just the ratio of FFN errors.)
A block tries rank 32 with the searched α, then higher α, then rank 64 likewise; if nothing passes it stays FP16.

End to end, the emulated pipeline (attention branches as given, FFNs emulated: quantized where a block
passed, FP16 elsewhere) samples prompts × seeds and is compared with the FP16 pipeline (every FFN FP16) on
the final latent (cosine) and the decoded image (PSNR, SSIM).

The thresholds come from synthetic data (docs/quantized_ffn.md), until a board owner runs the gate on real
weights."""

from dataclasses import dataclass, field

import numpy as np
import onnxruntime

from anima_ui.quant.capture import BlockCalibration
from anima_ui.quant.ffn import ALPHAS, FfnSearch, QuantizedFfn, emulate
from anima_ui.quant.graph import float_ffn_model
from anima_ui.quant.numerics import ffn_fp16

RANKS = (32, 64)
ALPHA_RAISES = (0.1, 0.2)  # after the searched α fails: every candidate at least this much higher
MIN_FFN_COSINE = 0.9998
MAX_FFN_REL_ERROR = 0.02
# One quantized FFN may move the residual stream at most as far as `verify` lets the whole FP16 pipeline move it
# at any block (cosine 0.9999, i.e. a relative error of sqrt(2·1e-4)).
MAX_RESIDUAL_ERROR = float(np.sqrt(2 * (1 - 0.9999)))


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-300))


def rel_error(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / (np.linalg.norm(b) + 1e-300))


def onnx_reference(w1: np.ndarray, w2: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The float32 FFN of tokens x [T, D] through onnxruntime (the exported branch graph's arithmetic)."""
    model = float_ffn_model(w1, w2, (1, *x.shape))
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"h": np.ascontiguousarray(x[None], np.float32)})[0][0]


def measure(y: np.ndarray, reference: np.ndarray, calib: BlockCalibration) -> dict:
    added = calib.heldout_gate * (y - reference)
    residual = float(np.linalg.norm(added) / (np.linalg.norm(calib.heldout_residual_norm) + 1e-300))
    return {"cosine": cosine(y, reference), "rel_error": rel_error(y, reference), "residual_error": residual}


def passes(m: dict) -> bool:
    return m["cosine"] >= MIN_FFN_COSINE and m["rel_error"] <= MAX_FFN_REL_ERROR and m["residual_error"] <= MAX_RESIDUAL_ERROR


@dataclass
class BlockGate:
    block: int
    fp16: dict  # the FP16 graph's own measures
    tries: list[dict] = field(default_factory=list)  # rank, alpha1, alpha2, measures, passed
    chosen: QuantizedFfn | None = None

    @property
    def passed(self) -> bool:
        return self.chosen is not None


def gate_block(block: int, w1: np.ndarray, w2: np.ndarray, calib: BlockCalibration, ranks=RANKS) -> BlockGate:
    """w1 [D, F], w2 [F, D]. Tries each rank with the searched α, then with α raised by ALPHA_RAISES, and keeps
    the first that passes."""
    x = calib.heldout_x
    reference = onnx_reference(w1, w2, x)
    result = BlockGate(block, measure(ffn_fp16(x, w1, w2), reference, calib))
    for rank in ranks:
        search = FfnSearch(w1, w2, calib.calib_x, rank, calib.amax_x, calib.amax_hidden)
        searched = search.quantized()
        candidates = [searched]
        for raise_by in ALPHA_RAISES:  # (the search keeps its fits: these cost no new one)
            higher1 = [a for a in ALPHAS if a >= searched.alpha1 + raise_by - 1e-9]
            higher2 = [a for a in ALPHAS if a >= searched.alpha2 + raise_by - 1e-9]
            if higher1 or higher2:
                candidates.append(lambda h1=higher1 or [searched.alpha1], h2=higher2 or [searched.alpha2]: search.quantized(h1, h2))
        for candidate in candidates:
            q = candidate() if callable(candidate) else candidate
            m = measure(emulate(q, x / q.smooth_in), reference, calib)
            ok = passes(m)
            result.tries.append({"rank": rank, "alpha1": q.alpha1, "alpha2": q.alpha2, **m,
                                 "residual_vs_fp16": m["residual_error"] / max(result.fp16["residual_error"], 1e-300), "passed": ok})
            if ok:
                result.chosen = q
                return result
    return result
