"""The model folder: where each file of the official release lives (see models/README.md).

`ModelPaths.find(models_dir)` checks that every required file is present and that no safetensors
file is truncated, so a broken download fails at start-up with one line instead of deep in a load."""

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from anima_ui.errors import UserError

README = "models/README.md"

DIT_DIR = "diffusion_models"
TEXT_ENCODER = "text_encoders/qwen_3_06b_base.safetensors"
VAE = "vae/qwen_image_vae.safetensors"
QWEN_TOKENIZER_DIR = "tokenizers/qwen25_tokenizer"
QWEN_TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json")
T5_TOKENIZER_DIR = "tokenizers/t5_tokenizer"
T5_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
TAESD = "vae_approx/taew2_1.safetensors"


@dataclass(frozen=True)
class ModelPaths:
    root: Path
    dit: Path
    text_encoder: Path
    vae: Path
    qwen_tokenizer_dir: Path
    t5_tokenizer_dir: Path
    taesd: Path | None

    @classmethod
    def find(cls, models_dir) -> "ModelPaths":
        root = Path(models_dir)
        if not root.is_dir():
            raise UserError(f"model folder {root} does not exist; create it as described in {README}")
        paths = cls(
            root=root,
            dit=_find_dit(root),
            text_encoder=_require_file(root, TEXT_ENCODER, "Qwen3-0.6B-Base text encoder"),
            vae=_require_file(root, VAE, "Qwen-Image VAE"),
            qwen_tokenizer_dir=_require_dir(root, QWEN_TOKENIZER_DIR, QWEN_TOKENIZER_FILES, "Qwen tokenizer"),
            t5_tokenizer_dir=_require_dir(root, T5_TOKENIZER_DIR, T5_TOKENIZER_FILES, "T5 tokenizer"),
            taesd=(root / TAESD) if (root / TAESD).is_file() else None,
        )
        for path in (paths.dit, paths.text_encoder, paths.vae, paths.taesd):
            if path is not None:
                check_safetensors(path)
        return paths

    def exported_dir(self, width: int, height: int, batch: int = 1) -> Path:
        return self.root / "exported" / _size_folder(width, height, batch)

    def rknn_dir(self, width: int, height: int, batch: int = 1) -> Path:
        return self.root / "rknn" / _size_folder(width, height, batch)


def _size_folder(width: int, height: int, batch: int) -> str:
    """WxH for the batch-1 graphs; WxH-b2 for batch-2 graphs (cond and uncond in one call)."""
    return f"{width}x{height}" + ("" if batch == 1 else f"-b{batch}")


def _find_dit(root: Path) -> Path:
    candidates = sorted((root / DIT_DIR).glob("*.safetensors"))
    if not candidates:
        raise UserError(
            f"missing diffusion model: no {root / DIT_DIR}/*.safetensors; download anima-base-v1.0.safetensors as described in {README}"
        )
    # Release names carry their version (anima-preview, anima-base-v1.0, ...): the newest sorts last.
    return candidates[-1]


def _require_file(root: Path, relative: str, what: str) -> Path:
    path = root / relative
    if not path.is_file():
        raise UserError(f"missing {what}: {path} not found; download it as described in {README}")
    return path


def _require_dir(root: Path, relative: str, files: tuple[str, ...], what: str) -> Path:
    folder = root / relative
    for name in files:
        _require_file(root, f"{relative}/{name}", what)
    return folder


def check_safetensors(path: Path) -> None:
    """Raise UserError if `path` is not a complete safetensors file (header length, JSON header and
    the data size the header promises must all agree with the file size)."""
    read_safetensors_header(path)


def read_safetensors_header(path) -> tuple[dict, int]:
    """(header, offset of the first tensor byte) of a complete safetensors file; a missing, unreadable, damaged or
    truncated file is a UserError that names it."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise _broken(path, f"only {size} bytes")
            (header_len,) = struct.unpack("<Q", prefix)
            if 8 + header_len > size:
                raise _broken(path, f"header of {header_len} bytes does not fit in {size} bytes")
            raw = f.read(header_len)
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror}; check the path and its permissions") from None
    try:
        header = json.loads(raw)
        data_end = max((int(entry["data_offsets"][1]) for key, entry in header.items() if key != "__metadata__"), default=0)
    except (UnicodeDecodeError, ValueError, AttributeError, KeyError, IndexError, TypeError):
        raise _broken(path, "unreadable header") from None
    expected = 8 + header_len + data_end
    if size < expected:
        raise UserError(f"{path} is truncated ({size} bytes of {expected}); download it again as described in {README}")
    return header, 8 + header_len


def _broken(path: Path, problem: str) -> UserError:
    return UserError(f"{path} is not a complete safetensors file ({problem}); download it again as described in {README}")


def missing_message(models_dir) -> str | None:
    """None when the model folder is complete, else the one-line reason ModelPaths.find gives."""
    try:
        ModelPaths.find(models_dir)
    except UserError as exc:
        return str(exc)
    return None
