"""`anima-ui prepare`: from an empty folder to graphs ready for the board, on a PC or on the board itself.

download the official files -> export the branch graphs (streamed, no torch) -> convert them to FP16 RKNN
in .venv-rknn, each checked on the toolkit's simulator -> manifests. Every step keeps what a killed run
finished: downloads are renamed into place when complete, every graph has its own record (see
export.py and convert_rknn.py), and each manifest is written last. Running it again after a kill redoes
only the unfinished file or graph.

The text encoder needs no graphs here: it runs on the host. A text-encoder graph set would be one more
`export_*` call in the export phase below, with its own folder and manifest, converted the same way, as the
NPU decoder's graphs are (vae/npu_graphs.py: untiled, trunk + halo tiles, trunk + one batch of tiles; each
checked on the simulator in pixel space, into MODELS/vae/npu/<onnx|rknn>/WxH)."""

import dataclasses
import platform
import sys
import time

from anima_ui.convert.convert_rknn import VENV_PYTHON, convert_rknn, toolkit_info
from anima_ui.convert.export import export_graphs
from anima_ui.download import download, download_plan
from anima_ui.errors import UserError
from anima_ui.model.config import BRANCH_KINDS
from anima_ui.modelfiles import ModelPaths
from anima_ui.quant.install import REPORT, install_quantized_ffns
from anima_ui.runtime.memory import peak_rss_bytes, read_meminfo, reset_peak_rss
from anima_ui.runtime.quantized_ffn import quantized_blocks
from anima_ui.vae.npu_decoder import graphs_folder
from anima_ui.vae.npu_graphs import build_vae_graphs, convert_layouts, convert_vae_graphs

PREPARE_FFNS = ("fp16", "w8a8-lowrank")


def prepare(models_dir, width: int = 512, height: int = 512, target: str = "rk3588", mirror: str | None = None,
            python=VENV_PYTHON, jobs: int = 1, out=sys.stderr, decoder: bool = True, ffn: str = "fp16",
            decoder_layouts: list[str] | None = None) -> dict:
    """Run every phase, printing progress to `out`; returns {"rknn": folder, "decoder": folder or None,
    "peaks": {phase: peak RSS MiB}}. decoder=False leaves out the NPU decoder's graphs; decoder_layouts names
    the layouts to convert (default: those whose conversion fits in this machine's memory, convert_layouts).
    ffn "w8a8-lowrank": then also the quantized FFNs (see quantize_ffns)."""
    if ffn not in PREPARE_FFNS:
        raise UserError(f"--ffn {ffn!r}: choose one of {', '.join(PREPARE_FFNS)}")
    # read before anything of ours takes memory; checked before the download so that a bad flag fails at once
    layouts, skipped = convert_layouts(width, height, read_meminfo()["MemAvailable"], decoder_layouts)
    info = toolkit_info(python)  # before a 6 GB download: is there a conversion environment at all?
    report = lambda line: print(line, file=out, flush=True)
    report(f"conversion environment: rknn-toolkit2 {info['rknn-toolkit2']}, Python {info['python']}, "
           f"torch {info['torch'] or 'not installed (not needed for FP16)'}")
    peaks = {}

    reset_peak_rss()
    plan = download_plan(models_dir)
    if mirror:
        plan = [dataclasses.replace(item, url=f"{mirror.rstrip('/')}/{item.dest}", repo=None) for item in plan]
    for line in download(plan, models_dir):
        report(line)
    paths = ModelPaths.find(models_dir)
    peaks["download"] = peak_rss_mib()

    reset_peak_rss()
    exported = paths.exported_dir(width, height)
    bar = ProgressBar("export", out)
    export_graphs(paths, width, height, exported, progress=bar.update)
    peaks["export"] = peak_rss_mib()
    report(f"export: {bar.summary()}; peak RSS {peaks['export']:.0f} MiB")

    converted = paths.rknn_dir(width, height)
    bar = ProgressBar("convert", out)
    convert_rknn(exported, converted, target, python, progress=bar.converted, jobs=jobs)
    peaks["convert (largest graph)"] = max(bar.worker_peaks, default=0.0)
    report(f"convert: {bar.summary()}; peak RSS of one graph's conversion {peaks['convert (largest graph)']:.0f} MiB")

    if ffn == "w8a8-lowrank":
        quantize_ffns(paths, width, height, converted, report)
    decoder_dir = None
    if decoder:
        if skipped:
            report(skipped)
        if layouts:
            decoder_dir = _prepare_decoder(paths, width, height, layouts, target, python, peaks, out, report)

    board = platform.machine() == "aarch64"
    report(f"ready: {converted}" + (f" and {decoder_dir} (try it: anima-ui verify --models {models_dir} --backend rknn "
                                    "--decoder npu, on the board)" if decoder_dir else ""))
    report(f"start the app with: anima-ui serve --models {models_dir} --backend rknn" if board else
           f"start the app here with `anima-ui serve --models {models_dir}` (onnxruntime); on the board, copy "
           f"{models_dir} there and run `anima-ui serve --models {models_dir} --backend rknn`")
    return {"rknn": converted, "decoder": decoder_dir, "peaks": peaks}


def _prepare_decoder(paths, width: int, height: int, layouts: list[str], target: str, python, peaks: dict, out, report):
    """The NPU decoder's ONNX graphs of `layouts`, then their conversion, one graph at a time (a graph's simulator
    check peaks at up to 10.5 GiB at 512x512: npu_graphs.CONVERT_PEAK_GIB_512)."""
    reset_peak_rss()
    onnx_dir = graphs_folder(paths.vae, "onnx", width, height)
    bar = ProgressBar("decoder export", out)
    build_vae_graphs(paths.vae, width, height, onnx_dir, layouts, progress=bar.update)
    report(f"decoder export: {bar.summary()}")
    rknn_dir = graphs_folder(paths.vae, "rknn", width, height)
    bar = ProgressBar("decoder convert", out)
    graphs = convert_vae_graphs(onnx_dir, rknn_dir, target, python, progress=bar.converted)
    peaks["decoder convert (largest graph)"] = max(bar.worker_peaks, default=0.0)
    psnrs = ", ".join(f"{layout} {check['sim_psnr']:.1f} dB" for layout, check in graphs.checks.items())
    report(f"decoder convert: {bar.summary()}; simulator against fp32: {psnrs}; peak RSS of one graph's conversion "
           f"{peaks['decoder convert (largest graph)']:.0f} MiB")
    return rknn_dir


def quantize_ffns(paths, width: int, height: int, converted, report) -> None:
    """W8A8 + low-rank FFNs into the converted folder's manifest. They come from MODELS/quant/WxH, made here from
    MODELS/calibration/WxH (`anima-ui calibrate`, run where the real weights are) when it is not there yet:
    per-block gate, hybrid RKNN build with its checks, end-to-end gate on the exported fp32 graphs. Only a folder
    that passed every gate is installed (quant.install says why not otherwise)."""
    # here, not at the top: quant.build loads the pipeline and with it transformers (the tokenizers), which export
    # and conversion do not need; prepare without --ffn starts without them
    from anima_ui.quant.build import quantize_models_folder

    quant_dir = paths.root / "quant" / f"{width}x{height}"
    if not (quant_dir / REPORT).is_file():
        report(f"quantizing the FFNs from {paths.root / 'calibration' / f'{width}x{height}'} (per-block gate, RKNN builds, "
               "end-to-end gate; hours at full size) ...")
        quantize_models_folder(paths.root, width, height, convert=True, backend="onnx", progress=report)
    manifest = install_quantized_ffns(converted, quant_dir)
    blocks = quantized_blocks(manifest)
    report(f"quantized FFNs: W8A8 + low-rank in {len(blocks)} of {len(manifest.graphs) // 3} blocks ({', '.join(map(str, blocks))})")


class ProgressBar:
    """`phase n/N file, s per graph, ETA` on one line (redrawn in a terminal, a line per graph otherwise).
    The ETA weighs the remaining graphs by the mean time of their kind in this run (an FFN takes longer)."""

    def __init__(self, phase: str, out):
        self.phase, self.out = phase, out
        self.seconds: dict[str, list[float]] = {}
        self.started = time.perf_counter()
        self.kept = 0
        self.worker_peaks: list[float] = []  # MiB, of each graph a conversion worker built

    def converted(self, done: int, total: int, file: str, seconds: float, reused: bool, result: dict) -> None:
        """A conversion's progress callback: the line, and the peak RSS of the worker that built the graph."""
        if not reused:
            self.worker_peaks.append(result["peak_rss_mib"])
        self.update(done, total, file, seconds, reused)

    def update(self, done: int, total: int, file: str, seconds: float, reused: bool) -> None:
        kind = next((k for k in BRANCH_KINDS if k in file), "")
        if reused:
            self.kept += 1
        else:
            self.seconds.setdefault(kind, []).append(seconds)
        state = "kept" if reused else f"{seconds:.1f} s"
        line = f"{self.phase} {done}/{total} {file} ({state}), ETA {self._eta(done, total)}"
        tty = getattr(self.out, "isatty", lambda: False)()
        print(f"\r{line:<100}" if tty else line, end="\n" if not tty or done == total else "", file=self.out, flush=True)

    def _eta(self, done: int, total: int) -> str:
        if not self.seconds:
            return "-"
        every = [s for times in self.seconds.values() for s in times]
        per_kind = {k: sum(v) / len(v) for k, v in self.seconds.items()}
        # the remaining graphs follow the fixed cycle self_attn, cross_attn, mlp
        remaining = sum(per_kind.get(BRANCH_KINDS[i % 3], sum(every) / len(every)) for i in range(done, total))
        return _clock(remaining)

    def summary(self) -> str:
        built = sum(len(v) for v in self.seconds.values())
        per_kind = ", ".join(f"{k} {sum(v) / len(v):.1f} s" for k, v in self.seconds.items())
        return (f"{built} built, {self.kept} kept from an earlier run, {_clock(time.perf_counter() - self.started)}"
                + (f" (mean per graph: {per_kind})" if per_kind else ""))


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def peak_rss_mib() -> float:
    return peak_rss_bytes() / 2**20
