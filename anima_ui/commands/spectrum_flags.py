"""The Spectrum flags that `generate` and `spectrum-plan` share, made from the one definition of every Spectrum
setting, forecaster and parameter (`anima_ui.sampling.spectrum`), and the config they become."""

from anima_ui.errors import UserError
from anima_ui.sampling.spectrum import DEFAULT_FORECASTER, FORECASTERS, PARAMETERS, SETTINGS, canonical


def add_spectrum_arguments(parser, prefix: str = "spectrum-", names=tuple(PARAMETERS), forecaster: bool = True) -> None:
    """--{prefix}forecaster and one --{prefix}<name> per parameter (expert overrides of the setting)."""
    if forecaster:
        parser.add_argument(f"--{prefix}forecaster", choices=list(FORECASTERS), default=None,
                            help=f"what a forecast step uses (default {DEFAULT_FORECASTER}; docs/spectrum_quality.md)")
    for name in names:
        kind, default, meaning = PARAMETERS[name]
        on, fast = SETTINGS["on"].get(name, default), SETTINGS["fast"].get(name, default)
        parser.add_argument(f"--{prefix}{name}", type=kind, default=None,
                            help=f"{meaning} (default {on}" + (f"; {fast} in fast)" if fast != on else ")"))


def spectrum_config(args, setting: str, prefix: str = "spectrum-") -> dict:
    """The canonical config of a setting ("on" | "fast") with the expert flags that were given on top. UserError
    when expert flags come with the setting "off"."""
    given = {name: value for name, value in _given(args, prefix).items()}
    if setting == "off":
        if given:
            flags = ", ".join(f"--{prefix}{name}" for name in given)
            raise UserError(f"{flags} only apply with Spectrum on: add --spectrum on (or fast)")
        return {}
    return canonical({"setting": setting, **given})


def _given(args, prefix: str) -> dict:
    attribute = prefix.replace("-", "_")
    names = ["forecaster", *PARAMETERS]
    return {name: getattr(args, attribute + name) for name in names if getattr(args, attribute + name, None) is not None}
