"""ModelPaths.find: the official layout, and one-line errors for missing or truncated files."""

import json
import shutil
import struct

import pytest

from anima_ui.fixtures.model import write_random_model
from anima_ui.errors import UserError
from anima_ui.modelfiles import ModelPaths, check_safetensors


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", seed=3)


@pytest.fixture
def folder(pristine, tmp_path):
    """A private copy each test may damage."""
    return shutil.copytree(pristine, tmp_path / "model")


def _one_line_error(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def test_finds_every_file_of_the_layout(folder):
    paths = ModelPaths.find(folder)
    assert paths.dit == folder / "diffusion_models/anima-base-v1.0.safetensors"
    assert paths.text_encoder == folder / "text_encoders/qwen_3_06b_base.safetensors"
    assert paths.vae == folder / "vae/qwen_image_vae.safetensors"
    assert paths.qwen_tokenizer_dir == folder / "tokenizers/qwen25_tokenizer"
    assert paths.t5_tokenizer_dir == folder / "tokenizers/t5_tokenizer"
    assert paths.taesd is None
    assert paths.exported_dir(896, 1152) == folder / "exported/896x1152"
    assert paths.rknn_dir(1024, 1024) == folder / "rknn/1024x1024"


def test_optional_preview_decoder_is_found_when_present(folder):
    (folder / "vae_approx").mkdir()
    shutil.copy(folder / "vae/qwen_image_vae.safetensors", folder / "vae_approx/taew2_1.safetensors")
    assert ModelPaths.find(folder).taesd == folder / "vae_approx/taew2_1.safetensors"


def test_of_several_diffusion_models_the_last_name_wins(folder):
    dit = folder / "diffusion_models/anima-base-v1.0.safetensors"
    shutil.copy(dit, folder / "diffusion_models/anima-preview.safetensors")
    shutil.copy(dit, folder / "diffusion_models/anima-aesthetic-v1.1.safetensors")
    assert ModelPaths.find(folder).dit.name == "anima-preview.safetensors"


@pytest.mark.parametrize(
    "relative",
    [
        "text_encoders/qwen_3_06b_base.safetensors",
        "vae/qwen_image_vae.safetensors",
        "tokenizers/qwen25_tokenizer/merges.txt",
        "tokenizers/qwen25_tokenizer/vocab.json",
        "tokenizers/t5_tokenizer/tokenizer.json",
        "tokenizers/t5_tokenizer/special_tokens_map.json",
    ],
)
def test_a_missing_file_is_named_with_where_to_get_it(folder, relative):
    (folder / relative).unlink()
    with pytest.raises(UserError) as excinfo:
        ModelPaths.find(folder)
    message = _one_line_error(excinfo)
    assert relative in message and "models/README.md" in message


def test_no_diffusion_model_is_reported(folder):
    (folder / "diffusion_models/anima-base-v1.0.safetensors").unlink()
    with pytest.raises(UserError) as excinfo:
        ModelPaths.find(folder)
    message = _one_line_error(excinfo)
    assert "diffusion_models" in message and "models/README.md" in message


def test_missing_folder_is_reported(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        ModelPaths.find(tmp_path / "nowhere")


@pytest.mark.parametrize(
    "relative",
    ["diffusion_models/anima-base-v1.0.safetensors", "text_encoders/qwen_3_06b_base.safetensors", "vae/qwen_image_vae.safetensors"],
)
def test_a_truncated_safetensors_file_is_named(folder, relative):
    path = folder / relative
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 2)  # one bf16 value short
    with pytest.raises(UserError) as excinfo:
        ModelPaths.find(folder)
    message = _one_line_error(excinfo)
    assert str(path) in message and "truncated" in message and f"{size - 2} bytes of {size}" in message


def test_a_header_longer_than_the_file_is_reported(folder):
    path = folder / "vae/qwen_image_vae.safetensors"
    with open(path, "r+b") as f:
        f.truncate(1000)  # cut inside the JSON header
    with pytest.raises(UserError) as excinfo:
        check_safetensors(path)
    assert str(path) in _one_line_error(excinfo)


@pytest.mark.parametrize("content", [b"", b"\x05\x00", struct.pack("<Q", 9) + b"not json!", struct.pack("<Q", 2) + b"[]"])
def test_garbage_is_not_taken_for_safetensors(tmp_path, content):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(UserError) as excinfo:
        check_safetensors(path)
    assert "not a complete safetensors file" in _one_line_error(excinfo)


def test_a_complete_file_passes_even_with_metadata(tmp_path):
    header = json.dumps({"__metadata__": {"format": "pt"}, "x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    path = tmp_path / "ok.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 8)
    check_safetensors(path)
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 7)
    with pytest.raises(UserError, match="truncated"):
        check_safetensors(path)
