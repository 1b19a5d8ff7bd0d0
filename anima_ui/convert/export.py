"""`anima-ui export`: the 28 x 3 DiT branch graphs as fixed-shape ONNX (opset 19) for one resolution,
plus manifest.json. The cross-attention K/V of the text are graph inputs (computed once per prompt on
the host by `cross_attention_kv`), not projections inside the graph.

The folder appears whole or not at all: everything is written into a temporary sibling folder that is
renamed into place at the end."""

import importlib.metadata
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch

from anima_ui.errors import UserError
from anima_ui.model.branches import BRANCH_CLASSES, BRANCH_INPUTS
from anima_ui.model.config import BRANCH_KINDS, AnimaConfig
from anima_ui.model.host import block_weights
from anima_ui.runtime.manifest import GraphEntry, Manifest, TensorSpec, sha256_file

OPSET = 19
DTYPES = {"fp32": (torch.float32, "float32"), "fp16": (torch.float16, "float16")}


def branch_input_specs(cfg: AnimaConfig, kind: str, width: int, height: int, batch: int, dtype: str) -> tuple[TensorSpec, ...]:
    """The fixed input shapes of one branch graph at width x height (image tokens N, text tokens S)."""
    if width % 16 or height % 16 or width <= 0 or height <= 0:
        raise UserError(f"{width}x{height}: width and height must be positive multiples of 16")
    tokens = (height // 8 // cfg.patch) * (width // 8 // cfg.patch)
    shapes = {
        "h": ((batch, tokens, cfg.width), True),
        "rope_cos": ((tokens, cfg.head_dim), False),
        "rope_sin": ((tokens, cfg.head_dim), False),
        "k": ((batch, cfg.context_len, cfg.width), True),
        "v": ((batch, cfg.context_len, cfg.width), True),
    }
    return tuple(TensorSpec(name, shapes[name][0], dtype, shapes[name][1]) for name in BRANCH_INPUTS[kind])


def export_branch(module: torch.nn.Module, inputs: tuple[TensorSpec, ...], path: Path) -> None:
    torch_dtype = DTYPES["fp16" if inputs[0].dtype == "float16" else "fp32"][0]
    generator = torch.Generator().manual_seed(0)
    example = tuple(torch.randn(spec.shape, generator=generator).to(torch_dtype) for spec in inputs)
    with warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice, once per graph
        torch.onnx.export(
            module, example, str(path), input_names=[spec.name for spec in inputs], output_names=["out"],
            opset_version=OPSET, dynamo=False, do_constant_folding=True,
        )


def export_graphs(checkpoint, config: AnimaConfig, weights: dict[str, np.ndarray], width: int, height: int, out_dir,
                  dtype: str = "fp32", batch: int = 1, progress=None) -> Manifest:
    """Write the 84 graphs of the model in `weights` for width x height into `out_dir` (replacing it).
    `checkpoint` is the DiT file the weights came from (or the ModelPaths holding it), hashed into the manifest."""
    checkpoint = Path(getattr(checkpoint, "dit", checkpoint))
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: choose fp32 or fp16")
    if batch not in (1, 2):
        raise UserError(f"--batch {batch}: choose 1 (cond and uncond as two calls) or 2 (one batch-2 call)")
    torch_dtype, np_dtype = DTYPES[dtype]
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    temp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.export-", dir=out_dir.parent))
    try:
        graphs = []
        for block in range(config.num_blocks):
            block_state = block_weights(weights, block)
            for kind in BRANCH_KINDS:
                inputs = branch_input_specs(config, kind, width, height, batch, np_dtype)
                file = f"block{block:02d}_{kind}.onnx"
                module = BRANCH_CLASSES[kind](block_state).eval().to(torch_dtype)
                export_branch(module, inputs, temp / file)
                output = TensorSpec("out", inputs[0].shape, np_dtype, True)
                graphs.append(GraphEntry(file, block, kind, inputs, (output,), sha256_file(temp / file)))
                if progress:
                    progress(f"exported {file}")
        manifest = Manifest(
            format="onnx", width=width, height=height, batch=batch, dtype=dtype, graphs=graphs,
            source={"file": checkpoint.name, "sha256": sha256_file(checkpoint)},
            tools={"opset": OPSET, **{name: _version(name) for name in ("anima-ui", "torch", "onnx", "onnxruntime")}},
        )
        manifest.write(temp)
        _move_into_place(temp, out_dir)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return manifest


def _move_into_place(temp: Path, out_dir: Path) -> None:
    old = None
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
        out_dir.rename(old)
    temp.rename(out_dir)
    if old is not None:
        shutil.rmtree(old)


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
