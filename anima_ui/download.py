"""Getting the official files into a model folder, and preparing them for a backend.

The weights are the official release on Hugging Face (`circlestone-labs/Anima`, `split_files/...`); the release has
no tokenizers, so those come from ComfyUI's bundled copies (`comfy/text_encoders/{qwen25,t5}_tokenizer`), the ones
ComfyUI, Anima's reference implementation, loads. Downloads go to a temp file beside the target, its name unique to the
call, and are renamed when complete, so an interrupted download never looks like a model file and two downloads of
one file (two phones pressing Download) never write into each other's."""

import os
import shutil
import subprocess
import sys
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

from anima_ui.convert import convert_rknn
from anima_ui.errors import UserError
from anima_ui.modelfiles import ModelPaths
from anima_ui.runtime.graphs import graphs_ready

HF_BASE = "https://huggingface.co"
COMFY_RAW = "https://raw.githubusercontent.com/Comfy-Org/ComfyUI/master/comfy/text_encoders"
TAEHV_RAW = "https://github.com/madebyollin/taehv/raw/main/safetensors"
ANIMA_REPO = "circlestone-labs/Anima"


@dataclass(frozen=True)
class Download:
    url: str
    dest: str  # relative to the model folder
    repo: str | None = None  # Hugging Face repo and file, when the file is on the Hub
    repo_file: str | None = None
    optional: bool = False


def download_plan(models_dir, hf_base: str = HF_BASE, comfy_raw: str = COMFY_RAW, taehv_raw: str = TAEHV_RAW) -> list[Download]:
    """The files still missing from `models_dir`, in the layout `ModelPaths.find` reads."""
    def hub(repo, repo_file, dest):
        return Download(f"{hf_base}/{repo}/resolve/main/{repo_file}", dest, repo, repo_file)

    wanted = [
        hub(ANIMA_REPO, "split_files/diffusion_models/anima-base-v1.0.safetensors", "diffusion_models/anima-base-v1.0.safetensors"),
        hub(ANIMA_REPO, "split_files/text_encoders/qwen_3_06b_base.safetensors", "text_encoders/qwen_3_06b_base.safetensors"),
        hub(ANIMA_REPO, "split_files/vae/qwen_image_vae.safetensors", "vae/qwen_image_vae.safetensors"),
    ]
    for folder, files in (("qwen25_tokenizer", ("vocab.json", "merges.txt", "tokenizer_config.json")),
                          ("t5_tokenizer", ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"))):
        wanted += [Download(f"{comfy_raw}/{folder}/{name}", f"tokenizers/{folder}/{name}") for name in files]
    wanted.append(Download(f"{taehv_raw}/taew2_1.safetensors", "vae_approx/taew2_1.safetensors", optional=True))

    root = Path(models_dir)
    have_dit = any((root / "diffusion_models").glob("*.safetensors"))
    return [d for d in wanted
            if not (root / d.dest).is_file() and not (d.dest.startswith("diffusion_models/") and have_dit)]


def download(plan: list[Download], models_dir):
    """Generator: yields one progress line at a time while it fetches every file of `plan`."""
    root = Path(models_dir)
    for number, item in enumerate(plan, 1):
        target = root / item.dest
        target.parent.mkdir(parents=True, exist_ok=True)
        label = f"[{number}/{len(plan)}] {item.dest}"
        yield f"{label}: starting"
        try:
            if item.repo and _have_hub():
                yield from _download_hub(item, target, label)
            else:
                yield from _download_url(item.url, target, label)
        except OSError as exc:
            if item.optional:
                yield f"{label}: skipped (optional; {exc})"
                continue
            raise UserError(f"download of {item.dest} failed ({exc}); check the network and press Download again") from exc
        yield f"{label}: done"


def _have_hub() -> bool:
    try:
        import huggingface_hub  # noqa: F401 -- optional (comes with transformers); without it, plain HTTP
    except ImportError:
        return False
    return True


def _download_hub(item: Download, target: Path, label: str):
    from huggingface_hub import hf_hub_download  # optional: only called when _have_hub()

    yield f"{label}: downloading through huggingface_hub (byte progress in the server log)"
    staging = target.parent / f".download-{uuid.uuid4().hex[:8]}"  # same filesystem as the target: an atomic rename
    try:
        fetched = hf_hub_download(item.repo, item.repo_file, local_dir=staging)
        os.replace(fetched, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _download_url(url: str, target: Path, label: str, chunk_bytes: int = 1 << 22):
    temp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.partial")
    try:
        with urllib.request.urlopen(url, timeout=60) as response, open(temp, "wb") as sink:
            size = int(response.headers.get("Content-Length") or 0)
            done = 0
            while chunk := response.read(chunk_bytes):
                sink.write(chunk)
                done += len(chunk)
                total = f" of {size / 2**20:.0f} MiB" if size else ""
                yield f"{label}: {done / 2**20:.0f} MiB{total}"
        os.replace(temp, target)
    finally:
        temp.unlink(missing_ok=True)


def prepare(models_dir, backend: str, width: int = 512, height: int = 512):
    """Generator: progress lines while the downloaded model is made ready for `backend`: the ONNX export for
    onnx/sim; for rknn `anima-ui prepare` (export and FP16 RKNN conversion, on the board as on a PC), which needs
    the conversion environment .venv-rknn."""
    if backend == "torch":
        return
    paths = ModelPaths.find(models_dir)
    exported, converted = paths.exported_dir(width, height), paths.rknn_dir(width, height)
    if backend == "rknn":
        if graphs_ready(converted):
            return
        if not convert_rknn.VENV_PYTHON.exists():
            yield (f"RKNN graphs for {width}x{height} are missing: make the conversion environment with "
                   "`bash scripts/make_rknn_venv.sh` (on this board or a PC), then press Download again "
                   f"or run `anima-ui prepare --models {models_dir}`")
            return
        yield from _run_cli("prepare", "--models", str(models_dir), "--width", str(width), "--height", str(height))
    elif not graphs_ready(exported):
        yield from _run_cli("export", "--models", str(models_dir), "--width", str(width), "--height", str(height))


def _run_cli(*args):
    """Run an `anima-ui` command in a child process (a crash or kill of the long preparation never takes the
    server with it), yielding its output lines; a failure ends in a UserError with its last line."""
    label = f"anima-ui {args[0]}"
    yield f"{label}: starting"
    process = subprocess.Popen([sys.executable, "-m", "anima_ui", *args], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    last = ""
    for line in process.stdout:
        if line.strip():
            last = line.strip()
            yield f"{label}: {last}"
    if process.wait() != 0:
        raise UserError(f"{label} failed: {last}")
    yield f"{label}: done"
