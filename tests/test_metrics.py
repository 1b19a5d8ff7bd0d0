"""PSNR and SSIM (anima_ui.metrics) against their textbook definitions."""

import numpy as np
import pytest

from anima_ui.metrics import gaussian_window, psnr, ssim


def _ssim_direct(a, b):
    """Textbook SSIM, one window position at a time (no separable filtering), for one channel."""
    w = np.outer(gaussian_window(), gaussian_window())
    a, b = a.astype(np.float64), b.astype(np.float64)
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    values = []
    for i in range(a.shape[0] - 10):
        for j in range(a.shape[1] - 10):
            x, y = a[i:i + 11, j:j + 11], b[i:i + 11, j:j + 11]
            mx, my = (w * x).sum(), (w * y).sum()
            vx, vy = (w * (x - mx) ** 2).sum(), (w * (y - my) ** 2).sum()
            cov = (w * (x - mx) * (y - my)).sum()
            values.append((2 * mx * my + c1) * (2 * cov + c2) / ((mx**2 + my**2 + c1) * (vx + vy + c2)))
    return float(np.mean(values))


def test_ssim_matches_the_textbook_formula():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (24, 30, 3), dtype=np.uint8)
    b = np.clip(a.astype(int) + rng.integers(-40, 40, a.shape), 0, 255).astype(np.uint8)
    expected = np.mean([_ssim_direct(a[..., c], b[..., c]) for c in range(3)])
    assert ssim(a, b) == pytest.approx(expected, abs=1e-9)
    assert ssim(a, a) == pytest.approx(1.0)
    assert ssim(a, 255 - a) < 0.2


def test_psnr():
    a = np.zeros((8, 8, 3), np.uint8)
    b = a.copy()
    b[0, 0, 0] = 255  # mse = 255^2 / 192
    assert psnr(a, b, peak=255.0) == pytest.approx(10 * np.log10(192))
    assert psnr(a / 255.0, b / 255.0) == pytest.approx(10 * np.log10(192))  # the same images on a 0..1 scale
    assert psnr(a, a) == float("inf")
