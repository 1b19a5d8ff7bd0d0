"""The checks `anima-ui doctor` prints (and the app's status panel shows): the NPU stack bottom up, memory, the
model files and the hashes the manifests record, and one converted graph run on the NPU against its ONNX twin.

Each check is a Row with a status: ok, warn (works, but look), fail (blocks the NPU path; the row says the fix),
absent (no NPU on this machine) or skip (a later check that an earlier failure or a flag left out).
`verdict(rows)` sums them up in one line. Nothing here imports torch: the board has none."""

import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime

from anima_ui import modelfiles
from anima_ui.errors import UserError
from anima_ui.runtime import board, quantized_ffn
from anima_ui.runtime.backends import RknnLiteBackend
from anima_ui.runtime.graphs import ready_graph_folders
from anima_ui.runtime.manifest import MANIFEST, Manifest, sha256_file
from anima_ui.runtime.memory import GIB, read_meminfo, swap_used
from anima_ui.vae.npu_decoder import MIN_BOARD_PSNR, check_npu_decoder, graphs_folder, pick_layout
from anima_ui.vae.npu_graphs import VaeGraphs

MIN_COSINE = 0.9999  # the FP16 gate of `anima-ui verify` and of the conversion's simulator check
APP_NEEDS_GIB = 3.0  # what one generation at 512x512 holds on the board's host
LITE2_PYTHONS = ((3, 7), (3, 12))  # rknn-toolkit-lite2 2.5.0 publishes wheels for these


@dataclass(frozen=True)
class Row:
    check: str
    status: str  # ok | warn | fail | absent | skip
    value: str
    fix: str | None = None


@dataclass(frozen=True)
class Report:
    rows: list[Row]
    npu_present: bool  # an rknpu driver or an NPU device node exists
    arch: str


def collect(models_dir, width: int | None = None, height: int | None = None, quick: bool = False, core_mask: str = "auto",
            root: Path = Path("/"), environ=os.environ, arch: str | None = None, progress=None) -> Report:
    """Every check, in order. quick: leave out the file hashes and the NPU run (seconds instead of minutes).
    root, environ and arch are this machine's unless a test passes others."""
    npu = board.find_npu(root)
    is_arm = (arch or platform.machine()) == "aarch64"
    lite2 = board.find_lite2()
    library = board.find_librknnrt(environ)
    rows = [_machine_row(npu, is_arm, arch or platform.machine())]
    rows += _npu_rows(npu, is_arm)
    rows.append(_lite2_row(lite2, is_arm))
    rows.append(_library_row(library, is_arm))
    models = Path(models_dir)
    graphs = ready_graph_folders(models, "rknn")
    rows.append(_toolkit_row(graphs, library))
    rows += _memory_rows(root)
    rows += _model_rows(models)
    if quick:
        rows.append(Row("hashes", "skip", "left out (--quick)"))
        rows.append(Row("NPU run", "skip", "left out (--quick)"))
        rows.append(Row("NPU decoder", "skip", "left out (--quick)"))
    else:
        rows += _hash_rows(models, progress)
        run, versions = _npu_run(models, graphs, width, height, core_mask, lite2, npu, library)
        rows.append(run)
        rows.append(_decoder_row(models, width, height, core_mask, lite2, npu, library))
        rows += _quantized_rows(graphs, lambda: RknnLiteBackend(npu, library), core_mask, lite2)
        if versions.get("driver") and not npu.driver_version:  # debugfs is root's; the runtime tells everyone
            rows = [Row(r.check, r.status, f"{npu.driver} {versions['driver']} (as the runtime reports it)") if r.check == "NPU driver" else r
                    for r in rows]
    return Report(rows, npu.present, arch or platform.machine())


def verdict(report: Report) -> tuple[bool, str]:
    """(ready, one line): ready when the NPU path works end to end."""
    rows = report.rows
    fails = [r for r in rows if r.status == "fail"]
    warns = [r for r in rows if r.status == "warn"]
    if not report.npu_present:
        return False, (f"no NPU present: this {report.arch} machine has no rknpu driver and no {board.NPU_NODE}, so the rknn "
                       "backend cannot run here; `anima-ui serve` and `anima-ui generate` use --backend auto, which picks onnx or torch")
    if fails:
        names = ", ".join(r.check for r in fails)
        return False, f"not ready for the NPU: {len(fails)} failed check{'s' * (len(fails) > 1)} ({names}); fix them top down and run `anima-ui doctor` again"
    run = next(r for r in rows if r.check == "NPU run")
    note = f" ({len(warns)} warning{'s' * (len(warns) > 1)} above)" if warns else ""
    if run.status == "ok":
        return True, f"ready: the NPU ran a converted graph and matched its ONNX twin{note}; next `anima-ui verify --backend rknn --reference onnx`"
    if run.status == "warn":
        return True, f"the NPU ran a converted graph, but it was not compared with its ONNX twin{note}; `anima-ui verify --backend rknn --reference onnx` checks them all"
    if run.value.startswith("left out"):
        return True, f"the NPU stack is in place{note}; no graph ran (--quick): `anima-ui doctor` runs one on the NPU"
    return False, "the NPU stack is in place, but no converted graph ran: copy converted graphs into the model folder (README, 'On the board')"


# -- the NPU stack -------------------------------------------------------------------------------------------------
def _machine_row(npu: board.NpuDevice, is_arm: bool, arch: str) -> Row:
    python = sys.version_info[:2]
    value = f"{arch}, {npu.soc or 'no Rockchip SoC in the device tree'}, Python {platform.python_version()}"
    if is_arm and not LITE2_PYTHONS[0] <= python <= LITE2_PYTHONS[1]:
        return Row("machine", "fail", value, "rknn-toolkit-lite2 2.5.0 has wheels for Python 3.7-3.12 only: install Python 3.12 "
                                             "(e.g. with pyenv) and run `PYTHON=python3.12 bash scripts/setup.sh`")
    return Row("machine", "ok" if npu.soc else "absent", value)


def _npu_rows(npu: board.NpuDevice, is_arm: bool) -> list[Row]:
    if not npu.present:
        fix = "use a board image whose kernel has Rockchip's RKNPU driver (vendor 5.10/6.1 kernels do)" if is_arm else None
        return [Row("NPU driver", "fail" if is_arm else "absent", "no rknpu driver", fix),
                Row("NPU device", "fail" if is_arm else "absent", f"no {board.NPU_NODE}")]
    version = f" {npu.driver_version}" if npu.driver_version else " (version: reported by the runtime below, or `sudo cat /sys/kernel/debug/rknpu/version`)"
    rows = [Row("NPU driver", "ok" if npu.driver else "warn", f"{npu.driver or 'unknown driver'}{version}")]
    if npu.node is None:
        rows.append(Row("NPU device", "fail", f"driver {npu.driver} loaded, no render node {board.NPU_NODE}",
                        "the kernel's RKNPU driver must be the DRM one (CONFIG_ROCKCHIP_RKNPU_DRM_GEM): use the board vendor's image"))
        return rows
    access = "read-write" if npu.access else "no access"
    rows.append(Row("NPU device", "ok" if npu.access else "fail", f"{npu.node} (group {npu.node_group}): {access} for {npu.user}",
                    npu.access_fix()))
    missing = [g for g in board.NPU_GROUPS if g not in npu.groups]
    groups = f"{npu.user} in {', '.join(g for g in npu.groups if g in board.NPU_GROUPS) or 'neither render nor video'}"
    if not missing or os.getuid() == 0:
        rows.append(Row("groups", "ok", groups + (" (root)" if os.getuid() == 0 else "")))
    else:
        rows.append(Row("groups", "ok" if npu.access else "warn", f"{groups}; not in {', '.join(missing)}",
                        None if npu.access else board.GROUP_FIX))
    return rows


def _lite2_row(lite2: board.Lite2, is_arm: bool) -> Row:
    if lite2.import_error is None:
        return Row("rknn-toolkit-lite2", "ok", lite2.version or "imports (version unknown)")
    if not is_arm:
        return Row("rknn-toolkit-lite2", "absent", "not installed (its wheels are aarch64 only)")
    return Row("rknn-toolkit-lite2", "fail", f"cannot import rknnlite: {lite2.import_error}", board.LITE_FIX)


def _library_row(library: board.Librknnrt, is_arm: bool) -> Row:
    where = f"{library.path}" + (" (LIBRKNNRT_PATH)" if library.path != board.LIBRKNNRT_DEFAULT else "")
    if not library.exists:
        status = "fail" if is_arm else "absent"
        return Row("librknnrt.so", status, f"{where} not found", board.LIBRKNNRT_FIX if is_arm else None)
    version = library.version or "no embedded version string"
    if library.load_error:
        return Row("librknnrt.so", "fail", f"{where} {version}: does not load ({library.load_error})",
                   "it must be the aarch64 build: " + board.LIBRKNNRT_FIX)
    return Row("librknnrt.so", "ok" if library.version else "warn", f"{where} {version}")


def _toolkit_row(graphs: list[Path], library: board.Librknnrt) -> Row:
    """The toolkit each converted size was made with, against the runtime that will load it (runtime >= toolkit)."""
    if not graphs:
        return Row("converted graphs", "skip", "none in the model folder",
                   "make them here or on a PC: `anima-ui prepare --models <folder>` (README, 'On the board')")
    parts, gaps, unknown = [], [], False
    for folder in graphs:
        try:
            toolkit = Manifest.read(folder).tools.get("rknn-toolkit2")
        except UserError as exc:
            return Row("converted graphs", "fail", str(exc), "convert again: `anima-ui prepare --models <folder>`")
        parts.append(f"{folder.name} by rknn-toolkit2 {toolkit}")
        covers = board.runtime_covers(library.version, toolkit)
        gaps += [toolkit] if covers is False else []
        unknown |= covers is None
    value = "; ".join(parts)
    if gaps:
        return Row("converted graphs", "warn", f"{value}; librknnrt.so {library.version} is older",
                   f"not known to be compatible (a gap has given \"Invalid RKNN model version\"); the NPU run below decides; "
                   f"to be safe install librknnrt.so >= {max(gaps, key=board.version_tuple)}")
    if unknown:
        return Row("converted graphs", "warn" if library.exists else "ok", value + "; runtime version unknown, so is compatibility")
    return Row("converted graphs", "ok", f"{value}; librknnrt.so {library.version} >= toolkit: compatible")


# -- memory --------------------------------------------------------------------------------------------------------
def _memory_rows(root: Path) -> list[Row]:
    info = read_meminfo(str(root / "proc/meminfo"))
    total, available = info.get("MemTotal", 0) / GIB, info.get("MemAvailable", 0) / GIB
    status = "ok" if available >= APP_NEEDS_GIB else "warn"
    rows = [Row("memory", status, f"MemTotal {total:.2f} GiB, MemAvailable {available:.2f} GiB",
                None if status == "ok" else f"a 512x512 generation holds about {APP_NEEDS_GIB:g} GiB: stop other programs first")]
    swap_total = info.get("SwapTotal", 0)
    devices = _swap_devices(root)
    value = f"{swap_total / GIB:.2f} GiB, {swap_used(info) / GIB:.2f} GiB used" + (f" ({'; '.join(devices)})" if devices else "")
    rows.append(Row("swap / zram", "ok", value if swap_total else "none"))
    return rows


def _swap_devices(root: Path) -> list[str]:
    try:
        lines = (root / "proc/swaps").read_text().splitlines()[1:]
    except OSError:
        return []
    devices = []
    for line in lines:
        parts = line.split()
        if len(parts) >= 3:
            name = os.path.basename(parts[0])
            kind = "zram, compressed RAM" if name.startswith("zram") else parts[1]
            devices.append(f"{name}: {kind}, {int(parts[2]) / (1 << 20):.2f} GiB")
    return devices


# -- model files and hashes ------------------------------------------------------------------------------------------
def _model_rows(models: Path) -> list[Row]:
    if not models.is_dir():
        return [Row("model files", "warn", f"no model folder {models}", f"put the official files there ({modelfiles.README}) or pass --models")]
    problems, found = [], []
    dits = sorted((models / modelfiles.DIT_DIR).glob("*.safetensors"))
    files = [dits[-1] if dits else models / modelfiles.DIT_DIR / "*.safetensors", models / modelfiles.TEXT_ENCODER, models / modelfiles.VAE]
    files += [models / modelfiles.QWEN_TOKENIZER_DIR / f for f in modelfiles.QWEN_TOKENIZER_FILES]
    files += [models / modelfiles.T5_TOKENIZER_DIR / f for f in modelfiles.T5_TOKENIZER_FILES]
    for path in files:
        if not path.is_file():
            problems.append(f"missing {path.relative_to(models)}")
            continue
        if path.suffix == ".safetensors":
            try:
                modelfiles.check_safetensors(path)
            except UserError as exc:
                problems.append(str(exc))
                continue
            found.append(f"{path.name} {path.stat().st_size / GIB:.2f} GiB")
    if problems:
        return [Row("model files", "warn", "; ".join(problems[:3]) + (f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""),
                    f"download them as {modelfiles.README} says (or in the app)")]
    return [Row("model files", "ok", ", ".join(found) + ", tokenizers")]


def _hash_rows(models: Path, progress) -> list[Row]:
    """What the manifests record against the files: the checkpoint an export came from, every graph, and the ONNX
    manifest a conversion came from."""
    rows = []
    hashes = {}

    def sha(path: Path) -> str:
        if path not in hashes:
            if progress:
                progress(f"hashing {path}")
            hashes[path] = sha256_file(path)
        return hashes[path]

    dits = sorted((models / modelfiles.DIT_DIR).glob("*.safetensors"))
    for kind in ("exported", "rknn"):
        for folder in ready_graph_folders(models, kind):
            try:
                manifest = Manifest.read(folder)
            except UserError as exc:
                rows.append(Row(f"{kind}/{folder.name}", "fail", str(exc), "export or convert that size again"))
                continue
            bad = [g.file for g in manifest.graphs if sha(folder / g.file) != g.sha256]
            notes = []
            if kind == "exported" and manifest.source.get("sha256"):
                dit = next((d for d in dits if d.name == manifest.source.get("file")), None)
                if dit is None:
                    notes.append(f"exported from {manifest.source.get('file')}, which is not in {modelfiles.DIT_DIR}")
                elif sha(dit) != manifest.source["sha256"]:
                    notes.append(f"exported from a different {dit.name} than the one here")
            recorded = manifest.source.get("onnx_manifest_sha256")
            twin = models / "exported" / folder.name / MANIFEST
            if kind == "rknn" and recorded and twin.is_file() and sha(twin) != recorded:
                notes.append(f"converted from other ONNX graphs than exported/{folder.name}")
            status = "fail" if bad else "warn" if notes else "ok"
            value = f"{len(manifest.graphs) - len(bad)}/{len(manifest.graphs)} graphs match the manifest"
            value += (f"; differ: {', '.join(bad[:3])}" if bad else "") + (f"; {'; '.join(notes)}" if notes else "")
            fix = None
            if bad:
                fix = "`anima-ui prepare --models <folder>` rebuilds the graphs that differ (or copy the folder again)"
            elif notes:
                fix = "export (and convert) again from the checkpoint in this folder"
            rows.append(Row(f"hashes {kind}/{folder.name}", status, value, fix))
    return rows or [Row("hashes", "skip", "no exported or converted graphs to check")]


# -- one graph on the NPU --------------------------------------------------------------------------------------------
def check_inputs(entry, seed: int = 0) -> list[np.ndarray]:
    """Inputs at the scale the branch graphs see: unit-RMS activations, RoPE as cos/sin of real rotations."""
    rng = np.random.default_rng(seed)
    arrays = []
    for spec in entry.inputs:
        if spec.name in ("rope_cos", "rope_sin"):
            angles = rng.uniform(0, 2 * np.pi, (spec.shape[0], spec.shape[1] // 2))
            angles = np.concatenate([angles, angles], axis=1)
            arrays.append((np.cos(angles) if spec.name == "rope_cos" else np.sin(angles)).astype(np.float32))
        else:
            arrays.append(rng.standard_normal(spec.shape).astype(np.float32))
    return arrays


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-300))


def _npu_run(models: Path, graphs: list[Path], width, height, core_mask: str, lite2: board.Lite2, npu: board.NpuDevice,
             library: board.Librknnrt) -> tuple[Row, dict]:
    """The NPU run's row, and the runtime's and driver's versions it reported."""
    if lite2.import_error is not None:
        return Row("NPU run", "skip", "needs rknn-toolkit-lite2"), {}
    if not graphs:
        return Row("NPU run", "skip", "no converted graphs to run"), {}
    folder = graphs[0]
    if width and height:
        folder = models / "rknn" / f"{width}x{height}"
        if folder not in graphs:
            return Row("NPU run", "fail", f"no converted graphs in {folder}",
                       f"choose a converted size with --width/--height ({', '.join(g.name for g in graphs)}), or convert this one"), {}
    manifest = Manifest.read(folder)
    entry = min(manifest.graphs, key=lambda g: (folder / g.file).stat().st_size)  # the quickest to load
    inputs = check_inputs(entry)
    backend = RknnLiteBackend(npu, library)
    try:
        context = backend.init(backend.load(folder / entry.file, entry), entry, core_mask)
        try:
            out = backend.run(context, entry, inputs)
        finally:
            backend.release(context, entry)
    except UserError as exc:
        return Row("NPU run", "fail", f"{folder.name}/{entry.file}", str(exc)), {}
    versions = board.parse_sdk_version(backend.sdk_version)
    ran = (f"{folder.name}/{entry.file} ran (runtime {versions.get('api', '?')}, driver {versions.get('driver', '?')}, "
           f"core mask {core_mask})")
    twin_file = entry.extra.get("onnx_file") or Path(entry.file).with_suffix(".onnx").name
    twin = models / "exported" / folder.name / twin_file
    if not twin.is_file():
        return Row("NPU run", "warn", f"{ran}; no ONNX twin {twin} to compare with",
                   f"`anima-ui prepare` writes models/exported/{folder.name} too (or copy it from the PC where it ran)"), versions
    if entry.extra.get("onnx_sha256") and sha256_file(twin) != entry.extra["onnx_sha256"]:
        return Row("NPU run", "warn", f"{ran}; {twin} is not the ONNX graph it was converted from",
                   "copy the matching exported folder from the PC"), versions
    session = onnxruntime.InferenceSession(str(twin), providers=["CPUExecutionProvider"])
    feeds = {spec.name: array.astype(spec_dtype(session, spec.name)) for spec, array in zip(entry.inputs, inputs)}
    expected = session.run(None, feeds)[0]
    value = cosine(out, expected)
    nonfinite = int((~np.isfinite(out)).sum())
    result = f"{ran}; cosine {value:.7f} against {twin.name} on onnxruntime" + (f", {nonfinite} NaN/Inf" if nonfinite else "")
    if value >= MIN_COSINE and not nonfinite:
        return Row("NPU run", "ok", result), versions
    return Row("NPU run", "fail", result + f" (the gate is {MIN_COSINE})",
               "the NPU computes this graph wrongly: report the runtime, driver and toolkit versions above; try another librknnrt.so"), versions


def _decoder_row(models: Path, width, height, core_mask: str, lite2: board.Lite2, npu: board.NpuDevice,
                 library: board.Librknnrt) -> Row:
    """The NPU decoder's gate (`anima-ui verify --decoder npu`) on one converted size. A failure is a warning, not a
    block: the app decodes with sd.cpp unless told otherwise."""
    root = graphs_folder(models / modelfiles.VAE, "rknn", 0, 0).parent
    folders = sorted(p.parent for p in root.glob(f"*/{MANIFEST}"))
    if not folders:
        return Row("NPU decoder", "skip", "no converted decoder graphs (sd.cpp decodes on the CPU)",
                   "`anima-ui prepare --models <folder>` converts them with the branch graphs")
    if lite2.import_error is not None:
        return Row("NPU decoder", "skip", "needs rknn-toolkit-lite2")
    folder = root / f"{width}x{height}" if width and height else folders[0]
    if folder not in folders:
        return Row("NPU decoder", "skip", f"no converted decoder graphs in {folder}",
                   f"converted sizes: {', '.join(f.name for f in folders)}; `anima-ui prepare --width W --height H` makes others")
    try:
        results = check_npu_decoder(folder, RknnLiteBackend(npu, library), core_mask=core_mask)
    except UserError as exc:
        return Row("NPU decoder", "warn", f"{folder.name}: {exc}", "keep --decoder sdcpp (the default) until it runs")
    value = f"{folder.name}: " + ", ".join(f"{layout} {r['psnr']:.1f} dB in {r['seconds']:.1f} s" + (f" ({r['nonfinite']} NaN/Inf)" if r["nonfinite"] else "")
                                           for layout, r in results.items())
    failed = [layout for layout, r in results.items() if not r["ok"]]
    if not failed:
        return Row("NPU decoder", "ok", f"{value} against the fp32 decoder (gate {MIN_BOARD_PSNR:.0f} dB): --decoder npu "
                                        f"works (it runs {pick_layout(VaeGraphs.read(folder))})")
    return Row("NPU decoder", "warn", f"{value}; {', '.join(failed)} below {MIN_BOARD_PSNR:.0f} dB or not finite",
               "keep --decoder sdcpp (the default); report the runtime, driver and toolkit versions above")


def _quantized_rows(graphs: list[Path], make_backend, core_mask: str, lite2: board.Lite2) -> list[Row]:
    """Per converted folder with W8A8 + low-rank FFNs: their graphs on the NPU against the toolkit simulator's
    outputs saved when they were built (and their files against the manifest's hashes)."""
    rows = []
    for folder in graphs:
        try:
            manifest = Manifest.read(folder)
        except UserError:
            continue  # the hashes row reports a damaged manifest
        blocks = quantized_ffn.quantized_blocks(manifest)
        if not blocks:
            continue
        name = f"quantized FFNs rknn/{folder.name}"
        entries = [manifest.graph(b, "mlp").extra[quantized_ffn.KEY] for b in blocks]
        bad = [e["file"] for e in entries if not (folder / e["file"]).is_file() or sha256_file(folder / e["file"]) != e["sha256"]]
        if bad:
            rows.append(Row(name, "fail", f"blocks {blocks}; differ from the manifest: {', '.join(bad[:3])}",
                            "`anima-ui prepare --ffn w8a8-lowrank` installs them again"))
            continue
        if lite2.import_error is not None:
            rows.append(Row(name, "skip", f"blocks {blocks}; their board-vs-simulator check needs rknn-toolkit-lite2"))
            continue
        try:
            checks = quantized_ffn.board_check(folder, manifest, make_backend(), core_mask)
        except UserError as exc:
            rows.append(Row(name, "fail", f"blocks {blocks}", str(exc)))
            continue
        worst = min(checks, key=lambda c: c["cosine"])
        value = (f"blocks {blocks}; NPU vs simulator on saved inputs: worst cosine {worst['cosine']:.7f} (block {worst['block']}), "
                 f"rel err {max(c['rel_error'] for c in checks):.2e}")
        failed = [c["block"] for c in checks if not c["passed"]]
        rows.append(Row(name, "fail", value + f"; blocks {failed} below {quantized_ffn.MIN_BOARD_COSINE}",
                        "prepare without --ffn (FP16 FFNs) and report the runtime, driver and toolkit versions above")
                    if failed else Row(name, "ok", value))
    return rows


def spec_dtype(session, name: str):
    kind = next(i.type for i in session.get_inputs() if i.name == name)
    return np.float16 if kind == "tensor(float16)" else np.float32


# -- the app's status panel ------------------------------------------------------------------------------------------
PANEL_CHECKS = ("NPU driver", "NPU device", "groups", "rknn-toolkit-lite2", "librknnrt.so", "converted graphs", "swap / zram")
_panel_cache = {}


def panel_lines(models_dir, root: Path = Path("/"), environ=os.environ, arch: str | None = None) -> list[str]:
    """The NPU stack as the status panel shows it (Markdown lines): doctor's quick rows, a fix under each failed one.
    The stack is probed at most once a minute (reading librknnrt.so for its version is not free); swap every time."""
    key = (str(models_dir), str(root), arch, int(time.monotonic() // 60))
    if key not in _panel_cache:
        _panel_cache.clear()
        _panel_cache[key] = collect(models_dir, quick=True, root=root, environ=environ, arch=arch)
    report = _panel_cache[key]
    if not report.npu_present:
        return [f"**NPU** none on this {report.arch} machine (`anima-ui doctor` lists what a board needs)"]
    rows = [r for r in report.rows if r.check in PANEL_CHECKS and r.check != "swap / zram"] + _memory_rows(root)[1:]
    lines = []
    for row in rows:
        mark = {"fail": "❌ ", "warn": "⚠️ "}.get(row.status, "")
        lines.append(f"{mark}**{row.check}** {row.value}" + (f" — fix: {row.fix}" if row.fix and row.status in ("fail", "warn") else ""))
    return lines
