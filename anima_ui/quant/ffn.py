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
from [−189, 51] to [−12, 14]). All weights are in [in, out] layout (x @ W).

A residual GEMM whose K (its input width) is above MAX_INT8_K is split along K into pieces, each an INT8 Conv of
its own slice of the input with its own input and output quantizers, whose FP16 outputs are added in FP16:
rknn-toolkit2 2.5.0 would otherwise tile K itself into INT8 Convs chained by INT8 ConvAdds that round the
partial sums to int8 between tiles (at full size, layer 2's K = 8192 in three tiles: 2.5 % FFN error on the
simulator instead of the emulated 1.8 %). The pieces cost the same Conv cycles as the whole."""

from dataclasses import asdict, dataclass, field

import numpy as np
from threadpoolctl import threadpool_limits

from anima_ui.quant.numerics import Quantizer, f16, fp16_matmul, gelu, int8_matmul, quantize_weight

ALPHAS = (0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
# Activation ranges are min/max shrunk by the factor that gives the smallest layer output error.
RANGE_SHRINKS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3)
SMOOTH_LIMITS = (1e-3, 1e3)  # keeps x/λ and λ·W well inside FP16
SEARCH_TOKENS = 2048  # calibration tokens each α is scored on
RANGE_TOKENS = 512  # of those, the tokens each range candidate is screened on
RANGE_FINALISTS = 2  # the candidates with the smallest error there, scored again on all SEARCH_TOKENS
ALL_TOKENS = slice(None)
# The largest K the compiler keeps in one INT8 Conv. Measured with rknn-toolkit2 2.5.0 for RK3588 on residual
# GEMMs with 2048 outputs, at 1024 and 4096 tokens: K = 1024, 2048, 2560 and 3072 compile as one Conv, K = 3584
# and 4096 as two tiles (and K = 8192 as three).
MAX_INT8_K = 3072
PIECE_ALIGN = 32  # piece widths are multiples of this (whole channel groups of the NPU's layouts)


def k_pieces(k: int, max_k: int | None = MAX_INT8_K) -> tuple[int, ...]:
    """Widths of the pieces a residual GEMM with input width k is split into (one piece when k <= max_k; None:
    never split): as few as fit, as equal as whole PIECE_ALIGN groups allow (the last takes any remainder)."""
    if max_k is None or k <= max_k:
        return (k,)
    if max_k < PIECE_ALIGN:
        raise ValueError(f"pieces of at most {max_k} channels: at least {PIECE_ALIGN} needed")
    groups = -(-k // PIECE_ALIGN)
    count = -(-groups // (max_k // PIECE_ALIGN))
    widths = [PIECE_ALIGN * (groups // count + (i < groups % count)) for i in range(count)]
    widths[-1] -= groups * PIECE_ALIGN - k
    return tuple(widths)


def range_names(layer: int, pieces: tuple[int, ...]) -> tuple[list[str], list[str]]:
    """(input, output) quantizer names of one layer's residual pieces; they are also the graph's tensor names
    (the toolkit's configuration lists tensors by these prefixes). One piece: `h`/`mid` and `res1`/`res2`."""
    base = ("h", "mid")[layer - 1]
    if len(pieces) == 1:
        return [base], [f"res{layer}"]
    return [f"{base}{i}" for i in range(len(pieces))], [f"res{layer}_{i}" for i in range(len(pieces))]


def piece_slices(pieces: tuple[int, ...]) -> list[slice]:
    ends = np.cumsum((0, *pieces))
    return [slice(int(a), int(b)) for a, b in zip(ends[:-1], ends[1:])]


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
    ranges: dict = field(default_factory=dict)  # tensor name (range_names) -> (min, max) of its int8 quantizer
    pieces1: tuple = ()  # K widths of layer 1's residual pieces (k_pieces; default: one)
    pieces2: tuple = ()

    def __post_init__(self):
        self.pieces1 = tuple(int(k) for k in self.pieces1) or (self.r1.shape[0],)
        self.pieces2 = tuple(int(k) for k in self.pieces2) or (self.r2.shape[0],)

    def quantizer(self, name: str) -> Quantizer:
        return Quantizer.from_range(*self.ranges[name])

    def save(self, path) -> None:
        arrays = {k: v for k, v in asdict(self).items() if isinstance(v, np.ndarray)}
        meta = np.array([self.rank, self.alpha1, self.alpha2], np.float64)
        names = list(self.ranges)
        np.savez(path, meta=meta, range_names=np.array(names), ranges=np.array([self.ranges[n] for n in names], np.float64),
                 pieces1=np.array(self.pieces1), pieces2=np.array(self.pieces2), **arrays)

    @classmethod
    def load(cls, path) -> "QuantizedFfn":
        with np.load(path) as data:
            rank, alpha1, alpha2 = data["meta"]
            arrays = {k: data[k] for k in data.files if k not in ("meta", "range_names", "ranges", "pieces1", "pieces2")}
            ranges = {str(name): tuple(float(v) for v in row) for name, row in zip(data["range_names"], data["ranges"])}
            pieces = {k: tuple(int(v) for v in data[k]) for k in ("pieces1", "pieces2")}
        return cls(rank=int(rank), alpha1=float(alpha1), alpha2=float(alpha2), ranges=ranges, **pieces, **arrays)


# -- emulation ---------------------------------------------------------------------------------------------------
def add_tree(terms: list, add=lambda a, b: f16(a + b)):
    """A layer's terms (residual pieces, then the low-rank branch) added pairwise, level by level: `add` is one FP16
    Add (default: the emulator's, one FP16 rounding per Add; the graph builder passes one that emits an Add node).
    With the low-rank branch last, no residual piece's INT8 Conv ever feeds an Add together with another Add:
    rknn-toolkit2 2.5.0's hybrid step 1 fails on that pattern at small widths (its constant folding reshapes the
    sum to 1x1x1x1)."""
    while len(terms) > 1:
        pairs = [add(a, b) for a, b in zip(terms[0::2], terms[1::2])]
        terms = pairs + terms[len(pairs) * 2:]
    return terms[0]


def _layer(x16: np.ndarray, pieces: tuple, x_quants: list[Quantizer], residual: np.ndarray, la: np.ndarray,
           lb: np.ndarray, res_quants: list[Quantizer]) -> np.ndarray:
    """One layer on an FP16 tensor: per residual piece the INT8 Conv of the int8 copy of its input slice (output
    requantized, then FP16), and the FP16 low-rank branch, added in FP16 (add_tree; the compiler fuses the
    branch's second Conv with its Add into one ConvAdd, which rounds the Conv's result before adding)."""
    terms = [int8_matmul(x16[:, s], qx, quantize_weight(residual[s]), qr)
             for s, qx, qr in zip(piece_slices(pieces), x_quants, res_quants)]
    if la.shape[1]:
        terms.append(fp16_matmul(fp16_matmul(x16, la), lb))
    return add_tree(terms)


def emulate(q: QuantizedFfn, h: np.ndarray) -> np.ndarray:
    """The graph's output for its input h [..., D] = x/λ1 (the host folds λ1 into the AdaLN modulation)."""
    h = np.asarray(h, np.float32)
    shape = h.shape
    (in1, res1), (in2, res2) = range_names(1, q.pieces1), range_names(2, q.pieces2)
    quantizers = lambda names: [q.quantizer(n) for n in names]
    pre = _layer(f16(h.reshape(-1, shape[-1])), q.pieces1, quantizers(in1), q.r1, q.la1, q.lb1, quantizers(res1))
    mid = f16(f16(gelu(pre)) * f16(q.inv_smooth_mid))
    return _layer(mid, q.pieces2, quantizers(in2), q.r2, q.la2, q.lb2, quantizers(res2)).reshape(shape)


# -- the transform ----------------------------------------------------------------------------------------------
def smoothing(amax_activation: np.ndarray, weight: np.ndarray, alpha: float) -> np.ndarray:
    """λ per input channel of weight [in, out]."""
    a = np.maximum(np.asarray(amax_activation, np.float64), 1e-5)
    w = np.maximum(np.abs(weight).max(axis=1).astype(np.float64), 1e-5)
    return np.clip(a**alpha / w ** (1.0 - alpha), *SMOOTH_LIMITS).astype(np.float32)


def _orthonormal(a: np.ndarray) -> np.ndarray:
    """An orthonormal basis of a's columns [rows, k] by CholeskyQR2 (two Cholesky passes on the k×k Gram matrix):
    matrix products and a tiny factorization (LAPACK's QR of a tall thin matrix took 30 times longer)."""
    for _ in range(2):
        a = np.linalg.solve(np.linalg.cholesky(a.T @ a), a.T).T
    return a


def low_rank(weight: np.ndarray, rank: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(La, Lb) with La·Lb ≈ weight, rank r: a randomized SVD (4 power iterations), U√S and √S·Vᵀ.
    An exact SVD of a 2048×8192 matrix takes tens of seconds per α candidate; the top 64 directions do not need it."""
    rows, cols = weight.shape
    if rank == 0:
        return np.zeros((rows, 0), np.float32), np.zeros((0, cols), np.float32)
    # Many small BLAS calls: OpenBLAS's threads made each one 0.1-0.5 s on a busy 2-core machine (4.3 s for a
    # 2048×8192 matrix, 0.8 s on one thread).
    with threadpool_limits(1, user_api="blas"):
        return _randomized_svd(weight.astype(np.float64), rank, seed)


def _randomized_svd(w: np.ndarray, rank: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rows, cols = w.shape
    rng = np.random.default_rng(seed)
    basis = _orthonormal(w @ rng.standard_normal((cols, min(rank + 16, rows, cols))))
    for _ in range(4):
        basis = _orthonormal(w @ _orthonormal(w.T @ basis))
    m = basis.T @ w  # [k, cols]: its SVD through the k×k Gram matrix (the top r singular values are far from 0)
    s2, u = np.linalg.eigh(m @ m.T)
    top = np.argsort(s2)[::-1][:rank]
    s, u = np.sqrt(s2[top]), u[:, top]
    root = np.sqrt(s)
    return ((basis @ u) * root).astype(np.float32), ((u.T @ m) / (s / root)[:, None]).astype(np.float32)


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / (np.linalg.norm(b) + 1e-30))


def _rows(a, rows):
    return a[rows] if isinstance(a, np.ndarray) else a


def _best_range(bounds: np.ndarray, loss, scored) -> tuple[float, float]:
    """Among bounds' min/max shrunk by RANGE_SHRINKS, the range whose quantizer gives the smallest loss(rows)(quantizer)
    over all tokens: every candidate is scored on the tokens `scored`, the RANGE_FINALISTS best again on all."""
    low, high = float(bounds.min()), float(bounds.max())
    candidates = [(low * s, high * s) for s in RANGE_SHRINKS]
    if scored is not ALL_TOKENS:
        screen = loss(scored)
        candidates = sorted(candidates, key=lambda r: screen(Quantizer.from_range(*r)))[:RANGE_FINALISTS]
    final = loss(ALL_TOKENS)
    return min(candidates, key=lambda r: final(Quantizer.from_range(*r)))


@dataclass
class _Transform:
    """One linear layer at one α: λ, and λ·W as low-rank branch plus residual."""

    alpha: float
    smooth: np.ndarray
    residual: np.ndarray
    la: np.ndarray
    lb: np.ndarray


def _transform(weight: np.ndarray, amax: np.ndarray, alpha: float, rank: int) -> _Transform:
    smooth = smoothing(amax, weight, alpha)
    scaled = smooth[:, None] * weight
    la, lb = low_rank(scaled, rank)
    return _Transform(alpha, smooth, (scaled - la @ lb).astype(np.float32), la, lb)


@dataclass
class _Fit:
    in_ranges: list
    res_ranges: list
    error: float


def _fit_layer(x: np.ndarray, target: np.ndarray, t: _Transform, pieces: tuple, scored) -> _Fit:
    """The ranges of one transformed layer y = x·W, and the relative error of its emulated output against
    target = x·W over x [tokens, in] (_best_range: candidates screened on the tokens `scored`). Ranges are chosen
    piece by piece, the other pieces as chosen so far (not yet chosen: unquantized), the inputs' first (the residual
    Convs' outputs left in float), then the outputs'."""
    xs = f16(x / t.smooth)
    slices = piece_slices(pieces)
    w_q = [quantize_weight(t.residual[s]) for s in slices]
    low = fp16_matmul(fp16_matmul(xs, t.la), t.lb) if t.la.shape[1] else 0.0
    others = lambda parts, i: sum((p for j, p in enumerate(parts) if j != i), low)
    accs = [xs[:, s] @ w for s, w in zip(slices, w_q)] if len(pieces) > 1 else [0.0]
    in_ranges = []
    for i, (s, w) in enumerate(zip(slices, w_q)):
        rest = others(accs, i)
        loss = lambda rows: lambda qx: _rel(qx(xs[rows, s]) @ w + _rows(rest, rows), target[rows])
        in_ranges.append(_best_range(xs[:, s], loss, scored))
        accs[i] = Quantizer.from_range(*in_ranges[i])(xs[:, s]) @ w
    outs, res_ranges = list(accs), []
    for i, acc in enumerate(accs):
        rest = others(outs, i)
        loss = lambda rows: lambda qr: _rel(f16(f16(qr(acc[rows])) + _rows(rest, rows)), target[rows])
        res_ranges.append(_best_range(acc, loss, scored))
        outs[i] = f16(Quantizer.from_range(*res_ranges[i])(acc))
    out = add_tree(outs + [low] if t.la.shape[1] else outs)
    return _Fit(in_ranges, res_ranges, _rel(out, target))


@dataclass
class _LayerSearch:
    """The α search of one layer: fits are kept per α, so a narrower choice of α later costs no new fit."""

    x: np.ndarray
    weight: np.ndarray
    amax: np.ndarray
    rank: int
    pieces: tuple
    scored: object
    fits: dict = field(default_factory=dict)  # α -> _Fit
    kept: _Transform | None = None

    def __post_init__(self):
        self.target = self.x @ self.weight

    def best(self, alphas) -> tuple[_Transform, _Fit]:
        """The α of `alphas` with the smallest output error: its transform and its fit. The transform of the
        best α fitted so far is kept; another is computed again."""
        for alpha in alphas:
            if alpha not in self.fits:
                t = _transform(self.weight, self.amax, alpha, self.rank)
                self.fits[alpha] = _fit_layer(self.x, self.target, t, self.pieces, self.scored)
                if self.kept is None or self.fits[alpha].error < self.fits[self.kept.alpha].error:
                    self.kept = t
        alpha = min(alphas, key=lambda a: self.fits[a].error)
        t = self.kept if self.kept.alpha == alpha else _transform(self.weight, self.amax, alpha, self.rank)
        return t, self.fits[alpha]


class FfnSearch:
    """The transform search of one FFN (w1 [D, F], w2 [F, D]) at one rank, from calibration inputs calib_x
    [tokens, D]. amax_x / amax_hidden: per-channel |max| of the FFN input and of GELU(x·W1) over all calibration
    tokens (default: over calib_x). max_k: residual GEMMs with a larger K are split into pieces (k_pieces; None:
    never). `quantized(alphas1, alphas2)` takes per layer the α of its candidates with the smallest output error;
    asked again with other candidates (the gate's higher α), it fits only the α not fitted yet."""

    def __init__(self, w1: np.ndarray, w2: np.ndarray, calib_x: np.ndarray, rank: int, amax_x: np.ndarray | None = None,
                 amax_hidden: np.ndarray | None = None, seed: int = 0, max_k: int | None = MAX_INT8_K):
        rng = np.random.default_rng(seed)
        x = np.asarray(calib_x, np.float32).reshape(-1, w1.shape[0])
        if len(x) > SEARCH_TOKENS:
            x = x[rng.choice(len(x), SEARCH_TOKENS, replace=False)]
        scored = np.sort(rng.choice(len(x), RANGE_TOKENS, replace=False)) if len(x) > RANGE_TOKENS else ALL_TOKENS
        hidden = gelu(x @ w1)
        amax_x = np.abs(x).max(axis=0) if amax_x is None else amax_x
        amax_hidden = np.abs(hidden).max(axis=0) if amax_hidden is None else amax_hidden
        self.rank = rank
        self.layers = (_LayerSearch(x, w1, amax_x, rank, k_pieces(w1.shape[0], max_k), scored),
                       _LayerSearch(hidden, w2, amax_hidden, rank, k_pieces(w2.shape[0], max_k), scored))

    def quantized(self, alphas1=ALPHAS, alphas2=ALPHAS) -> QuantizedFfn:
        (t1, f1), (t2, f2) = self.layers[0].best(alphas1), self.layers[1].best(alphas2)
        pieces1, pieces2 = self.layers[0].pieces, self.layers[1].pieces
        names = [*range_names(1, pieces1), *range_names(2, pieces2)]
        values = [f1.in_ranges, f1.res_ranges, f2.in_ranges, f2.res_ranges]
        return QuantizedFfn(
            rank=self.rank, alpha1=t1.alpha, alpha2=t2.alpha, smooth_in=t1.smooth, r1=t1.residual, la1=t1.la, lb1=t1.lb,
            inv_smooth_mid=(1.0 / t2.smooth).astype(np.float32), r2=t2.residual, la2=t2.la, lb2=t2.lb,
            ranges={n: r for ns, rs in zip(names, values) for n, r in zip(ns, rs)}, pieces1=pieces1, pieces2=pieces2,
        )


def quantize_ffn(w1: np.ndarray, w2: np.ndarray, calib_x: np.ndarray, rank: int, amax_x: np.ndarray | None = None,
                 amax_hidden: np.ndarray | None = None, alphas1=ALPHAS, alphas2=ALPHAS, seed: int = 0,
                 max_k: int | None = MAX_INT8_K) -> QuantizedFfn:
    """FfnSearch(...).quantized(alphas1, alphas2): one search, one answer."""
    return FfnSearch(w1, w2, calib_x, rank, amax_x, amax_hidden, seed, max_k).quantized(alphas1, alphas2)


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
