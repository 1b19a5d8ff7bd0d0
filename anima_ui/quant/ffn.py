"""One block's FFN as a W8A8 + FP16 low-rank graph: the transform from its float weights, and its emulation.

    x̂ = x / λ1                                   (on the host: folded into the AdaLN modulation; FP16 input)
    pre = Q(x̂)·R1 + (x̂·La1)·Lb1                  R1 INT8, the low-rank branch FP16
    mid = GELU(pre) · (1/λ2)                      FP16
    out = Q(mid)·R2 + (mid·La2)·Lb2               R2 INT8, the low-rank branch FP16, output FP16

Q() is the int8 copy the NPU makes for the residual Conv only (an exDataConvert); the low-rank branch reads the
FP16 tensor. (With an int8 graph input, as the toolkit would choose, the branch would read the quantized input:
0.1-0.15 points more FFN error on the synthetic outlier model, for the same cost.)

λ1, λ2 are SmoothQuant scales, λ_j = amax(a_j)^α / amax(W_j)^(1−α) per input channel j, with α searched per
layer by the emulated layer's output error; La·Lb is the best rank-r approximation of the smoothed weight
(SVDQuant) and R = λW − La·Lb is what is left for int8. The low-rank branch takes the outlier directions,
so the int8 residual's output range, which one per-tensor scale must cover, shrinks (on a synthetic DiT FFN
from [−189, 51] to [−12, 14]). All weights are in [in, out] layout (x @ W)."""

from dataclasses import asdict, dataclass, field

import numpy as np

from anima_ui.quant.numerics import Quantizer, f16, fp16_matmul, gelu, int8_matmul, quantize_weight

ALPHAS = (0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
# Activation ranges are min/max shrunk by the factor that gives the smallest layer output error.
RANGE_SHRINKS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3)
SMOOTH_LIMITS = (1e-3, 1e3)  # keeps x/λ and λ·W well inside FP16
SEARCH_TOKENS = 2048  # calibration tokens used to score each α and range candidate
QUANTIZED_TENSORS = ("h", "res1", "mid", "res2")  # the graph's int8 activations, in order


@dataclass
class QuantizedFfn:
    rank: int
    alpha1: float
    alpha2: float
    smooth_in: np.ndarray  # λ1 [D]
    r1: np.ndarray  # [D, F]
    la1: np.ndarray  # [D, r]
    lb1: np.ndarray  # [r, F]
    inv_smooth_mid: np.ndarray  # 1/λ2 [F]
    r2: np.ndarray  # [F, D]
    la2: np.ndarray  # [F, r]
    lb2: np.ndarray  # [r, D]
    ranges: dict = field(default_factory=dict)  # tensor name -> (min, max) of its int8 quantizer

    def quantizer(self, name: str) -> Quantizer:
        return Quantizer.from_range(*self.ranges[name])

    def save(self, path) -> None:
        arrays = {k: v for k, v in asdict(self).items() if isinstance(v, np.ndarray)}
        meta = np.array([self.rank, self.alpha1, self.alpha2], np.float64)
        ranges = np.array([self.ranges[name] for name in QUANTIZED_TENSORS], np.float64)
        np.savez(path, meta=meta, ranges=ranges, **arrays)

    @classmethod
    def load(cls, path) -> "QuantizedFfn":
        with np.load(path) as data:
            rank, alpha1, alpha2 = data["meta"]
            arrays = {k: data[k] for k in data.files if k not in ("meta", "ranges")}
            ranges = {name: tuple(float(v) for v in row) for name, row in zip(QUANTIZED_TENSORS, data["ranges"])}
        return cls(rank=int(rank), alpha1=float(alpha1), alpha2=float(alpha2), ranges=ranges, **arrays)


# -- emulation ---------------------------------------------------------------------------------------------------
def _layer(x16: np.ndarray, x_quant: Quantizer, residual: np.ndarray, la: np.ndarray, lb: np.ndarray,
           res_quant: Quantizer) -> np.ndarray:
    """One layer on an FP16 tensor: the INT8 Conv of its int8 copy (output requantized, then FP16) plus the FP16
    low-rank branch, as one fused ConvAdd."""
    out = int8_matmul(x16, x_quant, quantize_weight(residual), res_quant)
    if la.shape[1]:
        out = f16(fp16_matmul(fp16_matmul(x16, la), lb) + out)
    return out


def emulate(q: QuantizedFfn, h: np.ndarray) -> np.ndarray:
    """The graph's output for its input h [..., D] = x/λ1 (the host folds λ1 into the AdaLN modulation)."""
    h = np.asarray(h, np.float32)
    shape = h.shape
    pre = _layer(f16(h.reshape(-1, shape[-1])), q.quantizer("h"), q.r1, q.la1, q.lb1, q.quantizer("res1"))
    mid = f16(f16(gelu(pre)) * f16(q.inv_smooth_mid))
    return _layer(mid, q.quantizer("mid"), q.r2, q.la2, q.lb2, q.quantizer("res2")).reshape(shape)


# -- the transform ----------------------------------------------------------------------------------------------
def smoothing(amax_activation: np.ndarray, weight: np.ndarray, alpha: float) -> np.ndarray:
    """λ per input channel of weight [in, out]."""
    a = np.maximum(np.asarray(amax_activation, np.float64), 1e-5)
    w = np.maximum(np.abs(weight).max(axis=1).astype(np.float64), 1e-5)
    return np.clip(a**alpha / w ** (1.0 - alpha), *SMOOTH_LIMITS).astype(np.float32)


def low_rank(weight: np.ndarray, rank: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(La, Lb) with La·Lb ≈ weight, rank r: a randomized SVD (4 power iterations), U√S and √S·Vᵀ.
    An exact SVD of a 2048×8192 matrix takes tens of seconds per α candidate; the top 64 directions do not need it."""
    rows, cols = weight.shape
    if rank == 0:
        return np.zeros((rows, 0), np.float32), np.zeros((0, cols), np.float32)
    w = weight.astype(np.float64)
    rng = np.random.default_rng(seed)
    basis = np.linalg.qr(w @ rng.standard_normal((cols, min(rank + 16, rows, cols))))[0]
    for _ in range(4):
        basis = np.linalg.qr(w @ np.linalg.qr(w.T @ basis)[0])[0]
    u, s, vt = np.linalg.svd(basis.T @ w, full_matrices=False)
    u = basis @ u[:, :rank]
    root = np.sqrt(s[:rank])
    return (u * root).astype(np.float32), (root[:, None] * vt[:rank]).astype(np.float32)


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / (np.linalg.norm(b) + 1e-30))


def _best_range(values: np.ndarray, loss) -> tuple[float, float]:
    """Among min/max shrunk by RANGE_SHRINKS, the range whose quantizer gives the smallest loss(quantizer)."""
    low, high = float(values.min()), float(values.max())
    candidates = [(low * s, high * s) for s in RANGE_SHRINKS]
    return min(candidates, key=lambda r: loss(Quantizer.from_range(*r)))


@dataclass
class _Layer:
    smooth: np.ndarray
    residual: np.ndarray
    la: np.ndarray
    lb: np.ndarray
    in_range: tuple
    res_range: tuple
    error: float


def _fit_layer(x: np.ndarray, weight: np.ndarray, amax: np.ndarray, alpha: float, rank: int) -> _Layer:
    """One linear layer y = x·W transformed at one α and scored on x [tokens, in] (float32): the relative error
    of the emulated output against x·W."""
    smooth = smoothing(amax, weight, alpha)
    scaled = smooth[:, None] * weight
    la, lb = low_rank(scaled, rank)
    residual = (scaled - la @ lb).astype(np.float32)
    xs = f16(x / smooth)
    target = x @ weight
    w_q = quantize_weight(residual)
    low = fp16_matmul(fp16_matmul(xs, la), lb) if rank else 0.0
    # the input's range first (the residual Conv's output left in float), then the output's range
    in_range = _best_range(xs, lambda qx: _rel(qx(xs) @ w_q + low, target))
    acc = Quantizer.from_range(*in_range)(xs) @ w_q
    res_range = _best_range(acc, lambda qr: _rel(f16(f16(qr(acc)) + low), target))
    out = f16(f16(Quantizer.from_range(*res_range)(acc)) + low)
    return _Layer(smooth, residual, la, lb, in_range, res_range, _rel(out, target))


def _search(x, weight, amax, rank, alphas) -> tuple[float, _Layer]:
    fits = {alpha: _fit_layer(x, weight, amax, alpha, rank) for alpha in alphas}
    best = min(fits, key=lambda alpha: fits[alpha].error)
    return best, fits[best]


def quantize_ffn(w1: np.ndarray, w2: np.ndarray, calib_x: np.ndarray, rank: int, amax_x: np.ndarray | None = None,
                 amax_hidden: np.ndarray | None = None, alphas1=ALPHAS, alphas2=ALPHAS, seed: int = 0) -> QuantizedFfn:
    """The transform of one FFN (w1 [D, F], w2 [F, D]) from calibration inputs calib_x [tokens, D].
    amax_x / amax_hidden: per-channel |max| of the FFN input and of GELU(x·W1) over all calibration tokens
    (default: over calib_x). Each layer takes the α of its candidates with the smallest output error."""
    x = np.asarray(calib_x, np.float32).reshape(-1, w1.shape[0])
    if len(x) > SEARCH_TOKENS:
        x = x[np.random.default_rng(seed).choice(len(x), SEARCH_TOKENS, replace=False)]
    hidden = gelu(x @ w1)
    amax_x = np.abs(x).max(axis=0) if amax_x is None else amax_x
    amax_hidden = np.abs(hidden).max(axis=0) if amax_hidden is None else amax_hidden
    alpha1, l1 = _search(x, w1, amax_x, rank, alphas1)
    alpha2, l2 = _search(hidden, w2, amax_hidden, rank, alphas2)
    return QuantizedFfn(
        rank=rank, alpha1=alpha1, alpha2=alpha2, smooth_in=l1.smooth, r1=l1.residual, la1=l1.la, lb1=l1.lb,
        inv_smooth_mid=(1.0 / l2.smooth).astype(np.float32), r2=l2.residual, la2=l2.la, lb2=l2.lb,
        ranges={"h": l1.in_range, "res1": l1.res_range, "mid": l2.in_range, "res2": l2.res_range},
    )




def emulate_plain(w1: np.ndarray, w2: np.ndarray, calib_x: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The toolkit's own W8A8 build of the float FFN (what the blog tried, without its FP16 GELU): ranges are
    the calibration min/max (its "normal" algorithm), GELU is fused into the first INT8 Conv, whose output is
    requantized after it, and the output is int8 too."""
    calib_x = np.asarray(calib_x, np.float32).reshape(-1, w1.shape[0])
    w1q, w2q = quantize_weight(w1), quantize_weight(w2)
    hidden = gelu(calib_x @ w1)
    out = hidden @ w2
    q_in = Quantizer.from_range(calib_x.min(), calib_x.max())
    q_hidden = Quantizer.from_range(hidden.min(), hidden.max())
    q_out = Quantizer.from_range(out.min(), out.max())
    return q_out(q_hidden(gelu(q_in(x) @ w1q)) @ w2q)
