"""Getting the official files: the download plan, atomic downloads, and the one-line reason a model folder is not ready."""

import json

import pytest

from anima_ui import download
from anima_ui.errors import UserError
from anima_ui.modelfiles import missing_message


def test_download_plan_maps_urls_to_the_layout(tmp_path):
    plan = download.download_plan(tmp_path)
    by_dest = {d.dest: d for d in plan}
    dit = by_dest["diffusion_models/anima-base-v1.0.safetensors"]
    assert dit.url == ("https://huggingface.co/circlestone-labs/Anima/resolve/main/"
                       "split_files/diffusion_models/anima-base-v1.0.safetensors")
    assert (dit.repo, dit.repo_file) == ("circlestone-labs/Anima", "split_files/diffusion_models/anima-base-v1.0.safetensors")
    assert by_dest["vae/qwen_image_vae.safetensors"].url.endswith("/split_files/vae/qwen_image_vae.safetensors")
    assert by_dest["tokenizers/t5_tokenizer/tokenizer.json"].url.endswith("/comfy/text_encoders/t5_tokenizer/tokenizer.json")
    assert by_dest["vae_approx/taew2_1.safetensors"].optional
    assert len(plan) == 10 and not any(d.optional for d in plan if d.dest != "vae_approx/taew2_1.safetensors")
    # Files already present (any diffusion model counts) are not fetched again.
    (tmp_path / "diffusion_models").mkdir()
    (tmp_path / "diffusion_models" / "anima-preview.safetensors").write_bytes(b"x")
    (tmp_path / "vae").mkdir()
    (tmp_path / "vae" / "qwen_image_vae.safetensors").write_bytes(b"x")
    remaining = {d.dest for d in download.download_plan(tmp_path)}
    assert "vae/qwen_image_vae.safetensors" not in remaining
    assert not any(d.startswith("diffusion_models/") for d in remaining)


def test_missing_model_is_reported(tmp_path):
    assert "does not exist" in missing_message(tmp_path / "nothing")
    assert "missing diffusion model" in missing_message(tmp_path)


def test_url_download_is_atomic_and_reports_progress(tmp_path, monkeypatch):
    # file:// URLs exercise the urllib path without a network; the Hub path is bypassed by making it unavailable.
    source = tmp_path / "mirror"
    (source / "qwen25_tokenizer").mkdir(parents=True)
    (source / "qwen25_tokenizer" / "vocab.json").write_text(json.dumps({"a": 0}))
    monkeypatch.setattr(download, "_have_hub", lambda: False)
    plan = [d for d in download.download_plan(tmp_path / "models", comfy_raw=source.as_uri())
            if d.dest.startswith("tokenizers/qwen25_tokenizer/vocab")]
    lines = list(download.download(plan, tmp_path / "models"))
    assert lines[-1].endswith("done") and any("MiB" in line for line in lines)
    assert json.loads((tmp_path / "models" / "tokenizers/qwen25_tokenizer/vocab.json").read_text()) == {"a": 0}
    missing = [d for d in download.download_plan(tmp_path / "models2", comfy_raw=source.as_uri())
               if d.dest.endswith("merges.txt")]
    with pytest.raises(UserError, match="download of tokenizers/qwen25_tokenizer/merges.txt failed"):
        list(download.download(missing, tmp_path / "models2"))
    assert not any(p.name.endswith(".partial") for p in (tmp_path / "models2").rglob("*"))
