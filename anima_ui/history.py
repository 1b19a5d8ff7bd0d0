"""Finished images on disk: `<outputs>/<name>.png` (with the A1111 `parameters` chunk) and `<name>.json` (settings and
measured summary). Both are written to a temp file and renamed; the JSON is renamed last and is the commit marker, so a
crash leaves either a complete item or nothing that is listed."""

import json
import struct
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, PngImagePlugin
from PIL.PngImagePlugin import PngInfo

from anima_ui.errors import UserError
from anima_ui.files import write_atomically
from anima_ui.infotext import format_infotext, format_seconds, settings_from_infotext
from anima_ui.sampling.spectrum import canonical

# The settings that make two generations the same picture (A/B twins differ only in their Spectrum settings).
TWIN_KEYS = ("prompt", "negative", "seed", "steps", "cfg", "width", "height")


def request_settings(request) -> dict:
    """The JSON-able settings of a GenerationRequest, as stored in sidecars and restored into the form; the Spectrum
    config written out in full (setting, forecaster and every number it uses), {} when Spectrum is off."""
    settings = {k: getattr(request, k) for k in TWIN_KEYS}
    settings["spectrum"] = bool(request.spectrum)
    settings["spectrum_params"] = canonical(request.spectrum_params) if request.spectrum else {}
    return settings


@dataclass(frozen=True)
class HistoryItem:
    name: str
    png_path: Path
    record: dict

    @property
    def settings(self) -> dict:
        return self.record["settings"]

    @property
    def summary(self) -> dict:
        return self.record["summary"]

    @property
    def caption(self) -> str:
        spectrum = f"Spectrum {self.settings['spectrum_params'].get('setting', 'on')}" if self.settings["spectrum"] else "Spectrum off"
        seconds = self.summary.get("seconds", {}).get("denoise")
        timing = f" · {format_seconds(seconds)}" if seconds is not None else ""
        return f"seed {self.settings['seed']} · {spectrum}{timing}"


class History:
    def __init__(self, outputs_dir: Path):
        self.outputs_dir = Path(outputs_dir)
        self.outputs_dir.mkdir(parents=True, exist_ok=True)
        self._read: dict[str, HistoryItem] = {}  # sidecar name -> item: a sidecar is written once and never changes

    def save(self, image: Image.Image, request, summary: dict) -> HistoryItem:
        """request: the GenerationRequest that made `image`; summary: its ResultEvent summary (+ "model")."""
        settings = request_settings(request)
        created = time.time()
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(created))
        spectrum = "spectrum" if settings["spectrum"] else "full"
        name = f"{stamp}-{settings['seed']}-{spectrum}-{uuid.uuid4().hex[:6]}"
        infotext = format_infotext(request, summary)
        png_path = self.outputs_dir / f"{name}.png"
        record = {"name": name, "created": created, "settings": settings, "summary": summary, "infotext": infotext}

        save_png(image, png_path, infotext)
        write_atomically(self.outputs_dir / f"{name}.json",
                         lambda f: f.write(json.dumps(record, indent=1, ensure_ascii=False, default=_plain).encode()))
        return HistoryItem(name, png_path, record)

    def items(self) -> list[HistoryItem]:
        """Newest first. Sidecars without their PNG (deleted by hand) are skipped. Each sidecar is parsed once: the
        gallery and the big screen list the history on every update."""
        found = []
        for sidecar in self.outputs_dir.glob("*.json"):
            png_path = sidecar.with_suffix(".png")
            if not png_path.exists():
                continue
            item = self._read.get(sidecar.name)
            if item is None:
                item = self._read[sidecar.name] = HistoryItem(sidecar.stem, png_path, json.loads(sidecar.read_text()))
            found.append(item)
        return sorted(found, key=lambda item: item.record["created"], reverse=True)

    def get(self, name: str) -> HistoryItem | None:
        sidecar = self.outputs_dir / f"{Path(name).name}.json"
        png_path = sidecar.with_suffix(".png")
        if not (sidecar.exists() and png_path.exists()):
            return None
        return HistoryItem(sidecar.stem, png_path, json.loads(sidecar.read_text()))

    def find_twin(self, settings: dict, spectrum: bool, model: str | None) -> HistoryItem | None:
        """A finished image of the same prompt, seed and settings with Spectrum `spectrum`, from the same model."""
        for item in self.items():
            same = all(item.settings.get(k) == settings.get(k) for k in TWIN_KEYS)
            if same and item.settings["spectrum"] == spectrum and item.summary.get("model") == model:
                if not spectrum or item.settings.get("spectrum_params") == settings.get("spectrum_params"):
                    return item
        return None


def _plain(value):
    """NumPy scalars in a pipeline summary (timings, sigmas) as plain JSON numbers."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def save_png(image: Image.Image, path: Path, infotext: str) -> None:
    """The image as a PNG whose A1111 `parameters` chunk holds `infotext`, written atomically."""
    png_info = PngInfo()
    png_info.add_text("parameters", infotext)
    write_atomically(path, lambda f: image.save(f, format="PNG", pnginfo=png_info))


def settings_from_png(path) -> dict:
    """The generation settings stored in a PNG's `parameters` chunk (ours or A1111's). Only the chunks are read, not
    the pixels; Pillow's own limits (image size, text chunk size) end in a UserError that names them."""
    name = Path(path).name
    try:
        with Image.open(path) as image:
            text = image.info.get("parameters")
    except Image.DecompressionBombError:
        raise UserError(f"{name} is {_png_size(path)} pixels, more than the {2 * Image.MAX_IMAGE_PIXELS} pixels an "
                        "image may have here; drop a PNG made by anima-ui or A1111") from None
    except ValueError as exc:
        if "too large" not in str(exc):
            raise UserError(f"{name} is not a readable image ({exc}); drop a PNG saved by anima-ui") from None
        raise UserError(f"{name} has a compressed text chunk over {PngImagePlugin.MAX_TEXT_CHUNK // 2**20} MB, more "
                        "than a PNG's text may unpack to here; its parameters are not read") from None
    except (OSError, SyntaxError) as exc:
        raise UserError(f"{name} is not a readable image ({exc}); drop a PNG saved by anima-ui") from exc
    if not text:
        raise UserError(f"{name} has no generation parameters; drop a PNG saved by anima-ui or A1111")
    return settings_from_infotext(str(text))


def _png_size(path) -> str:
    """WxH from a PNG's header (its IHDR chunk comes first), for a message; "so many" when it is not a PNG."""
    with open(path, "rb") as f:
        head = f.read(24)
    if len(head) < 24 or head[:8] != b"\x89PNG\r\n\x1a\n" or head[12:16] != b"IHDR":
        return "so many"
    width, height = struct.unpack(">II", head[16:24])
    return f"{width}x{height}"
