"""dit_forward's contract with a branch runtime, and the adapter's input checks."""

import numpy as np
import pytest

from anima_ui.errors import UserError
from anima_ui.model.adapter import llm_adapter_forward, pad_context
from anima_ui.model.checkpoint import split_adapter
from anima_ui.model.config import BRANCH_INPUTS
from anima_ui.model.forward import dit_forward, prepare_kv, prepare_rope
from anima_ui.model.host import block_weights, cross_attention_kv
from anima_ui.model.reference import TorchBranches, reference_forward


def inputs(cfg, batch=2, h=16, w=24, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, cfg.latent_channels, h, w)).astype(np.float32)
    sigma = np.linspace(0.9, 0.2, batch).astype(np.float32)
    context = rng.standard_normal((batch, cfg.context_len, cfg.context_dim)).astype(np.float32)
    return x, sigma, context


def test_branch_visit_order_and_batch(tiny_cfg, tiny_state):
    x, sigma, context = inputs(tiny_cfg)
    torch_branches = TorchBranches(tiny_state, tiny_cfg)
    visits, blocks_seen = [], []

    def run_branch(block, kind, branch_inputs):
        assert set(branch_inputs) == set(BRANCH_INPUTS[kind])
        assert branch_inputs["h"].shape == (2, 8 * 12, tiny_cfg.width)
        visits.append((block, kind))
        return torch_branches(block, kind, branch_inputs)

    kv = prepare_kv(tiny_state, context)
    rope = prepare_rope(tiny_cfg, 16, 24)
    v = dit_forward(tiny_state, run_branch, x, sigma, kv, rope, on_block=lambda i, X: blocks_seen.append(i))
    assert visits == [(b, k) for b in range(tiny_cfg.num_blocks) for k in ("self_attn", "cross_attn", "mlp")]
    assert blocks_seen == list(range(tiny_cfg.num_blocks))
    assert v.shape == x.shape and v.dtype == np.float32
    np.testing.assert_array_equal(v, reference_forward(tiny_state, x, sigma, context, branches=torch_branches))


def test_batch_rows_are_independent(tiny_cfg, tiny_state):
    """CFG runs cond and uncond as one batch: each row must equal its own batch-1 forward."""
    x, sigma, context = inputs(tiny_cfg)
    both = reference_forward(tiny_state, x, sigma, context)
    for row in range(2):
        alone = reference_forward(tiny_state, x[row:row + 1], sigma[row:row + 1], context[row:row + 1])
        assert np.linalg.norm(both[row] - alone[0]) / np.linalg.norm(alone) < 1e-5


def test_branch_output_dtype_from_an_fp16_runtime_keeps_fp32_residual(tiny_cfg, tiny_state):
    """A float16 accelerator returns float16; the residual stream and the result stay float32."""
    x, sigma, context = inputs(tiny_cfg)
    torch_branches = TorchBranches(tiny_state, tiny_cfg)
    residual_dtypes = []
    v = dit_forward(
        tiny_state,
        lambda b, k, i: torch_branches(b, k, i).astype(np.float16),
        x, sigma, prepare_kv(tiny_state, context), prepare_rope(tiny_cfg, 16, 24),
        on_block=lambda i, X: residual_dtypes.append(X.dtype),
    )
    assert v.dtype == np.float32 and set(residual_dtypes) == {np.dtype(np.float32)}
    reference = reference_forward(tiny_state, x, sigma, context, branches=torch_branches)
    assert np.linalg.norm(v - reference) / np.linalg.norm(reference) < 1e-2


def test_prepare_kv_skips_padding_rows_exactly(tiny_cfg, tiny_state):
    _, _, context = inputs(tiny_cfg)
    context[:, 37:] = 0.0
    context[1, 20:] = 0.0  # rows used by one prompt only are still projected
    for i, (k, v) in enumerate(prepare_kv(tiny_state, context)):
        full_k, full_v = cross_attention_kv(block_weights(tiny_state, i), context)
        assert k.shape == v.shape == (2, tiny_cfg.context_len, tiny_cfg.width)
        np.testing.assert_array_equal(k[:, 37:], 0.0)
        np.testing.assert_allclose(k, full_k, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(v, full_v, rtol=1e-6, atol=1e-6)
    all_zero = prepare_kv(tiny_state, np.zeros_like(context))
    assert all(not k.any() and not v.any() for k, v in all_zero)


def test_torch_branches_reject_unknown_block(tiny_cfg, tiny_state):
    with pytest.raises(IndexError, match="block 2 out of range"):
        TorchBranches(tiny_state, tiny_cfg).module(2, "mlp")


def test_pad_context_pads_with_zeros_and_refuses_longer_prompts():
    x = np.ones((1, 3, 8), np.float32)
    padded = pad_context(x, 5)
    assert padded.shape == (1, 5, 8) and not padded[:, 3:].any() and padded[:, :3].all()
    with pytest.raises(UserError, match="6 T5 tokens long, the limit is 5"):
        pad_context(np.ones((1, 6, 8), np.float32), 5)


def test_adapter_rejects_ids_outside_its_vocabulary(tiny_cfg, tiny_state):
    source = np.zeros((1, 3, tiny_cfg.adapter_source_dim), np.float32)
    with pytest.raises(UserError, match="T5 token id out of range"):
        llm_adapter_forward(split_adapter(tiny_state), source, np.array([[5, tiny_cfg.adapter_vocab]]))
