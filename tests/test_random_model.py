"""`anima-ui random-model`: a folder in the official layout that the real loaders read back."""

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open

from anima_ui.cli import main
from anima_ui.errors import UserError
from anima_ui.fixtures import model as model_fixture
from anima_ui.fixtures.model import write_random_model
from anima_ui.fixtures.weights import float32_to_bf16_bits, random_dit_state, random_vae_state, text_encoder_shape
from anima_ui.model.checkpoint import dit_param_shapes, load_dit
from anima_ui.model.config import AnimaConfig
from anima_ui.modelfiles import ModelPaths

SEED = 11


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("models") / "tiny"
    assert main(["random-model", "--config", "tiny", "--seed", str(SEED), "--out", str(out)]) == 0
    return out


def _header(path) -> dict:
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(size))


def _tensors(path) -> dict[str, tuple]:
    return {k: tuple(v["shape"]) for k, v in _header(path).items() if k != "__metadata__"}


def test_every_file_of_the_layout_is_written(tiny):
    written = sorted(str(p.relative_to(tiny)) for p in tiny.rglob("*") if p.is_file())
    assert written == [
        "diffusion_models/anima-base-v1.0.safetensors",
        "text_encoders/qwen_3_06b_base.safetensors",
        "tokenizers/qwen25_tokenizer/merges.txt",
        "tokenizers/qwen25_tokenizer/tokenizer_config.json",
        "tokenizers/qwen25_tokenizer/vocab.json",
        "tokenizers/t5_tokenizer/special_tokens_map.json",
        "tokenizers/t5_tokenizer/tokenizer.json",
        "tokenizers/t5_tokenizer/tokenizer_config.json",
        "vae/qwen_image_vae.safetensors",
    ]


def test_the_folder_is_not_left_private(tiny):
    assert tiny.stat().st_mode & 0o777 == 0o755


def test_dit_file_has_the_release_keys_in_bf16(tiny):
    cfg = AnimaConfig.tiny()
    header = _header(tiny / "diffusion_models/anima-base-v1.0.safetensors")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    # 7 global + 20 per block, 4 adapter globals + 19 per adapter block (dit_param_shapes)
    assert len(tensors) == 7 + 20 * cfg.num_blocks + 4 + 19 * cfg.adapter_layers
    assert all(k.startswith("net.") for k in tensors)
    assert sum(k.startswith("net.llm_adapter.") for k in tensors) == 4 + 19 * cfg.adapter_layers
    assert {v["dtype"] for v in tensors.values()} == {"BF16"}


def test_dit_loads_back_through_model_paths_and_load_dit(tiny):
    cfg, state = load_dit(ModelPaths.find(tiny).dit)
    assert cfg == AnimaConfig.tiny()
    expected = random_dit_state(cfg, SEED)
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        as_bf16 = torch.from_numpy(value).to(torch.bfloat16).float().numpy()
        np.testing.assert_array_equal(state[key], as_bf16, err_msg=key)


def test_text_encoder_has_hf_qwen3_names_and_the_tiny_shapes(tiny):
    te = text_encoder_shape("tiny", AnimaConfig.tiny().adapter_source_dim)
    path = tiny / "text_encoders/qwen_3_06b_base.safetensors"
    tensors = _tensors(path)
    assert len(tensors) == 2 + 11 * te.layers  # 310 at full size (28 layers)
    assert tensors["model.embed_tokens.weight"] == (512, AnimaConfig.tiny().adapter_source_dim)
    assert tensors["model.layers.1.self_attn.k_proj.weight"] == (2 * te.head_dim, te.hidden)  # 2 KV heads
    assert tensors["model.layers.0.self_attn.q_norm.weight"] == (te.head_dim,)
    assert "lm_head.weight" not in tensors
    with safe_open(str(path), framework="pt") as f:
        assert f.get_tensor("model.norm.weight").dtype == torch.bfloat16


def test_vae_file_has_all_194_tensors_from_random_vae_state(tiny):
    path = tiny / "vae/qwen_image_vae.safetensors"
    tensors = _tensors(path)
    assert len(tensors) == 194
    assert tensors["decoder.head.2.weight"] == (3, 16, 3, 3, 3)  # tiny base width 16
    expected = random_vae_state(16, SEED + 2)["decoder.conv1.weight"]
    with safe_open(str(path), framework="pt") as f:
        stored = f.get_tensor("decoder.conv1.weight").float().numpy()
    np.testing.assert_array_equal(stored, torch.from_numpy(expected).to(torch.bfloat16).float().numpy())


def test_tokenizers_fit_the_embeddings(tiny):
    vocab = json.loads((tiny / "tokenizers/qwen25_tokenizer/vocab.json").read_text(encoding="utf-8"))
    config = json.loads((tiny / "tokenizers/qwen25_tokenizer/tokenizer_config.json").read_text(encoding="utf-8"))
    assert sorted(vocab.values()) == list(range(448))  # ordinary tokens fill 0..endoftext-1
    assert config["added_tokens_decoder"]["448"]["content"] == "<|endoftext|>"
    assert max(int(i) for i in config["added_tokens_decoder"]) < 512
    t5 = json.loads((tiny / "tokenizers/t5_tokenizer/tokenizer.json").read_text(encoding="utf-8"))
    assert [piece for piece, _ in t5["model"]["vocab"][:3]] == ["<pad>", "</s>", "<unk>"]
    assert max(t["id"] for t in t5["added_tokens"]) < AnimaConfig.tiny().adapter_vocab


def test_same_seed_same_bytes_other_seed_other_weights(tiny, tmp_path):
    again = write_random_model(tmp_path / "again", "tiny", SEED)
    other = write_random_model(tmp_path / "other", "tiny", SEED + 1)
    for relative in ("diffusion_models/anima-base-v1.0.safetensors", "text_encoders/qwen_3_06b_base.safetensors"):
        assert (again / relative).read_bytes() == (tiny / relative).read_bytes()
        assert (other / relative).read_bytes() != (tiny / relative).read_bytes()


def test_refuses_to_overwrite(tiny):
    with pytest.raises(UserError, match="already exists"):
        write_random_model(tiny, "tiny", 0)


def test_an_interrupted_run_leaves_nothing(tmp_path, monkeypatch):
    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(model_fixture, "write_random_vae", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_random_model(tmp_path / "model", "tiny", 0)
    assert list(tmp_path.iterdir()) == []


def test_bf16_rounding_matches_torch():
    rng = np.random.default_rng(0)
    values = np.concatenate(
        [
            rng.standard_normal(10000).astype(np.float32),
            # exact ties between two bf16 values, both parities, and values at the edges of the range
            np.array([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 0.0, -0.0, 3e38, -3e38, 1e-40], dtype=np.float32),
        ]
    )
    expected = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(float32_to_bf16_bits(values), expected)


def test_random_state_scales(tiny_cfg):
    state = random_dit_state(tiny_cfg, seed=4)
    assert set(state) == set(dit_param_shapes(tiny_cfg))
    norm = state["blocks.0.self_attn.q_norm.weight"]
    assert 0.02 < norm.std() < 0.3 and abs(norm.mean() - 1) < 0.1  # not all ones: a skipped norm shows
    w = state["blocks.0.mlp.layer2.weight"]  # fan_in 256
    assert w.std() == pytest.approx(1 / 16, rel=0.05)
    assert np.array_equal(random_dit_state(tiny_cfg, seed=4)["llm_adapter.norm.weight"], state["llm_adapter.norm.weight"])
