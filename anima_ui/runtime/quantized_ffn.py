"""W8A8 + FP16 low-rank FFN graphs in a graphs folder, as `anima-ui prepare --ffn w8a8-lowrank` installs them
(docs/quantized_ffn.md): what the runtime, `verify`, `doctor`, the PNG parameters and the status panel read.

A quantized block's `mlp` entry in manifest.json keeps its FP16 graph and gains extra["w8a8_lowrank"]:
  file, sha256     the quantized graph (input x/λ1, output the FFN's, same shapes as the FP16 graph)
  smooth_in        λ1 [D] (.npy): the host folds 1/λ1 into that block's FFN modulation
  check            (.npz) inputs the graph takes and the toolkit simulator's outputs on them, saved when the graph
                   was built: on the board, the NPU's outputs on the same inputs must match them
  rank, alpha1, alpha2
Only a folder whose blocks passed the per-block gate, the conversion checks and the end-to-end gate gets them;
the runtime runs them with ffn="w8a8-lowrank" (the default "auto" does when any are installed). NumPy only."""

import dataclasses

import numpy as np

from anima_ui.errors import UserError
from anima_ui.runtime.graphs import ready_graph_folders
from anima_ui.runtime.manifest import Manifest

KEY = "w8a8_lowrank"
RUNS_QUANTIZED = "runs_w8a8_lowrank"  # set in the extra of an entry swapped to its quantized graph (the sim times it so)
FFN_CHOICES = ("auto", "fp16", "w8a8-lowrank")
MIN_BOARD_COSINE = 0.9999  # the FP16 gate of verify and of the conversion's simulator check


def quantized_blocks(manifest: Manifest) -> list[int]:
    return sorted(g.block for g in manifest.graphs if g.kind == "mlp" and KEY in g.extra)


def resolve_ffn(ffn: str, manifest: Manifest) -> str:
    """"auto" -> "w8a8-lowrank" when the folder has quantized FFNs, else "fp16"."""
    if ffn not in FFN_CHOICES:
        raise UserError(f"--ffn {ffn!r}: choose one of {', '.join(FFN_CHOICES)}")
    if ffn == "auto":
        return "w8a8-lowrank" if quantized_blocks(manifest) else "fp16"
    if ffn == "w8a8-lowrank" and not quantized_blocks(manifest):
        raise UserError("this graphs folder has no quantized FFNs: run `anima-ui prepare --ffn w8a8-lowrank` (after "
                        "`anima-ui calibrate` where the real weights are), or use --ffn fp16")
    return ffn


def with_quantized_ffns(manifest: Manifest, folder) -> tuple[Manifest, dict[int, np.ndarray]]:
    """The manifest with each quantized block's mlp entry pointing at its quantized graph, and λ1 per block."""
    scales, graphs = {}, []
    for g in manifest.graphs:
        q = g.extra.get(KEY) if g.kind == "mlp" else None
        if q is None:
            graphs.append(g)
            continue
        path = folder / q["smooth_in"]
        if not path.is_file() or not (folder / q["file"]).is_file():
            raise UserError(f"{folder} lists a quantized FFN for block {g.block} but {q['file']} or {q['smooth_in']} is "
                            "missing: run `anima-ui prepare --ffn w8a8-lowrank` again")
        scales[g.block] = np.load(path).astype(np.float32)
        graphs.append(dataclasses.replace(g, file=q["file"], sha256=q["sha256"], extra={**g.extra, RUNS_QUANTIZED: True}))
    return dataclasses.replace(manifest, graphs=graphs), scales


def swap_in(graph_sets: dict, variant, ffn: str) -> tuple[dict, dict[int, np.ndarray], str]:
    """The runtime's graph sets ({graph batch: (folder, manifest)}) with the quantized FFN graphs swapped into the set
    the FFN's variant (`variant`, a runtime.variants.Variant) runs, λ1 per quantized block, and what the PNG
    parameters say (see describe). `prepare` installs quantized graphs for batch-1 graphs only: a batch-2 FFN
    variant runs FP16 FFNs under "auto", and "w8a8-lowrank" refuses it."""
    folder, manifest = graph_sets[variant.graph_batch]
    batch1 = graph_sets.get(1)
    if ffn == "w8a8-lowrank" and variant.graph_batch != 1 and batch1 and quantized_blocks(batch1[1]) and not quantized_blocks(manifest):
        raise UserError(f"the FFN's variant {variant.name} runs batch-{variant.graph_batch} graphs, and the quantized FFNs "
                        f"are installed for batch-1 graphs only: give the FFN a batch-1 variant (e.g. --variant "
                        f"mlp=two-chains) or use --ffn fp16")
    described = describe(manifest, ffn)
    if resolve_ffn(ffn, manifest) == "fp16":
        return graph_sets, {}, described
    manifest, scales = with_quantized_ffns(manifest, folder)
    return {**graph_sets, variant.graph_batch: (folder, manifest)}, scales, described


def board_check(folder, manifest: Manifest, backend, core_mask: str = "auto") -> list[dict]:
    """Each quantized graph run by `backend` (on the board: RKNN-Lite on the NPU) on its saved inputs, against the
    simulator's saved outputs: {"block", "cosine", "rel_error", "nonfinite", "passed"} per block."""
    quantized, _ = with_quantized_ffns(manifest, folder)
    rows = []
    for block in quantized_blocks(manifest):
        entry = quantized.graph(block, "mlp")
        with np.load(folder / entry.extra[KEY]["check"]) as check:
            inputs, expected = check["inputs"], check["outputs"]
        context = backend.init(backend.load(folder / entry.file, entry), entry, core_mask)
        try:
            outputs = [backend.run(context, entry, [x.astype(backend.input_dtype(entry, 0))]) for x in inputs]
        finally:
            backend.release(context, entry)
        got = np.stack(outputs).astype(np.float64)
        want = np.asarray(expected, np.float64).reshape(got.shape)
        finite = np.isfinite(got)
        a, b = np.where(finite, got, 0).ravel(), want.ravel()
        cosine = float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-300))
        rel = float(np.linalg.norm(a - b) / (np.linalg.norm(b) + 1e-300))
        nonfinite = int((~finite).sum())
        rows.append({"block": block, "cosine": cosine, "rel_error": rel, "nonfinite": nonfinite,
                     "passed": cosine >= MIN_BOARD_COSINE and nonfinite == 0})
    return rows


def describe(manifest: Manifest, ffn: str) -> str:
    """What the PNG parameters and the status panel say: "fp16", or "w8a8-lowrank (blocks 0,1,5)"."""
    if resolve_ffn(ffn, manifest) == "fp16":
        return "fp16"
    return f"w8a8-lowrank (blocks {','.join(str(b) for b in quantized_blocks(manifest))})"


def folder_lines(models_dir) -> list[str]:
    """One Markdown line per converted size saying which blocks' FFNs are quantized (the status panel's)."""
    lines = []
    for folder in ready_graph_folders(models_dir, "rknn"):
        try:
            blocks = quantized_blocks(Manifest.read(folder))
        except UserError:
            continue  # doctor reports a damaged folder
        which = f"W8A8 + low-rank in blocks {','.join(map(str, blocks))}" if blocks else "all FP16"
        lines.append(f"**FFNs** rknn/{folder.name}: {which}")
    return lines
