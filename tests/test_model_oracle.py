"""The project's DiT and LLM adapter against diffusers (the test-only oracle) on random weights in the
official key layout.

diffusers differs from the reference (ComfyUI) in two places this test bridges explicitly:
- its Cosmos attention builds the per-head q/k RMSNorm with diffusers' default eps 1e-5; ComfyUI's
  predict2.py uses 1e-6, so the oracle's eps is set to 1e-6;
- its `concat_padding_mask` path resizes the mask with torchvision (not installed), so the oracle is built
  with the 17 patch-embed channels as `in_channels` and fed the zero mask channel directly — the same
  arithmetic as concatenating the (all-zero) padding mask."""

import numpy as np
import pytest
import torch
from diffusers import AnimaTextConditioner, CosmosTransformer3DModel
from diffusers.loaders.single_file_utils import convert_cosmos_transformer_checkpoint_to_diffusers

from anima_ui.model.adapter import llm_adapter_forward, pad_context
from anima_ui.fixtures.weights import random_dit_state
from anima_ui.model.checkpoint import split_adapter
from anima_ui.model.config import AnimaConfig
from anima_ui.convert.export import export_graphs
from anima_ui.model.forward import dit_forward, prepare_kv, prepare_rope
from anima_ui.model.reference import TorchBranches, reference_forward
from anima_ui.runtime import Plan, open_runtime

TOLERANCE = 1e-5  # the brief asks < 1e-4; errors are ~4e-7, and a tanh-GELU bug gives 8e-5

_GLOBAL_NAMES = {
    "x_embedder.proj.1.weight": "patch_embed.proj.weight",
    "t_embedder.1.linear_1.weight": "time_embed.t_embedder.linear_1.weight",
    "t_embedder.1.linear_2.weight": "time_embed.t_embedder.linear_2.weight",
    "t_embedding_norm.weight": "time_embed.norm.weight",
    "final_layer.linear.weight": "proj_out.weight",
    "final_layer.adaln_modulation.1.weight": "norm_out.linear_1.weight",
    "final_layer.adaln_modulation.2.weight": "norm_out.linear_2.weight",
}
_BLOCK_NAMES = {
    "mlp.layer1.weight": "ff.net.0.proj.weight",
    "mlp.layer2.weight": "ff.net.2.weight",
    **{
        f"adaln_modulation_{kind}.{j}.weight": f"norm{n}.linear_{j}.weight"
        for n, kind in enumerate(("self_attn", "cross_attn", "mlp"), start=1)
        for j in (1, 2)
    },
    **{
        f"{attn}.{ours}.weight": f"{theirs_attn}.{theirs}.weight"
        for attn, theirs_attn in (("self_attn", "attn1"), ("cross_attn", "attn2"))
        for ours, theirs in (
            ("q_proj", "to_q"), ("k_proj", "to_k"), ("v_proj", "to_v"),
            ("output_proj", "to_out.0"), ("q_norm", "norm_q"), ("k_norm", "norm_k"),
        )
    },
}


def diffusers_name(key: str) -> str:
    """Official DiT key -> CosmosTransformer3DModel parameter name (spec §4.4)."""
    if key in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[key]
    _, index, rest = key.split(".", 2)
    return f"transformer_blocks.{index}.{_BLOCK_NAMES[rest]}"


def diffusers_transformer(cfg: AnimaConfig, state: dict) -> CosmosTransformer3DModel:
    """Cosmos-Predict2-2B's diffusers config (the Anima pipeline's transformer) at cfg's dimensions."""
    model = CosmosTransformer3DModel(
        in_channels=cfg.latent_channels + 1,  # + the padding-mask channel, fed directly (see module docstring)
        out_channels=cfg.latent_channels,
        num_attention_heads=cfg.num_heads,
        attention_head_dim=cfg.head_dim,
        num_layers=cfg.num_blocks,
        mlp_ratio=cfg.mlp_dim / cfg.width,
        text_embed_dim=cfg.context_dim,
        adaln_lora_dim=cfg.adaln_lora_dim,
        max_size=(128, 240, 240),
        patch_size=(1, cfg.patch, cfg.patch),
        rope_scale=(1.0, cfg.rope_hw_extrapolation, cfg.rope_hw_extrapolation),
        concat_padding_mask=False,
        extra_pos_embed_type=None,
    )
    dit = {diffusers_name(k): torch.from_numpy(v) for k, v in state.items() if not k.startswith("llm_adapter.")}
    model.load_state_dict(dit, strict=True)
    for block in model.transformer_blocks:
        for attn in (block.attn1, block.attn2):
            attn.norm_q.eps = attn.norm_k.eps = 1e-6
    return model.eval()


def diffusers_forward(model, x, sigma, context, block_outputs: list | None = None) -> np.ndarray:
    hooks = []
    if block_outputs is not None:
        hooks = [b.register_forward_hook(lambda m, i, out: block_outputs.append(out.numpy().copy())) for b in model.transformer_blocks]
    latent = torch.from_numpy(x)[:, :, None]
    with_mask = torch.cat([latent, torch.zeros_like(latent[:, :1])], dim=1)
    try:
        with torch.inference_mode():
            out = model(
                hidden_states=with_mask,
                timestep=torch.from_numpy(sigma),
                encoder_hidden_states=torch.from_numpy(context),
                return_dict=False,
            )[0]
    finally:
        for hook in hooks:
            hook.remove()
    return out[:, :, 0].numpy()


def relative_error(ours: np.ndarray, oracle: np.ndarray) -> float:
    return float(np.linalg.norm(ours - oracle) / np.linalg.norm(oracle))


def dit_inputs(cfg, h, w, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, cfg.latent_channels, h, w)).astype(np.float32)
    sigma = np.array([0.93, 0.31], np.float32)  # two different timesteps: batch rows must not mix
    context = rng.standard_normal((2, cfg.context_len, cfg.context_dim)).astype(np.float32)
    context[:, 40:] = 0.0  # the zero padding a real prompt context has
    return x, sigma, context


def test_key_mapping_matches_diffusers_converter(tiny_state):
    """Our spec-based name table agrees with diffusers' own single-file converter."""
    dit = {"net." + k: torch.from_numpy(v) for k, v in tiny_state.items() if not k.startswith("llm_adapter.")}
    converted = convert_cosmos_transformer_checkpoint_to_diffusers(dict(dit))
    ours = {diffusers_name(k[len("net."):]) for k in dit}
    assert ours == set(converted)


@pytest.fixture(scope="module")
def tiny_oracle(tiny_cfg, tiny_state):
    return diffusers_transformer(tiny_cfg, tiny_state)


@pytest.mark.parametrize("height,width", [(32, 32), (24, 40)])  # 256x256 and 192x320 pixels
def test_dit_matches_diffusers(tiny_cfg, tiny_state, tiny_oracle, height, width):
    x, sigma, context = dit_inputs(tiny_cfg, height, width)
    ours_blocks, oracle_blocks = [], []
    ours = reference_forward(tiny_state, x, sigma, context, on_block=lambda i, X: ours_blocks.append(X.copy()))
    oracle = diffusers_forward(tiny_oracle, x, sigma, context, oracle_blocks)

    assert ours.shape == oracle.shape == x.shape
    for i, (a, b) in enumerate(zip(ours_blocks, oracle_blocks, strict=True)):
        assert relative_error(a, b) < TOLERANCE, f"block {i}"
    error = relative_error(ours, oracle)
    print(f"\nDiT {height}x{width} latent: relative error {error:.2e}, max abs {np.abs(ours - oracle).max():.2e}")
    assert error < TOLERANCE


def test_dit_through_the_exported_graphs_matches_diffusers(tiny_cfg, tiny_state, tiny_oracle, write_dit_file, tmp_path):
    """The branch graphs `anima-ui export` builds, run by onnxruntime inside the split forward, against diffusers."""
    height, width = 24, 40
    checkpoint = tmp_path / "anima-tiny.safetensors"
    write_dit_file(tiny_state, checkpoint, dtype=torch.float32)  # the exact weights the oracle holds
    export_graphs(checkpoint, width * 8, height * 8, tmp_path / "graphs", batch=2)
    x, sigma, context = dit_inputs(tiny_cfg, height, width)
    ours_blocks, oracle_blocks = [], []
    kv, rope = prepare_kv(tiny_state, context), prepare_rope(tiny_cfg, height, width)
    with open_runtime("onnx", tmp_path / "graphs", Plan.uniform("batch2")) as runtime:  # cond and uncond in one call
        ours = dit_forward(tiny_state, runtime, x, sigma, kv, rope, on_block=lambda i, X: ours_blocks.append(X.copy()))
    oracle = diffusers_forward(tiny_oracle, x, sigma, context, oracle_blocks)
    for i, (a, b) in enumerate(zip(ours_blocks, oracle_blocks, strict=True)):
        assert relative_error(a, b) < TOLERANCE, f"block {i}"
    assert relative_error(ours, oracle) < TOLERANCE


def test_dit_oracle_distinguishes_batch_rows(tiny_cfg, tiny_state, tiny_oracle):
    """Guards the test itself: swapping the two timesteps must change the output far beyond the tolerance."""
    x, sigma, context = dit_inputs(tiny_cfg, 16, 16)
    oracle = diffusers_forward(tiny_oracle, x, sigma, context)
    swapped = reference_forward(tiny_state, x, sigma[::-1].copy(), context)
    assert relative_error(swapped, oracle) > 100 * TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("height,width", [(128, 128), (96, 160)])  # 1024x1024 and 768x1280 pixels
def test_dit_matches_diffusers_medium(height, width):
    """Head dim 128 as in the real model (RoPE split 44/42/42), 4 blocks."""
    cfg = AnimaConfig(
        num_blocks=4, width=256, num_heads=2, head_dim=128, mlp_dim=1024, adaln_lora_dim=32, context_dim=128,
        adapter_layers=1, adapter_dim=128, adapter_heads=2, adapter_head_dim=64, adapter_mlp_dim=512, adapter_source_dim=128,
    )
    state = random_dit_state(cfg, seed=3)
    x, sigma, context = dit_inputs(cfg, height, width)
    ours = reference_forward(state, x, sigma, context, branches=TorchBranches(state, cfg))
    oracle = diffusers_forward(diffusers_transformer(cfg, state), x, sigma, context)
    error = relative_error(ours, oracle)
    print(f"\nmedium DiT {height}x{width}: relative error {error:.2e}, max abs {np.abs(ours - oracle).max():.2e}")
    assert error < TOLERANCE


def diffusers_adapter(cfg: AnimaConfig, state: dict) -> AnimaTextConditioner:
    model = AnimaTextConditioner(
        source_dim=cfg.adapter_source_dim,
        target_dim=cfg.context_dim,
        model_dim=cfg.adapter_dim,
        num_layers=cfg.adapter_layers,
        num_attention_heads=cfg.adapter_heads,
        mlp_ratio=cfg.adapter_mlp_dim / cfg.adapter_dim,
        target_vocab_size=cfg.adapter_vocab,
        min_sequence_length=cfg.context_len,
    )
    model.load_state_dict({k: torch.from_numpy(v) for k, v in split_adapter(state).items()}, strict=True)
    return model.eval()


@pytest.mark.parametrize("batch,source_len,target_len", [(1, 7, 11), (2, 23, 5)])
def test_adapter_matches_diffusers(tiny_cfg, tiny_state, batch, source_len, target_len):
    """Single prompts (every token real): diffusers with all-ones masks, and without masks, equals ComfyUI's
    mask-free adapter; diffusers also zero-pads to 512 itself."""
    rng = np.random.default_rng(5)
    source = rng.standard_normal((batch, source_len, tiny_cfg.adapter_source_dim)).astype(np.float32)
    ids = rng.integers(0, tiny_cfg.adapter_vocab, (batch, target_len))
    ids[:, -1] = 1  # T5 </s>
    ours = pad_context(llm_adapter_forward(split_adapter(tiny_state), source, ids), tiny_cfg.context_len)

    oracle_model = diffusers_adapter(tiny_cfg, tiny_state)
    with torch.inference_mode():
        for masks in (None, (torch.ones(batch, target_len), torch.ones(batch, source_len))):
            oracle = oracle_model(
                torch.from_numpy(source),
                torch.from_numpy(ids),
                target_attention_mask=None if masks is None else masks[0],
                source_attention_mask=None if masks is None else masks[1],
            ).numpy()
            assert ours.shape == oracle.shape == (batch, tiny_cfg.context_len, tiny_cfg.context_dim)
            error = relative_error(ours, oracle)
            print(f"\nadapter B={batch} Ls={source_len} Lt={target_len} masks={masks is not None}: "
                  f"relative error {error:.2e}, max abs {np.abs(ours - oracle).max():.2e}")
            assert error < TOLERANCE
    assert not ours[:, target_len:].any()
