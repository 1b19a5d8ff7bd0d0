"""One full-size (2B) forward on random weights: the real shapes run end to end, and where the time goes.

Slow and memory-hungry (≈8.4 GB of float32 weights): excluded from the default run. Run it alone:
    python -m pytest tests/test_model_fullsize.py -m slow -s
It prints one table (a single run, not a median: the shared machine cannot afford repeats)."""

import time

import numpy as np
import psutil
import pytest

from anima_ui.fixtures.weights import random_dit_state
from anima_ui.model.config import AnimaConfig
from anima_ui.model.forward import dit_forward, prepare_kv, prepare_rope
from anima_ui.model.reference import TorchBranches

NEEDED_BYTES = 11 * 2**30  # weights + block modules' shared views + activations, with headroom


@pytest.mark.slow
def test_full_size_forward_512_cfg_batch():
    if psutil.virtual_memory().available < NEEDED_BYTES:
        pytest.skip("needs about 11 GB of free memory")
    cfg = AnimaConfig.full()
    t0 = time.perf_counter()
    weights = random_dit_state(cfg, seed=0)
    make_seconds = time.perf_counter() - t0

    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 16, 64, 64)).astype(np.float32)  # 512x512 pixels, cond + uncond
    sigma = np.full(2, 0.8, np.float32)
    context = np.zeros((2, cfg.context_len, cfg.context_dim), np.float32)
    context[:, :30] = rng.standard_normal((2, 30, cfg.context_dim))

    t0 = time.perf_counter()
    kv = prepare_kv(weights, context)
    kv_seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    rope = prepare_rope(cfg, 64, 64)
    rope_seconds = time.perf_counter() - t0

    branches = TorchBranches(weights, cfg)
    branch_seconds = {"self_attn": 0.0, "cross_attn": 0.0, "mlp": 0.0}
    blocks_seen = []

    def timed_branch(block, kind, inputs):
        start = time.perf_counter()
        out = branches(block, kind, inputs)
        branch_seconds[kind] += time.perf_counter() - start
        return out

    t0 = time.perf_counter()
    velocity = dit_forward(weights, timed_branch, x, sigma, kv, rope, on_block=lambda i, X: blocks_seen.append(i))
    forward_seconds = time.perf_counter() - t0
    host_seconds = forward_seconds - sum(branch_seconds.values())

    assert velocity.shape == x.shape and np.isfinite(velocity).all()
    assert blocks_seen == list(range(28))

    rows = [
        ("random weights (685 tensors, fp32)", make_seconds),
        ("prepare_kv (once per prompt pair)", kv_seconds),
        ("prepare_rope (once per size)", rope_seconds),
        *((f"branches {kind} x28 (torch fp32)", s) for kind, s in branch_seconds.items()),
        ("host ops (patchify, t-emb, AdaLN, residual, final)", host_seconds),
        ("dit_forward total", forward_seconds),
    ]
    print(f"\nfull-size DiT forward, 512x512, batch 2 (one CFG step), load avg {psutil.getloadavg()[0]:.1f}")
    print(f"{'phase':<52}{'seconds':>10}")
    for name, seconds in rows:
        print(f"{name:<52}{seconds:>10.2f}")
    print(f"{'host share of dit_forward':<52}{100 * host_seconds / forward_seconds:>9.1f}%")
