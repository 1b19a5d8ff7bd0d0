"""The generation form: turning widget values into a GenerationRequest (with one-line errors), size choices, presets."""

import json
import math
import re
import secrets
from pathlib import Path

from anima_ui.errors import UserError
from anima_ui.files import write_atomically
from anima_ui.limits import MAX_USER_PRESETS, check_preset_name
from anima_ui.request import GenerationRequest
from anima_ui.runtime.graphs import ready_graph_folders
from anima_ui.sampling.spectrum import DEFAULT_FORECASTER, SETTINGS, canonical

# The model card's recommended ~1 MP sizes, plus smaller ones that are quicker on the board.
STANDARD_SIZES = ("1024x1024", "896x1152", "1152x896", "832x1216", "1216x832", "768x768", "512x512")
DEMO_SIZES = ("128x128", "64x64", "256x256")  # a random-weight tiny model: small is plenty
SIZE_RE = re.compile(r"^\s*(\d+)\s*[x×]\s*(\d+)\s*$")
PRESET_KEYS = ("prompt", "negative", "cfg", "steps", "size", "spectrum", "forecaster")
SPECTRUM_CHOICES = ("off", *SETTINGS)


def size_choices(backend: str, paths, demo: bool) -> list[str]:
    """torch: any multiple of 16 (a list to start from); onnx/sim: the exported sizes (others export on first use,
    which takes minutes); rknn: only the converted sizes."""
    if backend == "rknn":
        return _graph_sizes(paths.root, "rknn") if paths is not None else []
    exported = _graph_sizes(paths.root, "exported") if paths is not None else []
    if backend in ("onnx", "sim") and exported:
        return exported
    return list(DEMO_SIZES if demo else STANDARD_SIZES)


def _graph_sizes(models_dir: Path, kind: str) -> list[str]:
    sizes = [p.name for p in ready_graph_folders(models_dir, kind) if SIZE_RE.match(p.name)]
    return sorted(sizes, key=lambda s: [int(n) for n in SIZE_RE.match(s).groups()], reverse=True)


def parse_seed(seed) -> int:
    """'' or -1 means random. Seeds are text in the form: a JS number cannot hold a 64-bit seed exactly."""
    text = str(seed if seed is not None else "").strip()
    if text in ("", "-1"):
        return secrets.randbelow(2**32)
    try:
        return int(text)  # its range is the request's to check
    except ValueError:
        raise UserError(f"seed must be a whole number, or -1 for a random one; got {text!r}") from None


def parse_size(size) -> tuple[int, int]:
    match = SIZE_RE.match(str(size or ""))
    if not match:
        raise UserError(f"size must look like 1024x1024 (width x height); got {size!r}")
    return int(match.group(1)), int(match.group(2))


def _whole(value, name: str) -> int:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise UserError(f"{name} must be a whole number; got {value!r}") from None
    if not math.isfinite(number) or number != int(number):  # NaN and infinity come through the API
        raise UserError(f"{name} must be a whole number; got {value!r}")
    return int(number)


def _number(value, name: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise UserError(f"{name} must be a number; got {value!r}") from None


def spectrum_setting(value) -> str:
    """"off" | "on" | "fast"; True and False (presets and API clients from before the settings) mean on and off."""
    if isinstance(value, bool) or value is None:
        return "on" if value else "off"
    if value not in SPECTRUM_CHOICES:
        raise UserError(f"Spectrum must be one of {', '.join(SPECTRUM_CHOICES)}; got {value!r}")
    return value


def spectrum_config(spectrum, forecaster) -> dict:
    """The request's Spectrum config written out in full ({} when off)."""
    setting = spectrum_setting(spectrum)
    if setting == "off":
        return {}
    return canonical({"setting": setting, "forecaster": forecaster or DEFAULT_FORECASTER})


def build_request(prompt, negative, seed, cfg, steps, size, spectrum, forecaster=DEFAULT_FORECASTER,
                  allowed_sizes=None) -> GenerationRequest:
    """An empty prompt is allowed, as in A1111: with CFG it samples the unconditional direction, a valid picture."""
    width, height = parse_size(size)
    if allowed_sizes is not None and f"{width}x{height}" not in allowed_sizes:
        raise UserError(f"{width}x{height} has no exported graphs on this backend; choose one of {', '.join(allowed_sizes)}")
    return GenerationRequest(
        prompt=str(prompt or ""),
        negative=str(negative or ""),
        seed=parse_seed(seed),
        steps=_whole(steps, "steps"),
        cfg=_number(cfg, "CFG"),
        width=width,
        height=height,
        spectrum=spectrum_setting(spectrum) != "off",
        spectrum_params=spectrum_config(spectrum, forecaster),
    )


# -- presets ------------------------------------------------------------------------------------------------------------
# Two folders: the committed presets (read-only: nobody at the meetup can deface them) and, beside them in the list,
# the ones users saved. A name is in at most one of them.
def list_presets(presets_dir: Path, user_dir: Path) -> list[str]:
    return sorted({p.stem for folder in (presets_dir, user_dir) for p in Path(folder).glob("*.json")})


def load_preset(presets_dir: Path, user_dir: Path, name: str) -> dict:
    stem = Path(str(name)).name
    path = next((p for p in (Path(presets_dir) / f"{stem}.json", Path(user_dir) / f"{stem}.json") if p.is_file()), None)
    if path is None:
        raise UserError(f"no preset named {name!r}; choose one from the list")
    try:
        values = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"preset file {path.name} is not valid JSON ({exc.msg} at line {exc.lineno}); fix or delete it") from None
    preset = {k: values[k] for k in PRESET_KEYS if k in values}
    if "spectrum" in preset:
        preset["spectrum"] = spectrum_setting(preset["spectrum"])
    return preset


def save_preset(presets_dir: Path, user_dir: Path, name: str, values: dict) -> str:
    """Saves the settings (not the seed: a preset is a style, not one picture) into the user folder. Returns the
    preset's file stem."""
    stem = re.sub(r"[^a-z0-9]+", "-", check_preset_name(str(name or "")).lower()).strip("-")
    if not stem:
        raise UserError("give the preset a name (letters or digits) before saving it")
    if (Path(presets_dir) / f"{stem}.json").is_file():
        raise UserError(f"{stem!r} is a built-in preset and stays as it is; save under another name")
    target = Path(user_dir) / f"{stem}.json"
    if not target.is_file() and len(list(Path(user_dir).glob("*.json"))) >= MAX_USER_PRESETS:
        raise UserError(f"there are {MAX_USER_PRESETS} saved presets already, the limit; overwrite one by its name")
    Path(user_dir).mkdir(parents=True, exist_ok=True)
    preset = {k: values[k] for k in PRESET_KEYS if k in values}
    write_atomically(target, lambda f: f.write(json.dumps(preset, indent=1).encode()))
    return stem
