"""The text encoder against transformers (Qwen3 loaded the standard HF way) and diffusers' Anima text path."""

from math import prod
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers.models import AnimaTextConditioner
from diffusers.modular_pipelines.anima.encoders import AnimaTextEncoderStep
from safetensors.torch import load_file
from transformers import Qwen2Tokenizer, Qwen3Config, Qwen3ForCausalLM, Qwen3Model, T5TokenizerFast

from anima_ui.bench.text import numpy_adapter
from anima_ui.cli import main
from anima_ui.errors import UserError
from anima_ui.fixtures.model import write_random_model
from anima_ui.fixtures.weights import text_encoder_shape, write_random_text_encoder
from anima_ui.model.adapter import adapt_sequences, open_adapter
from anima_ui.model.config import AnimaConfig
from anima_ui.modelfiles import ModelPaths
from anima_ui.text.encoder import TextEncoder
from anima_ui.text.prompt_file import read_prompt_file
from anima_ui.text.qwen3 import QWEN3_06B, Qwen3, Qwen3Shape, qwen3_param_shapes, qwen3_shape_from

PROMPT = "1girl, solo, long hair, looking at viewer, smile, cherry blossoms"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return ModelPaths.find(write_random_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", seed=9))


@pytest.fixture(scope="module")
def encoder(paths):
    return TextEncoder.load(paths)


def encode(encoder, prompt):
    return encoder.encode([prompt])[0]


@pytest.fixture(scope="module")
def hf_folder(paths, tmp_path_factory) -> Path:
    """The same weights as a standard transformers checkpoint (config.json written by hand, save_pretrained)."""
    te = text_encoder_shape("tiny", AnimaConfig.tiny().adapter_source_dim)
    config = Qwen3Config(
        vocab_size=te.vocab, hidden_size=te.hidden, intermediate_size=te.intermediate, num_hidden_layers=te.layers,
        num_attention_heads=te.heads, num_key_value_heads=te.kv_heads, head_dim=te.head_dim, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, tie_word_embeddings=True,
    )
    model = Qwen3ForCausalLM(config)
    weights = {k: v.float() for k, v in load_file(str(paths.text_encoder)).items()}
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    model.load_state_dict(weights, strict=True)
    folder = tmp_path_factory.mktemp("hf_qwen3")
    model.save_pretrained(folder)
    return folder


def test_hidden_states_equal_transformers_loaded_the_standard_way(encoder, paths, hf_folder):
    """The NumPy Qwen3 against transformers' Qwen3ForCausalLM / Qwen3Model in float32: a prompt and a long
    random sequence (causal mask, RoPE and GQA over 300 positions), encoded together as the pipeline does."""
    ids = encoder.tokenizer(PROMPT).qwen_ids
    long_ids = np.random.default_rng(3).integers(0, 448, 300).tolist()
    ours = Qwen3(paths.text_encoder).final_hidden_states([ids, long_ids])
    causal_lm = Qwen3ForCausalLM.from_pretrained(hf_folder, dtype=torch.float32).eval()
    base = Qwen3Model.from_pretrained(hf_folder, dtype=torch.float32).eval()
    for sequence, hidden in zip([ids, long_ids], ours):
        with torch.no_grad():
            last_hidden = causal_lm(torch.tensor([sequence]), output_hidden_states=True).hidden_states[-1].numpy()
            last_state = base(torch.tensor([sequence])).last_hidden_state.numpy()
        assert hidden.shape == (1, len(sequence), AnimaConfig.tiny().adapter_source_dim) and hidden.dtype == np.float32
        print(f"\nQwen3 {len(sequence)} tokens: max abs difference {np.abs(hidden - last_state).max():.2e}")
        np.testing.assert_allclose(hidden, last_hidden, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(hidden, last_state, rtol=1e-5, atol=1e-5)


def test_sequences_encoded_together_equal_each_alone(paths):
    qwen3 = Qwen3(paths.text_encoder)
    a, b = [1, 2, 3], [7, 8, 9, 10, 11]
    together = qwen3.final_hidden_states([a, b])
    np.testing.assert_array_equal(together[0], qwen3.final_hidden_states([a])[0])
    np.testing.assert_array_equal(together[1], qwen3.final_hidden_states([b])[0])
    # causal: a prefix's states do not depend on what follows it
    np.testing.assert_allclose(together[1][:, :2], qwen3.final_hidden_states([[7, 8]])[0], rtol=1e-6, atol=1e-6)


def test_token_ids_outside_the_embedding_are_refused(paths):
    with pytest.raises(UserError, match="outside the text encoder's 512 rows"):
        Qwen3(paths.text_encoder).final_hidden_states([[3, 512]])


def test_context_equals_diffusers_anima_text_path(encoder, paths, hf_folder):
    """diffusers tokenizes with masks and padding; for one non-empty prompt that is ComfyUI's result."""
    components = SimpleNamespace(
        tokenizer=Qwen2Tokenizer.from_pretrained(str(paths.qwen_tokenizer_dir)),
        t5_tokenizer=T5TokenizerFast.from_pretrained(str(paths.t5_tokenizer_dir)),
        text_encoder=Qwen3Model.from_pretrained(hf_folder, dtype=torch.float32).eval(),
    )
    cfg = AnimaConfig.tiny()
    conditioner = AnimaTextConditioner(
        source_dim=cfg.adapter_source_dim, target_dim=cfg.context_dim, model_dim=cfg.adapter_dim,
        num_layers=cfg.adapter_layers, num_attention_heads=cfg.adapter_heads, target_vocab_size=cfg.adapter_vocab,
    )
    adapter = {k[len("net.llm_adapter."):]: v.float() for k, v in load_file(str(paths.dit)).items() if k.startswith("net.llm_adapter.")}
    conditioner.load_state_dict(adapter, strict=True)
    with torch.no_grad():
        qwen, qwen_mask = AnimaTextEncoderStep._get_qwen_prompt_embeds(components, PROMPT, 512, "cpu", torch.float32)
        t5_ids, t5_mask = AnimaTextEncoderStep._get_t5_prompt_ids(components, PROMPT, 512, "cpu")
        expected = conditioner(qwen, t5_ids, target_attention_mask=t5_mask, source_attention_mask=qwen_mask).numpy()
    assert t5_ids[0].tolist() == encoder.tokenizer(PROMPT).t5_ids
    np.testing.assert_allclose(encode(encoder, PROMPT), expected, rtol=1e-4, atol=1e-5)


def test_context_shape_and_zero_beyond_the_t5_length(encoder):
    for prompt in ["", PROMPT]:
        context = encode(encoder, prompt)
        length = len(encoder.tokenizer(prompt).t5_ids)
        assert context.shape == (1, 512, AnimaConfig.tiny().context_dim) and context.dtype == np.float32
        assert np.all(np.abs(context[0, :length]).sum(axis=-1) > 0)
        assert not context[0, length:].any()


def test_t5_weights_scale_the_adapter_output(encoder):
    plain, weighted = encoder.encode(["rain", "(rain:2.0)"])
    n = len(encoder.tokenizer("rain").t5_ids) - 1  # the end token keeps weight 1
    np.testing.assert_allclose(weighted[0, :n], 2 * plain[0, :n], rtol=1e-6)
    np.testing.assert_array_equal(weighted[0, n:], plain[0, n:])


def test_too_long_prompt_is_one_line_error(encoder):
    with pytest.raises(UserError) as excinfo:
        encode(encoder, "rain, " * 400)
    assert "512" in str(excinfo.value) and "\n" not in str(excinfo.value)


def test_shape_is_inferred_from_full_size_shapes():
    shapes = qwen3_param_shapes(QWEN3_06B)
    assert qwen3_shape_from(shapes) == QWEN3_06B
    # anima_model.md §9: 310 tensors, 596,049,920 parameters
    assert len(shapes) == 310 and sum(prod(s) for s in shapes.values()) == 596_049_920


def test_text_encoder_narrower_than_the_adapter_is_refused(paths, tmp_path):
    narrow = Qwen3Shape(vocab=512, hidden=32, layers=1, heads=2, kv_heads=1, head_dim=16, intermediate=64)
    write_random_text_encoder(tmp_path / "te.safetensors", narrow, seed=0)
    other = ModelPaths(**{**paths.__dict__, "text_encoder": tmp_path / "te.safetensors"})
    with pytest.raises(UserError, match="does not match the adapter"):
        TextEncoder.load(other)


def test_text_encoder_missing_a_tensor_is_named(tmp_path):
    te = Qwen3Shape(vocab=512, hidden=32, layers=2, heads=2, kv_heads=1, head_dim=16, intermediate=64)
    path = tmp_path / "te.safetensors"
    write_random_text_encoder(path, te, seed=0)
    weights = load_file(str(path))
    del weights["model.layers.1.mlp.up_proj.weight"]
    from safetensors.torch import save_file

    save_file(weights, str(path))
    with pytest.raises(UserError, match="model.layers.1.mlp.up_proj.weight"):
        Qwen3(path)


def test_prompt_file_reads_utf8_and_drops_the_final_newline(tmp_path):
    path = tmp_path / "prompt.txt"
    path.write_bytes("\ufeff1girl, 雨, (smile:1.2)\n".encode("utf-8"))
    assert read_prompt_file(path) == "1girl, 雨, (smile:1.2)"


@pytest.mark.parametrize("case", ["missing", "directory", "latin1"])
def test_unreadable_prompt_file_is_one_line_error(tmp_path, case):
    path = tmp_path / "prompt.txt"
    if case == "directory":
        path.mkdir()
    elif case == "latin1":
        path.write_bytes("café".encode("latin-1"))
    with pytest.raises(UserError) as excinfo:
        read_prompt_file(path)
    message = str(excinfo.value)
    assert str(path) in message and "\n" not in message
    if case == "latin1":
        assert "UTF-8" in message


def test_pipeline_keeps_recent_contexts_and_opens_an_encoder_only_for_new_prompts(paths, encoder, monkeypatch):
    """A repeated prompt costs nothing (no encoder is opened); an encoder is dropped after encoding."""
    from anima_ui import pipeline as pipeline_module

    opened = []
    real_load = pipeline_module.TextEncoder.load

    def counting_load(model_paths):
        opened.append(real_load(model_paths))
        return opened[-1]

    monkeypatch.setattr(pipeline_module.TextEncoder, "load", counting_load)
    pipeline = pipeline_module.Pipeline.load(paths.root, backend="onnx")
    positive, negative = pipeline.contexts([PROMPT, ""])
    assert len(opened) == 1
    np.testing.assert_array_equal(positive, encode(encoder, PROMPT))
    assert not positive.flags.writeable
    again = pipeline.contexts([PROMPT, ""])
    assert len(opened) == 1 and again[0] is positive and again[1] is negative
    for i in range(3):  # 4 contexts are kept: the 3 newest prompts and the most recently used of the two
        pipeline.contexts([f"prompt {i}", ""])
    assert len(opened) == 4
    reencoded = pipeline.contexts([PROMPT])[0]
    assert len(opened) == 5 and reencoded is not positive
    np.testing.assert_array_equal(reencoded, positive)
    assert pipeline.contexts([""])[0] is negative  # used by every call, never evicted


def test_bench_text_prints_the_adapter_engines_side_by_side(paths, capsys):
    assert main(["bench", "text", "--models", str(paths.root), "--engines", "onnx", "--lengths", "5", "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    title = next(i for i, line in enumerate(lines) if line.startswith("LLM adapter"))
    rows = [line.split() for line in lines[title + 2:]]
    assert [row[:2] for row in rows] == [["onnx", "5"], ["numpy", "5"]]
    assert float(rows[0][3]) < 1e-4  # the app's graphs and the NumPy engine it replaced agree


def test_the_benchs_numpy_adapter_is_the_apps_adapter(paths):
    """The bench's "before" row computes the same function as the app's graphs, from the same file."""
    weights = open_adapter(paths.dit)
    rng = np.random.default_rng(3)
    source = rng.standard_normal((9, weights.shape("blocks.0.cross_attn.k_proj.weight")[1])).astype(np.float32)
    ids = rng.integers(0, weights.shape("embed.weight")[0], 6)
    ours = adapt_sequences(weights, [(source, ids)])[0]
    before = numpy_adapter(weights, source, ids)
    assert ours.shape == before.shape and np.abs(ours - before).max() < 1e-5 * np.abs(before).max()
