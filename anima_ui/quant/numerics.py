"""The arithmetic of a quantized FFN graph as rknn-toolkit2 2.5.0 compiles it for the RK3588, in NumPy.

What the toolkit's simulator does, measured tensor by tensor with `accuracy_analysis` on a hybrid graph
(docs/quantized_ffn.md has the experiment):
- an int8 activation is asymmetric and per tensor: scale = (max − min)/255 over a range that includes 0,
  zero point = round(−min/scale) − 128, values rounded half to even and clipped to [−128, 127];
- int8 weights are asymmetric per output channel in the same way (not symmetric, as the user guide suggests);
- an INT8 Conv accumulates exactly and requantizes its output to its own int8 tensor, which an exDataConvert
  then turns into FP16;
- an FP16 Conv rounds its inputs and weights to FP16, accumulates in FP32 and rounds its output to FP16; the
  fused ConvAdd rounds the Conv result to FP16 before adding the FP16 addend;
- exGelu is the exact erf GELU of the FP16 input, rounded to FP16.
With these rules the emulated graph equals the simulator's output bit for bit on a 64-wide FFN. At full width
the FP16 Convs tile K in a way not modelled here, which moves the FP16 parts by about 1e-4 relative."""

from dataclasses import dataclass

import numpy as np

INT8_MIN, INT8_MAX = -128, 127
LEVELS = INT8_MAX - INT8_MIN


@dataclass(frozen=True)
class Quantizer:
    """One int8 tensor's affine quantizer: real = (q − zero_point) · scale."""

    scale: float
    zero_point: int

    @classmethod
    def from_range(cls, low: float, high: float) -> "Quantizer":
        low, high = min(float(low), 0.0), max(float(high), 0.0)
        scale = (high - low) / LEVELS or 1e-8
        return cls(scale, int(np.round(-low / scale)) + INT8_MIN)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """x quantized and dequantized (float32)."""
        q = np.clip(np.round(np.asarray(x, np.float32) / np.float32(self.scale)) + self.zero_point, INT8_MIN, INT8_MAX)
        return ((q - self.zero_point) * np.float32(self.scale)).astype(np.float32)


def quantize_weight(w: np.ndarray) -> np.ndarray:
    """w [in, out] with one asymmetric int8 quantizer per output column, dequantized."""
    w = np.asarray(w, np.float32)
    low = np.minimum(w.min(axis=0), 0.0)
    high = np.maximum(w.max(axis=0), 0.0)
    scale = np.where(high > low, (high - low) / LEVELS, 1e-8).astype(np.float32)
    zero_point = np.round(-low / scale) + INT8_MIN
    q = np.clip(np.round(w / scale) + zero_point, INT8_MIN, INT8_MAX)
    return ((q - zero_point) * scale).astype(np.float32)


def f16(x: np.ndarray) -> np.ndarray:
    """Rounded to FP16, kept as float32 so sums stay float32."""
    return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)


def fp16_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return f16(f16(a) @ f16(b))


def erf(x: np.ndarray) -> np.ndarray:
    """Abramowitz & Stegun 7.1.26 (absolute error 1.5e-7, 5e-7 in float32): NumPy has no erf, the board no SciPy."""
    x = np.asarray(x, np.float32)
    t = 1.0 / (1.0 + 0.3275911 * np.abs(x))
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    return (np.sign(x) * (1.0 - poly * np.exp(-x * x))).astype(np.float32)


def gelu(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float32)
    return (0.5 * x * (1.0 + erf(x * np.float32(1 / np.sqrt(2))))).astype(np.float32)


def ffn_fp32(x: np.ndarray, w1: np.ndarray, w2: np.ndarray) -> np.ndarray:
    """The FFN branch in float32: GELU(x·W1)·W2, weights in [in, out] layout."""
    return gelu(np.asarray(x, np.float32) @ w1) @ w2


def ffn_fp16(x: np.ndarray, w1: np.ndarray, w2: np.ndarray) -> np.ndarray:
    """The FP16 FFN graph: FP16 operands, FP32 accumulation, FP16 results."""
    return fp16_matmul(f16(gelu(fp16_matmul(x, w1))), w2)


def int8_matmul(x: np.ndarray, x_quant: Quantizer, w_dequantized: np.ndarray, out_quant: Quantizer) -> np.ndarray:
    """An INT8 Conv: int8 input (x is quantized here) times int8 weights, output requantized to int8, then FP16.
    The NPU's int32 sum is exact; float32 is off by about 1e-7 relative, which moves a requantized value only
    when it lies that close to a rounding boundary, and keeps the emulator as fast as the float FFN."""
    return f16(out_quant(x_quant(x) @ w_dequantized))
