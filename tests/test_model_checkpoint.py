"""Config and key layout at full size, and the torch-free loader on files written like the release files."""

import numpy as np
import pytest
import torch

from anima_ui.errors import UserError
from anima_ui.model.checkpoint import dit_param_shapes, load_dit, split_adapter
from anima_ui.model.config import AnimaConfig


def test_full_layout_counts_and_parameters():
    shapes = dit_param_shapes(AnimaConfig.full())
    adapter = [k for k in shapes if k.startswith("llm_adapter.")]
    assert len(shapes) == 685
    assert len(adapter) == 118
    assert sum(int(np.prod(s)) for s in shapes.values()) == 2_091_068_928
    assert shapes["x_embedder.proj.1.weight"] == (2048, 68)
    assert shapes["blocks.27.cross_attn.k_proj.weight"] == (2048, 1024)
    assert shapes["final_layer.adaln_modulation.2.weight"] == (4096, 256)
    assert shapes["llm_adapter.embed.weight"] == (32128, 1024)
    assert shapes["llm_adapter.blocks.5.mlp.0.bias"] == (4096,)


@pytest.mark.parametrize("cfg", [AnimaConfig.full(), AnimaConfig.tiny()], ids=["full", "tiny"])
def test_config_from_shapes_round_trips(cfg):
    assert AnimaConfig.from_shapes(dit_param_shapes(cfg)) == cfg


def test_from_shapes_names_a_missing_anchor_tensor():
    shapes = dit_param_shapes(AnimaConfig.tiny())
    del shapes["blocks.0.self_attn.q_norm.weight"]
    with pytest.raises(UserError, match="blocks.0.self_attn.q_norm.weight"):
        AnimaConfig.from_shapes(shapes)


def test_from_shapes_rejects_a_head_dim_that_does_not_divide_the_width():
    shapes = dit_param_shapes(AnimaConfig.tiny())
    shapes["blocks.0.self_attn.q_norm.weight"] = (48,)
    with pytest.raises(UserError, match="do not divide"):
        AnimaConfig.from_shapes(shapes)


def test_split_adapter_strips_the_prefix(tiny_state):
    adapter = split_adapter(tiny_state)
    assert len(adapter) == 2 * 19 + 4
    assert adapter["embed.weight"] is tiny_state["llm_adapter.embed.weight"]


def bf16_rounded(a: np.ndarray) -> np.ndarray:
    return torch.from_numpy(a).to(torch.bfloat16).float().numpy()


@pytest.mark.parametrize("prefix", ["net.", "model.diffusion_model.", "diffusion_model.", ""])
def test_load_bf16_file_with_any_release_prefix(tiny_cfg, tiny_state, write_dit_file, tmp_path, prefix):
    path = tmp_path / "anima.safetensors"
    extra = {"some_metadata_tensor": np.zeros(3, np.float32)}
    write_dit_file({**tiny_state, **extra}, path, prefix=prefix)
    cfg, state = load_dit(path)
    assert cfg == tiny_cfg
    assert set(state) == set(tiny_state)  # the unknown key is ignored
    for key, value in tiny_state.items():
        assert state[key].dtype == np.float32
        assert np.array_equal(state[key], bf16_rounded(value)), key


def test_load_f32_and_f16_files_and_target_dtype(tiny_state, write_dit_file, tmp_path):
    write_dit_file(tiny_state, tmp_path / "f32.safetensors", dtype=torch.float32)
    _, state = load_dit(tmp_path / "f32.safetensors")
    assert all(np.array_equal(state[k], v) for k, v in tiny_state.items())
    write_dit_file(tiny_state, tmp_path / "f16.safetensors", dtype=torch.float16)
    _, state = load_dit(tmp_path / "f16.safetensors", dtype=np.float16)
    key = "blocks.1.mlp.layer2.weight"
    assert state[key].dtype == np.float16
    assert np.array_equal(state[key], tiny_state[key].astype(np.float16))


def test_missing_tensor_is_named(tiny_state, write_dit_file, tmp_path):
    state = dict(tiny_state)
    del state["blocks.1.cross_attn.v_proj.weight"]
    write_dit_file(state, tmp_path / "m.safetensors")
    with pytest.raises(UserError, match=r"m\.safetensors: tensor 'blocks\.1\.cross_attn\.v_proj\.weight' is missing"):
        load_dit(tmp_path / "m.safetensors")


def test_missing_adapter_is_named(tiny_state, write_dit_file, tmp_path):
    state = {k: v for k, v in tiny_state.items() if not k.startswith("llm_adapter.")}
    write_dit_file(state, tmp_path / "no_adapter.safetensors")
    with pytest.raises(UserError, match="llm_adapter.out_proj.weight"):
        load_dit(tmp_path / "no_adapter.safetensors")


def test_misshapen_tensor_is_named_with_both_shapes(tiny_state, write_dit_file, tmp_path):
    state = dict(tiny_state)
    state["blocks.0.mlp.layer2.weight"] = np.zeros((64, 255), np.float32)
    write_dit_file(state, tmp_path / "s.safetensors")
    with pytest.raises(UserError, match=r"'blocks\.0\.mlp\.layer2\.weight' has shape \(64, 255\), expected \(64, 256\)"):
        load_dit(tmp_path / "s.safetensors")


def test_truncated_file_names_the_file(tiny_state, write_dit_file, tmp_path):
    path = tmp_path / "cut.safetensors"
    write_dit_file(tiny_state, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match=r"cut\.safetensors is truncated"):
        load_dit(path)
    path.write_bytes(data[:100])  # the header itself cut off
    with pytest.raises(UserError, match=r"cut\.safetensors is not a complete safetensors file"):
        load_dit(path)
    path.write_bytes(b"")
    with pytest.raises(UserError, match=r"cut\.safetensors is not a complete safetensors file"):
        load_dit(path)


def test_unreadable_path_names_the_file(tmp_path):
    with pytest.raises(UserError, match=r"cannot read .*nothing\.safetensors"):
        load_dit(tmp_path / "nothing.safetensors")
