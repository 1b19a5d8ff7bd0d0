import json

import numpy as np
import pytest
from PIL import Image

from anima_ui.errors import UserError
from anima_ui.history import History, settings_from_png
from anima_ui.request import GenerationRequest
from anima_ui.sampling.spectrum import SETTINGS

SUMMARY = {"backend": "torch", "model": "tiny", "model_evals": 3, "seconds": {"denoise": 1.5, "total": 2.0},
           "per_step": [{"step": 1, "seconds": np.float32(0.5)}]}  # NumPy scalars must not break the sidecar


def _image(seed=0):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (32, 48, 3), dtype=np.uint8))


def test_saved_png_carries_parameters_and_restores_settings(tmp_path):
    request = GenerationRequest(prompt="a fox", negative="blur", seed=7, steps=3, cfg=4.0, width=64, height=96,
                                spectrum=True, spectrum_params={"setting": "fast", "forecaster": "velocity-ab"})
    item = History(tmp_path).save(_image(), request, SUMMARY)
    with Image.open(item.png_path) as png:
        assert "Seed: 7" in png.info["parameters"]
        assert png.size == (48, 32)
    restored = settings_from_png(item.png_path)
    assert restored == {**item.settings}
    assert restored["spectrum_params"] == {"setting": "fast", "forecaster": "velocity-ab", **SETTINGS["fast"]}
    sidecar = json.loads(item.png_path.with_suffix(".json").read_text())
    assert sidecar["settings"]["spectrum_params"] == restored["spectrum_params"]
    assert json.loads(item.png_path.with_suffix(".json").read_text())["summary"]["model"] == "tiny"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp files left


def test_items_survive_a_new_history_object_newest_first(tmp_path):
    first = History(tmp_path).save(_image(1), GenerationRequest(prompt="one", seed=1), SUMMARY)
    second = History(tmp_path).save(_image(2), GenerationRequest(prompt="two", seed=2), SUMMARY)
    names = [item.name for item in History(tmp_path).items()]
    assert names == [second.name, first.name]
    assert History(tmp_path).get(first.name).settings["prompt"] == "one"
    assert "seed 2" in History(tmp_path).items()[0].caption


def test_half_written_item_is_not_listed(tmp_path):
    # A crash between the PNG rename and the sidecar rename leaves a PNG without a sidecar: not an item.
    _image().save(tmp_path / "orphan.png")
    (tmp_path / "gone.json").write_text("{}")  # a sidecar whose PNG was deleted by hand
    assert History(tmp_path).items() == []


def test_a_failed_write_leaves_nothing(tmp_path):
    history = History(tmp_path)

    class Unwritable:
        def save(self, *args, **kwargs):
            raise OSError("disk full")

    with pytest.raises(OSError):
        history.save(Unwritable(), GenerationRequest(prompt="x"), SUMMARY)
    assert list(tmp_path.iterdir()) == []


def test_find_twin_matches_everything_but_spectrum(tmp_path):
    history = History(tmp_path)
    off = history.save(_image(), GenerationRequest(prompt="p", seed=3, steps=4), SUMMARY)
    settings = dict(off.settings, spectrum=True)
    assert history.find_twin(settings, spectrum=False, model="tiny").name == off.name
    assert history.find_twin(settings, spectrum=True, model="tiny") is None
    assert history.find_twin(dict(settings, seed=4), spectrum=False, model="tiny") is None
    assert history.find_twin(settings, spectrum=False, model="other") is None


def test_png_without_parameters_is_a_user_error(tmp_path):
    _image().save(tmp_path / "plain.png")
    with pytest.raises(UserError, match="no generation parameters"):
        settings_from_png(tmp_path / "plain.png")
    (tmp_path / "junk.png").write_bytes(b"not a png")
    with pytest.raises(UserError, match="not a readable image"):
        settings_from_png(tmp_path / "junk.png")
