"""The AUTOMATIC1111 `parameters` text ("infotext") that goes into every saved PNG.

Format and parser follow AUTOMATIC1111/stable-diffusion-webui `modules/processing.py create_infotext()` and
`modules/infotext_utils.py parse_generation_parameters()`, so A1111, Forge, SD.Next and civitai-style readers load
our images, and we load theirs. The text comes from strangers' PNGs: it is capped in length, and the parameters line
is read by a scanner that finds the same pairs as A1111's regex in linear time (the regex, tried at every position,
takes quadratic time on a long line without pairs, and holds the GIL while it does).
"""

import json
import re

from anima_ui.errors import UserError
from anima_ui.limits import check_infotext_length
from anima_ui.sampling.spectrum import PARAMETERS, SETTINGS, canonical

VERSION = "anima-ui 0.1.0"

SIZE_RE = re.compile(r"^(\d+)x(\d+)$")


def quote(value) -> str:
    """A1111 `quote`: values containing a comma, newline or colon become a JSON string."""
    text = str(value)
    if "," not in text and "\n" not in text and ":" not in text:
        return text
    return json.dumps(text, ensure_ascii=False)


def unquote(text: str) -> str:
    if len(text) >= 2 and text[0] == '"' and text[-1] == '"':
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text
    return text


def join_infotext(prompt: str, negative: str, params: dict) -> str:
    """`params` is ordered; keys whose value is None are skipped, like A1111."""
    negative_text = f"\nNegative prompt: {negative}" if negative else ""
    params_text = ", ".join(k if k == v else f"{k}: {quote(v)}" for k, v in params.items() if v is not None)
    return f"{prompt}{negative_text}\n{params_text}".strip()


def parse_infotext(text: str) -> tuple[str, str, dict]:
    """A1111's parser: -> (prompt, negative prompt, params). `Size: WxH` becomes `Size-1` (W) and `Size-2` (H).
    UserError when the text is over the length limit."""
    *lines, last_line = check_infotext_length(text).strip().split("\n")
    pairs = param_pairs(last_line)
    if len(pairs) < 3:
        lines.append(last_line)
        last_line = ""
    prompt_lines, negative_lines = [], []
    in_negative = False
    for line in lines:
        line = line.strip()
        if line.startswith("Negative prompt:"):
            in_negative = True
            line = line[len("Negative prompt:"):].strip()
        (negative_lines if in_negative else prompt_lines).append(line)
    params = {}
    for key, value in pairs if last_line else []:
        value = unquote(value)
        size = SIZE_RE.match(value)
        if size:
            params[f"{key}-1"], params[f"{key}-2"] = size.group(1), size.group(2)
        else:
            params[key] = value
    return "\n".join(prompt_lines), "\n".join(negative_lines), params


def param_pairs(line: str) -> list[tuple[str, str]]:
    """The (key, value) pairs A1111's `re.findall(r'\\s*(\\w[\\w \\-/]+):\\s*("(?:\\\\.|[^\\\\"])+"|[^,]*)(?:,|$)', line)`
    finds, in one pass. Tried at a position, that pattern has one way to match: the key is the whole run of key
    characters after the first word character and must end at a colon; a quoted value ends at the first quote not
    escaped by an odd run of backslashes and must be followed by a comma or the end, else the value runs to the next
    comma. Tables of where each run ends make every try O(1)."""
    n = len(line)
    key_end, space_end, comma, quote = [n] * (n + 1), [n] * (n + 1), [n] * (n + 1), [n] * (n + 1)
    backslashes = [0] * (n + 1)  # backslashes[i]: the length of the backslash run ending just before i
    for i, char in enumerate(line):
        backslashes[i + 1] = backslashes[i] + 1 if char == "\\" else 0
    for i in range(n - 1, -1, -1):
        char = line[i]
        key_end[i] = key_end[i + 1] if char.isalnum() or char in "_ -/" else i
        space_end[i] = space_end[i + 1] if char.isspace() else i
        comma[i] = i if char == "," else comma[i + 1]
        quote[i] = i if char == '"' and backslashes[i] % 2 == 0 else quote[i + 1]
    pairs, pos = [], 0
    while pos < n:
        start = space_end[pos]
        colon = key_end[start + 1] if start < n and (line[start].isalnum() or line[start] == "_") else n
        if colon >= n or colon < start + 2 or line[colon] != ":":
            pos += 1
            continue
        value = space_end[colon + 1]
        close = quote[value + 1] if value < n and line[value] == '"' else n
        if close < n and close > value + 1 and (close + 1 == n or line[close + 1] == ","):
            end = close + 1
        else:
            end = comma[value]
        pairs.append((line[start:colon], line[value:end]))
        pos = end + 1 if end < n else n
    return pairs


def spectrum_config_text(config: dict) -> str:
    """The numbers of a canonical Spectrum config as `key=value, …` (setting and forecaster have their own keys)."""
    return ", ".join(f"{k}={v}" for k, v in config.items() if k in PARAMETERS)


def parse_spectrum_config(text: str) -> dict:
    params = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = (item.strip() for item in part.partition("="))
        if key not in PARAMETERS:
            raise UserError(f"the image's Spectrum config has an unknown parameter {key!r}; it cannot be restored")
        params[key] = PARAMETERS[key][0](value)
    return params


def format_infotext(request, summary: dict) -> str:
    """request: a GenerationRequest (or anything with its fields); summary: the pipeline's ResultEvent summary,
    optionally with "model" (the diffusion model file's stem) added by the caller."""
    seconds = summary.get("seconds", {})
    spectrum = canonical(request.spectrum_params) if request.spectrum else {}
    params = {
        "Steps": request.steps,
        "Sampler": "Euler",
        "Schedule type": "Simple",
        "CFG scale": request.cfg,
        "Seed": request.seed,
        "Size": f"{request.width}x{request.height}",
        "Model": summary.get("model"),
        "Spectrum": spectrum["setting"] if spectrum else "off",
        "Spectrum forecaster": spectrum.get("forecaster"),
        "Spectrum config": spectrum_config_text(spectrum) if spectrum else None,
        "Model evaluations": summary.get("model_evals"),
        "Backend": summary.get("backend"),
        "VAE decoder": decoder_label(summary),
        "FFN": summary["ffn"] if str(summary.get("ffn", "")).startswith("w8a8") else None,  # only when quantized FFNs ran
        "Denoise time": format_seconds(seconds["denoise"]) if "denoise" in seconds else None,
        "Version": VERSION,
    }
    return join_infotext(request.prompt, request.negative, params)


def decoder_label(summary: dict) -> str | None:
    """Which decoder made the image, as the result line and the PNG parameters say it: its name, and for the NPU
    decoder the graph layout that ran ("npu (halo-batch)")."""
    decoder, layout = summary.get("decoder"), summary.get("decoder_layout")
    return f"{decoder} ({layout})" if decoder and layout else decoder


def settings_from_infotext(text: str) -> dict:
    """The form settings an infotext describes; UserError if it has no Seed/Steps/Size (not a generation)."""
    prompt, negative, params = parse_infotext(text)
    missing = [k for k in ("Steps", "Seed", "Size-1", "Size-2") if k not in params]
    if missing:
        raise UserError(f"the image's parameters text lacks {', '.join(missing)}; drop a PNG saved by anima-ui or A1111")
    try:
        settings = {
            "prompt": prompt,
            "negative": negative,
            "seed": int(params["Seed"]),
            "steps": int(params["Steps"]),
            "cfg": float(params.get("CFG scale", 4.0)),
            "width": int(params["Size-1"]),
            "height": int(params["Size-2"]),
        }
        settings.update(_spectrum_settings(params))
    except ValueError as exc:
        raise UserError(f"the image's parameters text has a malformed value ({exc}); it cannot be restored") from exc
    return settings


def _spectrum_settings(params: dict) -> dict:
    """{"spectrum": bool, "spectrum_params": canonical config or {}} from the Spectrum keys of an infotext.
    Images made before the forecaster could be chosen have no "Spectrum forecaster": they used sd.cpp's."""
    setting = params.get("Spectrum", "off")
    if setting == "off":
        return {"spectrum": False, "spectrum_params": {}}
    if setting not in SETTINGS:
        raise UserError(f"the image's Spectrum setting {setting!r} is unknown (expected off, {', '.join(SETTINGS)})")
    config = {"setting": setting, "forecaster": params.get("Spectrum forecaster", "sdcpp")}
    config.update(parse_spectrum_config(params.get("Spectrum config", "")))
    return {"spectrum": True, "spectrum_params": canonical(config)}


def format_seconds(seconds: float) -> str:
    if seconds < 10:
        return f"{seconds:.1f}s"
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
