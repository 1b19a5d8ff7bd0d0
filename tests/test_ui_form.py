import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from anima_ui.errors import UserError
from anima_ui.sampling.spectrum import DEFAULT_FORECASTER, SETTINGS, canonical
from anima_ui.ui import form
from anima_ui.ui.watch import job_status, plain


def _request(**overrides):
    values = dict(prompt="a cat", negative="", seed="7", cfg=4.0, steps=4, size="128x128", spectrum="off")
    values.update(overrides)
    return form.build_request(**values)


def test_form_values_become_a_request():
    request = _request(seed="18446744073", steps=4.0, size="64 x 96", spectrum="on")
    assert (request.seed, request.steps, request.width, request.height, request.spectrum) == (18446744073, 4, 64, 96, True)
    assert request.spectrum_params == canonical({"setting": "on", "forecaster": DEFAULT_FORECASTER})


def test_the_spectrum_setting_and_forecaster_become_the_full_config():
    request = _request(spectrum="fast", forecaster="velocity-linear", steps=28)
    assert request.spectrum_params == {"setting": "fast", "forecaster": "velocity-linear", **SETTINGS["fast"]}
    assert _request(spectrum="off", forecaster="sdcpp").spectrum_params == {}
    assert _request(spectrum=True).spectrum_params["setting"] == "on"  # presets from before the settings
    with pytest.raises(UserError, match="Spectrum must be one of off, on, fast"):
        _request(spectrum="turbo")
    with pytest.raises(UserError, match="Spectrum forecaster"):
        _request(spectrum="on", forecaster="magic")


@pytest.mark.parametrize("seed", ["", "-1", None])
def test_random_seed(seed):
    assert 0 <= _request(seed=seed).seed < 2**32


def test_empty_prompt_is_allowed_like_a1111():
    assert _request(prompt="", cfg=7.0).prompt == ""


@pytest.mark.parametrize("overrides,message", [
    ({"seed": "abc"}, "seed must be a whole number"),
    ({"seed": "-5"}, "seed must be from 0"),
    ({"steps": 0}, "steps must be a whole number from 1"),
    ({"steps": 2.5}, "steps must be a whole number"),
    ({"steps": None}, "steps must be a whole number"),
    ({"steps": float("nan")}, "steps must be a whole number"),  # NaN and infinity come through the API
    ({"steps": float("inf")}, "steps must be a whole number"),
    ({"cfg": "x"}, "CFG must be a number"),
    ({"cfg": 99}, "CFG must be between"),
    ({"size": "99999x99999"}, "width must be a multiple of 16"),
    ({"size": "100x128"}, "width must be a multiple of 16"),
    ({"size": "big"}, "size must look like"),
])
def test_bad_input_is_one_line_user_error(overrides, message):
    with pytest.raises(UserError, match=message) as info:
        _request(**overrides)
    assert "\n" not in str(info.value)


def test_strict_sizes_only_allow_exported_graphs():
    with pytest.raises(UserError, match="no exported graphs"):
        form.build_request("a", "", "1", 4, 4, "512x512", "off", allowed_sizes=["1024x1024"])


def test_size_choices_follow_the_backend(tmp_path):
    class Paths:
        root = tmp_path

    for kind, size in (("exported", "832x1216"), ("exported", "1024x1024"), ("rknn", "1024x1024")):
        (tmp_path / kind / size).mkdir(parents=True)
        (tmp_path / kind / size / "manifest.json").write_text("{}")
    (tmp_path / "exported" / "640x640").mkdir()  # no manifest: an unfinished export does not count
    assert form.size_choices("onnx", Paths, demo=False) == ["1024x1024", "832x1216"]
    assert form.size_choices("rknn", Paths, demo=False) == ["1024x1024"]
    assert form.size_choices("torch", Paths, demo=False) == list(form.STANDARD_SIZES)
    assert form.size_choices("torch", None, demo=True) == list(form.DEMO_SIZES)


def test_presets_round_trip_without_seed(tmp_path):
    committed, mine = tmp_path / "presets", tmp_path / "user"
    committed.mkdir()
    (committed / "draft.json").write_text('{"steps": 4}')
    stem = form.save_preset(committed, mine, "My Style!", {"prompt": "p", "negative": "n", "cfg": 5.0, "steps": 9,
                                                            "size": "64x64", "spectrum": "fast", "forecaster": "reuse",
                                                            "seed": 3})
    assert stem == "my-style" and (mine / "my-style.json").is_file() and not (committed / "my-style.json").exists()
    assert form.list_presets(committed, mine) == ["draft", "my-style"]
    assert form.load_preset(committed, mine, "my-style") == {"prompt": "p", "negative": "n", "cfg": 5.0, "steps": 9,
                                                             "size": "64x64", "spectrum": "fast", "forecaster": "reuse"}
    assert form.load_preset(committed, mine, "draft") == {"steps": 4}
    (mine / "old.json").write_text('{"steps": 9, "spectrum": true}')  # a preset from before the settings
    assert form.load_preset(committed, mine, "old") == {"steps": 9, "spectrum": "on"}
    with pytest.raises(UserError, match="give the preset a name"):
        form.save_preset(committed, mine, "  ", {})
    with pytest.raises(UserError, match="'draft' is a built-in preset"):
        form.save_preset(committed, mine, "DRAFT", {"steps": 9})
    assert form.load_preset(committed, mine, "draft") == {"steps": 4}
    with pytest.raises(UserError, match="at most 64 characters; this one has 65"):
        form.save_preset(committed, mine, "x" * 65, {})
    (mine / "broken.json").write_text("{")
    with pytest.raises(UserError, match="not valid JSON"):
        form.load_preset(committed, mine, "broken")


def test_user_presets_are_capped_in_number(tmp_path, monkeypatch):
    monkeypatch.setattr(form, "MAX_USER_PRESETS", 2)
    for name in ("one", "two"):
        form.save_preset(tmp_path / "presets", tmp_path / "user", name, {"steps": 1})
    with pytest.raises(UserError, match="2 saved presets already"):
        form.save_preset(tmp_path / "presets", tmp_path / "user", "three", {"steps": 1})
    form.save_preset(tmp_path / "presets", tmp_path / "user", "two", {"steps": 2})  # overwriting one is allowed


def test_committed_presets_are_valid(tmp_path):
    from pathlib import Path

    presets = Path(__file__).parent.parent / "presets"
    names = form.list_presets(presets, tmp_path)
    assert len(names) == len(list(presets.glob("*.json"))) >= 1
    for name in names:
        values = form.load_preset(presets, tmp_path, name)
        _request(**{k: v for k, v in values.items() if k in ("negative", "cfg", "steps", "size", "spectrum", "forecaster")})


def test_the_result_line_names_the_decoder_and_the_npu_layout():
    def done(summary):
        item = SimpleNamespace(summary=summary, png_path=Path("00001-7.png"))
        job = SimpleNamespace(state="done", item=item, elapsed=12.0, request=SimpleNamespace(seed=7))
        return job_status(None, job)

    assert "seed 7 · VAE npu (halo) · 00001-7.png" in done({"decoder": "npu", "decoder_layout": "halo"})
    assert "seed 7 · VAE sdcpp · 00001-7.png" in done({"decoder": "sdcpp", "decoder_layout": None})
    fallback = done({"decoder": "onnx", "warning": "stable-diffusion.cpp VAE unavailable (no library); decoded with the onnx decoder"})
    assert "VAE onnx" in fallback and "⚠️ " + plain("stable-diffusion.cpp VAE unavailable (no library)") in fallback  # escaped: user-facing Markdown
