"""Image agreement measures in NumPy: PSNR and SSIM (the A/B Spectrum comparison, the VAE tests and benchmarks).

SSIM is Wang et al. 2004 as usually implemented (skimage `structural_similarity(gaussian_weights=True,
sigma=1.5, use_sample_covariance=False, data_range=255)`): an 11x11 Gaussian window (sigma 1.5), K1 0.01, K2 0.03,
statistics over the valid region, averaged over RGB channels."""

import numpy as np

K1, K2, DATA_RANGE = 0.01, 0.03, 255.0


def psnr(a: np.ndarray, b: np.ndarray, peak: float = 1.0) -> float:
    """Peak signal-to-noise ratio in dB between two images on the same scale, whose largest value is `peak`
    (255 for uint8 pixels); inf when they are identical."""
    mse = float(np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2))
    return float("inf") if mse == 0.0 else float(10.0 * np.log10(peak * peak / mse))


def gaussian_window(size: int = 11, sigma: float = 1.5) -> np.ndarray:
    x = np.arange(size) - (size - 1) / 2
    g = np.exp(-(x**2) / (2 * sigma**2))
    return g / g.sum()


def _filter_valid(image: np.ndarray, window: np.ndarray) -> np.ndarray:
    """Separable 2-D filter over the rows and columns of an [H, W] array, keeping only fully covered pixels."""
    size = len(window)
    rows = sum(window[i] * image[i : image.shape[0] - size + 1 + i, :] for i in range(size))
    return sum(window[j] * rows[:, j : rows.shape[1] - size + 1 + j] for j in range(size))


def ssim_channel(a: np.ndarray, b: np.ndarray, window: np.ndarray) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    mu_a, mu_b = _filter_valid(a, window), _filter_valid(b, window)
    var_a = _filter_valid(a * a, window) - mu_a**2
    var_b = _filter_valid(b * b, window) - mu_b**2
    cov = _filter_valid(a * b, window) - mu_a * mu_b
    c1, c2 = (K1 * DATA_RANGE) ** 2, (K2 * DATA_RANGE) ** 2
    ssim_map = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / ((mu_a**2 + mu_b**2 + c1) * (var_a + var_b + c2))
    return float(ssim_map.mean())


def ssim(a: np.ndarray, b: np.ndarray) -> float:
    """a, b: uint8 [H, W, 3] (or [H, W]) of the same shape, at least 11 pixels on each side."""
    if a.shape != b.shape:
        raise ValueError(f"SSIM needs images of one shape, got {a.shape} and {b.shape}")
    window = gaussian_window()
    if min(a.shape[:2]) < len(window):
        raise ValueError(f"SSIM needs images of at least {len(window)}x{len(window)} pixels, got {a.shape[:2]}")
    if a.ndim == 2:
        return ssim_channel(a, b, window)
    return float(np.mean([ssim_channel(a[..., c], b[..., c], window) for c in range(a.shape[2])]))
