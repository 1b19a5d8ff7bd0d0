"""`anima-ui generate` end to end on the tiny random model, and its one-line errors for bad input."""

import json
import shutil

import numpy as np
import pytest
from PIL import Image

from anima_ui.cli import main
from anima_ui.history import settings_from_png
from anima_ui.sampling.spectrum import SETTINGS, plan


def run_cli(argv) -> int:
    """The exit code, whether main returned it or argparse exited with it."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


def generate(tiny_model, tmp_path, *extra):
    argv = ["generate", "--models", str(tiny_model), "--prompt", "a lighthouse at dusk", "--seed", "3", "--steps", "3",
            "--width", "64", "--height", "96", "--out", str(tmp_path / "out.png"), *extra]
    return run_cli(argv)


def last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_generate_writes_png_latent_and_summary(tiny_model, tmp_path, capsys):
    assert generate(tiny_model, tmp_path, "--save-latent", str(tmp_path / "z.npy")) == 0
    summary = last_json(capsys)
    assert (summary["width"], summary["height"], summary["steps"]) == (64, 96, 3)
    assert summary["model_evals"] == 3 and summary["transformer_passes"] == 6  # CFG: cond + uncond per eval
    assert set(summary["seconds"]) == {"text", "denoise", "decode", "total"}
    image = Image.open(tmp_path / "out.png")
    assert image.size == (64, 96) and image.format == "PNG"
    assert "Seed: 3" in image.text["parameters"]
    latent = np.load(tmp_path / "z.npy")
    assert latent.shape == (1, 16, 12, 8) and latent.dtype == np.float32 and np.isfinite(latent).all()
    assert np.asarray(image).std() > 0  # not a constant (black) image
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.png", "z.npy"]  # no temp files left


def test_same_seed_same_latent_other_seed_differs(tiny_model, tmp_path, capsys):
    latents = []
    for seed in ("3", "3", "4"):
        path = tmp_path / f"z{len(latents)}.npy"
        assert generate(tiny_model, tmp_path, "--seed", seed, "--save-latent", str(path)) == 0
        latents.append(np.load(path))
    np.testing.assert_array_equal(latents[0], latents[1])
    assert np.abs(latents[0] - latents[2]).max() > 1e-3


def test_spectrum_runs_exactly_the_planned_model_evaluations(tiny_model, tmp_path, capsys):
    assert generate(tiny_model, tmp_path, "--steps", "8", "--spectrum") == 0
    summary = last_json(capsys)
    computed, forecast = plan(8)
    assert summary["model_evals"] == len(computed) < 8
    assert [s["step"] for s in summary["per_step"] if s["computed"]] == computed
    assert [s["step"] for s in summary["per_step"] if not s["computed"]] == forecast


def test_spectrum_fast_with_a_chosen_forecaster_is_recorded_in_the_png(tiny_model, tmp_path, capsys):
    assert generate(tiny_model, tmp_path, "--steps", "8", "--spectrum", "fast", "--spectrum-forecaster", "velocity-ab") == 0
    summary = last_json(capsys)
    assert summary["model_evals"] == len(plan(8, setting="fast")[0]) < len(plan(8)[0])
    restored = settings_from_png(tmp_path / "out.png")
    assert restored["spectrum"] is True
    assert restored["spectrum_params"] == {"setting": "fast", "forecaster": "velocity-ab", **SETTINGS["fast"]}


@pytest.mark.parametrize(
    "flags, names",
    [
        (["--steps", "0"], "steps"),
        (["--width", "100"], "width"),
        (["--height", "4096"], "height"),
        (["--backend", "cuda"], "backend"),
        (["--steps", "many"], "--steps"),
        (["--out", "/nonexistent-dir/out.png"], "folder"),
        (["--spectrum-window", "3"], "--spectrum-window"),
        (["--spectrum", "turbo"], "--spectrum"),
        (["--spectrum", "--spectrum-flex", "-1"], "flex"),
    ],
)
def test_bad_input_is_one_line_error(tiny_model, tmp_path, capsys, flags, names):
    rc = generate(tiny_model, tmp_path, *flags)
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1 and err.startswith("error:") and names in err
    assert not (tmp_path / "out.png").exists()


def test_missing_and_truncated_model_files(tiny_model, tmp_path, capsys):
    broken = shutil.copytree(tiny_model, tmp_path / "broken")
    vae = broken / "vae" / "qwen_image_vae.safetensors"
    vae.unlink()
    assert generate(broken, tmp_path) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "qwen_image_vae" in err

    dit = next((tiny_model / "diffusion_models").glob("*.safetensors"))
    truncated = shutil.copytree(tiny_model, tmp_path / "truncated")
    target = truncated / "diffusion_models" / dit.name
    target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    assert generate(truncated, tmp_path) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and dit.name in err


def test_unreadable_prompt_file(tiny_model, tmp_path, capsys):
    bad = tmp_path / "prompt.txt"
    bad.write_bytes(b"\xff\xfe\xfa not utf-8")
    argv = ["generate", "--models", str(tiny_model), "--prompt-file", str(bad), "--out", str(tmp_path / "o.png")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "prompt.txt" in err
    assert main(argv[:3] + ["--prompt-file", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "o.png")]) == 2
    assert "missing.txt" in capsys.readouterr().err



def test_a_size_without_graphs_is_exported_as_its_own_phase(tiny_model, tmp_path, capsys):
    models = shutil.copytree(tiny_model, tmp_path / "models")
    assert generate(models, tmp_path, "--backend", "onnx", "--steps", "2") == 0
    out, err = capsys.readouterr()
    assert [line for line in err.splitlines() if line.startswith("[")] == ["[export]", "[text]", "[denoise]", "[decode]"]
    assert (models / "exported" / "64x96" / "manifest.json").is_file()
    assert set(json.loads(out.splitlines()[-1])["seconds"]) == {"export", "text", "denoise", "decode", "total"}
    assert generate(models, tmp_path, "--backend", "sim", "--time-scale", "0.001", "--steps", "2") == 0
    phases = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[")]
    assert phases == ["[text]", "[denoise]", "[decode]"]  # exported once, then reused


def test_rknn_without_converted_graphs_names_the_commands(tiny_model, tmp_path, capsys):
    assert generate(tiny_model, tmp_path, "--backend", "rknn") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"anima-ui prepare --models {tiny_model} --width" in err
    assert not (tiny_model / "rknn").exists() and not (tiny_model / "exported").exists()
