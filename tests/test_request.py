"""GenerationRequest: every limit checked once, when the request is made, with one-line errors."""

import pytest

from anima_ui import request as request_module
from anima_ui.errors import UserError
from anima_ui.limits import (MAX_CFG, MAX_PROMPT_CHARS, MAX_PROMPT_NESTING, MAX_PROMPT_WEIGHT, MAX_SEED, MAX_SIDE,
                             MAX_STEPS, MIN_SIDE, SIZE_MULTIPLE)
from anima_ui.request import GenerationRequest


def test_the_limits_themselves_are_accepted():
    GenerationRequest("p", seed=MAX_SEED, steps=MAX_STEPS, cfg=MAX_CFG, width=MAX_SIDE, height=MIN_SIDE)
    GenerationRequest("p", seed=0, steps=1, cfg=0, width=MIN_SIDE, height=MAX_SIDE)
    deep = "(" * MAX_PROMPT_NESTING + "x" + ")" * MAX_PROMPT_NESTING
    GenerationRequest("a" * MAX_PROMPT_CHARS, negative=deep + f"(y:{MAX_PROMPT_WEIGHT:g}) (z:{-MAX_PROMPT_WEIGHT:g})")


@pytest.mark.parametrize("fields, word", [
    ({"steps": 0}, "steps"), ({"steps": MAX_STEPS + 1}, "steps"), ({"steps": 2.0}, "steps"), ({"steps": True}, "steps"),
    ({"seed": -1}, "seed"), ({"seed": MAX_SEED + 1}, "seed"), ({"seed": "7"}, "seed"),
    ({"cfg": -0.5}, "CFG"), ({"cfg": MAX_CFG + 0.5}, "CFG"), ({"cfg": float("nan")}, "CFG"), ({"cfg": "4"}, "CFG"),
    ({"width": MIN_SIDE - SIZE_MULTIPLE}, "width"), ({"height": MAX_SIDE + SIZE_MULTIPLE}, "height"),
    ({"width": MIN_SIDE + 8}, "width"), ({"prompt": None}, "prompt"),
    ({"prompt": "a" * (MAX_PROMPT_CHARS + 1)}, f"the prompt is {MAX_PROMPT_CHARS + 1} characters long; the limit is"),
    ({"negative": "b" * (MAX_PROMPT_CHARS + 1)}, "the negative prompt is"),
    ({"prompt": "(" * (MAX_PROMPT_NESTING + 1) + "x" + ")" * (MAX_PROMPT_NESTING + 1)},
     f"nests parentheses {MAX_PROMPT_NESTING + 1} deep; the limit is {MAX_PROMPT_NESTING}"),
    ({"prompt": "(cat:1e309)"}, r"the weight in '\(cat:1e309\)' is out of range"),
    ({"negative": "(cat:nan)"}, "weight"), ({"prompt": f"(cat:{MAX_PROMPT_WEIGHT + 0.5})"}, "weight"),
    ({"spectrum": True, "spectrum_params": {"stop": 1.5}}, "stop"), ({"spectrum": True, "spectrum_params": {"x": 1}}, "x"),
])
def test_an_invalid_request_cannot_be_made(fields, word):
    values = {"prompt": "p", **fields}
    with pytest.raises(UserError, match=word) as info:
        GenerationRequest(**values)
    assert "\n" not in str(info.value)


def test_the_spectrum_plan_is_simulated_once_per_request(monkeypatch):
    calls = []
    real_plan = request_module.plan
    monkeypatch.setattr(request_module, "plan", lambda *a, **k: calls.append(a) or real_plan(*a, **k))
    GenerationRequest("p", steps=20, spectrum=True)
    GenerationRequest("p", steps=20)  # Spectrum off: nothing to simulate
    assert calls == [(20,)]
