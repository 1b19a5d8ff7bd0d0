import random
import re

import pytest

from anima_ui.errors import UserError
from anima_ui.infotext import (
    format_infotext,
    format_seconds,
    join_infotext,
    param_pairs,
    parse_infotext,
    settings_from_infotext,
)
from anima_ui.limits import MAX_INFOTEXT_CHARS
from anima_ui.request import GenerationRequest

# A1111's own regex (modules/infotext_utils.py re_param_code), the oracle for our one-pass scanner.
A1111_PARAM_RE = re.compile(r'\s*(\w[\w \-/]+):\s*("(?:\\.|[^\\"])+"|[^,]*)(?:,|$)')

# Verbatim A1111 v1.10 output (modules/processing.py create_infotext), from gradio_ui.md §3.3.
A1111_TEXT = (
    "a lighthouse at dusk, oil painting\n"
    "Negative prompt: blurry\n"
    "Steps: 20, Sampler: Euler a, CFG scale: 7, Seed: 965400086, Size: 512x768, Model hash: 45dee52b, "
    "Model: v1-5-pruned-emaonly, Version: v1.10.1"
)


def test_parses_a1111_text():
    prompt, negative, params = parse_infotext(A1111_TEXT)
    assert prompt == "a lighthouse at dusk, oil painting"
    assert negative == "blurry"
    assert params["Seed"] == "965400086"
    assert (params["Size-1"], params["Size-2"]) == ("512", "768")
    assert params["Model hash"] == "45dee52b"
    assert params["Sampler"] == "Euler a"


def test_join_matches_a1111_layout_and_quoting():
    text = join_infotext("a cat", "", {"Steps": 4, "Seed": 1, "Spectrum config": "w=0.4, m=3", "Skipped": None})
    # No negative line when the negative prompt is empty; values with commas are JSON-quoted; None is skipped.
    assert text == 'a cat\nSteps: 4, Seed: 1, Spectrum config: "w=0.4, m=3"'


def test_round_trip_of_our_infotext_restores_every_setting():
    request = GenerationRequest(
        prompt="two lines,\nwith: colons", negative="bad, hands", seed=2**40 + 3, steps=12, cfg=4.5,
        width=832, height=1216, spectrum=True, spectrum_params={"setting": "fast", "forecaster": "sdcpp", "w": 0.3},
    )
    text = format_infotext(request, {"backend": "onnx", "model": "anima-base-v1.0", "model_evals": 7,
                                     "seconds": {"denoise": 83.2}})
    assert "Spectrum: fast, Spectrum forecaster: sdcpp" in text
    assert "Denoise time: 1m23s" in text and "Model: anima-base-v1.0" in text
    settings = settings_from_infotext(text)
    assert settings == {
        "prompt": request.prompt, "negative": request.negative, "seed": request.seed, "steps": 12, "cfg": 4.5,
        "width": 832, "height": 1216, "spectrum": True,
        "spectrum_params": {"setting": "fast", "forecaster": "sdcpp", "window": 3, "flex": 1.5, "warmup": 2,
                            "stop": 0.95, "w": 0.3, "m": 3, "lam": 1.0},
    }


@pytest.mark.parametrize("summary, text", [({"decoder": "npu", "decoder_layout": "halo-batch"}, "VAE decoder: npu (halo-batch)"),
                                           ({"decoder": "sdcpp", "decoder_layout": None}, "VAE decoder: sdcpp"),
                                           ({"decoder": None}, None)])
def test_the_parameters_name_the_decoder_and_the_npu_layout(summary, text):
    infotext = format_infotext(GenerationRequest(prompt="a cat", seed=1, steps=4), summary)
    if text is None:
        assert "VAE decoder" not in infotext
    else:
        assert f", {text}," in infotext
    assert settings_from_infotext(infotext)["seed"] == 1  # still a valid parameters text


def test_spectrum_keys_restore_the_numbers_written_not_todays_setting():
    text = 'a cat\nSteps: 20, Seed: 1, Size: 64x64, Spectrum: on, Spectrum forecaster: reuse, Spectrum config: "window=3, flex=1.0, warmup=4, stop=0.9"'
    params = settings_from_infotext(text)["spectrum_params"]
    assert params == {"setting": "on", "forecaster": "reuse", "window": 3, "flex": 1.0, "warmup": 4, "stop": 0.9}


def test_images_from_before_the_forecaster_choice_restore_sdcpps_forecast():
    text = 'a cat\nSteps: 20, Seed: 1, Size: 64x64, Spectrum: on, Spectrum config: "w=0.4, window=2"'
    params = settings_from_infotext(text)["spectrum_params"]
    assert params["forecaster"] == "sdcpp" and params["setting"] == "on" and params["w"] == 0.4


@pytest.mark.parametrize("spectrum, word", [("Spectrum: turbo", "turbo"), ('Spectrum: on, Spectrum config: "wz=1"', "wz"),
                                            ('Spectrum: on, Spectrum config: "window=two"', "malformed"),
                                            ("Spectrum: on, Spectrum forecaster: magic", "forecaster")])
def test_bad_spectrum_keys_are_user_errors(spectrum, word):
    with pytest.raises(UserError, match=word):
        settings_from_infotext(f"a cat\nSteps: 20, Seed: 1, Size: 64x64, {spectrum}")


def test_empty_prompt_round_trips():
    request = GenerationRequest(prompt="", negative="", seed=5, steps=3, cfg=1.0, width=64, height=64)
    settings = settings_from_infotext(format_infotext(request, {}))
    assert settings["prompt"] == "" and settings["seed"] == 5 and settings["spectrum"] is False


def test_a1111_settings_restore():
    settings = settings_from_infotext(A1111_TEXT)
    assert (settings["width"], settings["height"], settings["cfg"], settings["spectrum"]) == (512, 768, 7.0, False)


def test_text_without_parameters_is_a_user_error():
    with pytest.raises(UserError, match="lacks"):
        settings_from_infotext("just a caption, nothing else")


@pytest.mark.parametrize("seconds,text", [(3.14, "3.1s"), (42, "42s"), (83.2, "1m23s"), (3725, "1h02m")])
def test_format_seconds(seconds, text):
    assert format_seconds(seconds) == text


def test_the_scanner_finds_what_a1111s_regex_finds():
    # Random lines over the characters the pattern cares about (key characters, colons, commas, quotes, backslashes,
    # Unicode letters, digits and spaces): every one gives the same pairs.
    alphabet = list("abZ1_ ::,,\"\"\\\\-/.x") + ["é", "²", "½", "\t", "\x1c", "\xa0", "\u2028"]
    rng = random.Random(0)
    for _ in range(20000):
        line = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 24)))
        assert param_pairs(line) == A1111_PARAM_RE.findall(line), repr(line)
    assert param_pairs(A1111_TEXT.splitlines()[-1]) == A1111_PARAM_RE.findall(A1111_TEXT.splitlines()[-1])


@pytest.mark.parametrize("line", [
    "a" * 4000,  # no colon anywhere: the regex tries a key at every position and scans to the end each time
    'k: "a, ' * 600,  # quotes that never close: the regex scans to the end from every key
    "x:" + " " * 4000,
], ids=["letters", "open-quotes", "spaces"])
def test_the_regexs_slow_lines_give_the_same_pairs(line):
    assert param_pairs(line) == A1111_PARAM_RE.findall(line)


def test_a_parameters_text_over_the_limit_is_refused_unread():
    text = "p\n" + "a" * 1_000_000  # the 1 KB PNG: 1 MB of text on one line
    with pytest.raises(UserError, match="is 1000002 characters long; the limit is 16384") as info:
        parse_infotext(text)
    assert "\n" not in str(info.value)
    prompt, _, params = parse_infotext("a" * (MAX_INFOTEXT_CHARS - 40) + "\nSteps: 4, Seed: 1, Size: 64x64")
    assert params["Seed"] == "1" and len(prompt) == MAX_INFOTEXT_CHARS - 40
