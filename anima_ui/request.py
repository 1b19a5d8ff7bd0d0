"""What one generation is asked to do. A `GenerationRequest` is checked once, when it is made, against the limits in
`anima_ui.limits`: an invalid request cannot exist, so the form, the job manager, `anima-ui generate` and the
pipeline take any request they are handed as valid. (The prompts' token counts need the model's tokenizer: the text
encoder checks them, before it runs.)"""

from dataclasses import dataclass, field

from anima_ui.errors import UserError
from anima_ui.limits import check_cfg, check_prompt_length, check_seed, check_side, check_steps
from anima_ui.sampling.spectrum import plan
from anima_ui.text.prompt_weights import parse_prompt_weights


@dataclass(frozen=True)
class GenerationRequest:
    prompt: str
    negative: str = ""
    seed: int = 0
    steps: int = 20
    cfg: float = 4.0
    width: int = 512
    height: int = 512
    spectrum: bool = False
    spectrum_params: dict = field(default_factory=dict)
    decode: bool = True

    def __post_init__(self):
        if not isinstance(self.prompt, str) or not isinstance(self.negative, str):
            raise UserError("the prompt and the negative prompt must be text")
        for name, text in (("prompt", self.prompt), ("negative prompt", self.negative)):
            parse_prompt_weights(check_prompt_length(name, text))  # raises UserError naming a bad nesting or weight
        check_steps(self.steps)
        check_seed(self.seed)
        check_cfg(self.cfg)
        check_side("width", self.width)
        check_side("height", self.height)
        if self.spectrum:
            plan(self.steps, **self.spectrum_params)  # raises UserError naming a bad parameter

    @property
    def uses_uncond(self) -> bool:
        """At CFG 1 the uncond pass cannot change x0 (ComfyUI skips it too)."""
        return self.cfg != 1.0
