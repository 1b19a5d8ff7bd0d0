"""`anima-ui bench prepare --models DIR`: what `anima-ui prepare` costs at this model's size, per phase.

(1) export: every branch graph, in a fresh process, as `prepare` runs it: seconds per graph kind and the
    process's peak RSS (VmHWM).
(2) conversion: a sample of --blocks blocks (3 graphs each), one worker, then the same sample with
    --jobs workers: seconds per graph kind (build + simulator check) and each graph's peak RSS.
(3) the projected totals for all graphs, here and on an RK3588: CPU seconds times --board-factor (how many
    times slower a Cortex-A76 core is than a core here). CPU seconds, not wall time, because a machine shared
    with other work stretches wall time.

Run at full size alone (one full-size run at a time, e.g. under `flock`; about 25 min with --blocks 2 on 2 cores)."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from anima_ui.convert.convert_rknn import convert_rknn
from anima_ui.convert.export import export_graphs, record_path
from anima_ui.convert.prepare import peak_rss_mib
from anima_ui.model.config import BRANCH_KINDS
from anima_ui.modelfiles import ModelPaths
from anima_ui.runtime.manifest import Manifest


def add_arguments(parser):
    parser.add_argument("--models", required=True, help="model folder (e.g. a full-size random model)")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--height", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=2, help="blocks whose 3 graphs are converted as the sample")
    parser.add_argument("--jobs", type=int, default=2, help="workers for the parallel conversion row")
    parser.add_argument("--board-factor", type=float, default=1.5,
                        help="how many times slower one RK3588 Cortex-A76 core is than one core here. 1.5 by default: on "
                             "7-Zip's single-thread benchmark a ROCK 5B A76 core rates 3146 MIPS (sbc-bench's published "
                             "result) and the AMD EPYC (Zen 3) cores of the machine this was written on 2900-3150, i.e. ~1x "
                             "for integer work; Zen 3's 256-bit SIMD against the A76's 128-bit NEON can make the numeric "
                             "parts up to ~2x slower on the board")
    parser.add_argument("--work", help="keep the export here (reused by the next run) instead of a temp folder")


def run(args) -> int:
    work = Path(args.work or tempfile.mkdtemp(prefix="anima-bench-prepare-"))
    work.mkdir(parents=True, exist_ok=True)
    onnx_dir = work / "onnx"
    command = [sys.executable, "-m", "anima_ui.bench.prepare", str(ModelPaths.find(args.models).dit), str(onnx_dir),
               str(args.width), str(args.height)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stderr[-2000:], file=sys.stderr)
        return 1
    export = json.loads(done.stdout.strip().splitlines()[-1])
    manifest = Manifest.read(onnx_dir)
    blocks = manifest.cycle()[-1][0] + 1

    sample = _sample_folder(onnx_dir, manifest, args.blocks, work / "sample")
    serial = _convert(sample, work / "rknn-serial", 1)
    parallel = _convert(sample, work / "rknn-parallel", args.jobs)

    factor = args.board_factor
    print(f"anima-ui prepare at {args.width}x{args.height}, {blocks} blocks ({len(manifest.graphs)} graphs), "
          f"{os.cpu_count()} cores here, load average {os.getloadavg()[0]:.1f} at the end")
    print(f"{'phase (seconds per graph: wall / CPU)':<40} {'self_attn':>11} {'cross_attn':>11} {'mlp':>11} {'peak RSS MiB':>12} "
          f"{'all, here (CPU)':>15} {f'board (CPU x{factor:g})':>17}")
    for name, row in ((f"export (fresh process, all graphs)", export), ("convert, 1 worker (sample)", serial)):
        total = sum(row["cpu"][k] * blocks for k in BRANCH_KINDS)
        cells = " ".join(f"{row['seconds'][k]:5.1f}/{row['cpu'][k]:<5.1f}" for k in BRANCH_KINDS)
        print(f"{name:<40} {cells} {row['peak_rss_mib']:12.0f} {_clock(total):>15} {_clock(total * factor):>17}")
    speedup = serial["wall"] / parallel["wall"]
    print(f"{f'convert, {args.jobs} workers (same sample)':<40} {'':>35} {parallel['peak_rss_mib']:12.0f}")
    print(f"export wall time, all graphs: {_clock(export['wall'])}")
    print(f"sample: blocks 0..{args.blocks - 1} ({3 * args.blocks} graphs); conversion wall {serial['wall']:.0f} s with 1 worker, "
          f"{parallel['wall']:.0f} s with {args.jobs} ({speedup:.2f}x); conversion peak = the largest graph's worker VmHWM")
    board = sum((export["cpu"][k] + serial["cpu"][k]) * blocks for k in BRANCH_KINDS) * factor
    print(f"projected prepare on the board (export + 1-worker conversion, CPU seconds x{factor:g}): {_clock(board)}")
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _sample_folder(onnx_dir: Path, manifest: Manifest, blocks: int, folder: Path) -> Path:
    """The first `blocks` blocks of an export as a folder of their own (links, and a manifest of just them)."""
    folder.mkdir(parents=True, exist_ok=True)
    manifest = dataclasses.replace(manifest, graphs=[g for g in manifest.graphs if g.block < blocks])
    for g in manifest.graphs:
        for name in (g.file, record_path(onnx_dir, g.file).name):
            if not (folder / name).exists():
                os.link(onnx_dir / name, folder / name)
    manifest.write(folder)
    return folder


def _convert(sample: Path, out: Path, jobs: int) -> dict:
    results = []
    started = time.perf_counter()
    convert_rknn(sample, out, progress=lambda *event: results.append(event[5]) if not event[4] else None, jobs=jobs)
    wall = time.perf_counter() - started
    seconds = {k: _mean([r["build_seconds"] + r["check_seconds"] for r in results if k in r["file"]]) for k in BRANCH_KINDS}
    cpu = {k: _mean([r["cpu_seconds"] for r in results if k in r["file"]]) for k in BRANCH_KINDS}
    return {"seconds": seconds, "cpu": cpu, "wall": wall,
            "peak_rss_mib": max((r["peak_rss_mib"] for r in results), default=float("nan"))}


def _mean(values):
    return sum(values) / len(values) if values else float("nan")


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _export_in_this_process(checkpoint: str, out: str, width: int, height: int) -> None:
    """The export phase exactly as `prepare` runs it; prints its per-kind seconds and this process's peak RSS."""
    seconds, cpu = {k: [] for k in BRANCH_KINDS}, {k: [] for k in BRANCH_KINDS}
    cpu_before = [time.process_time()]

    def progress(done, total, file, elapsed, reused):
        now = time.process_time()
        if not reused:
            kind = next(k for k in BRANCH_KINDS if k in file)
            seconds[kind].append(elapsed)
            cpu[kind].append(now - cpu_before[0])
        cpu_before[0] = now

    started = time.perf_counter()
    export_graphs(checkpoint, width, height, out, progress=progress)
    print(json.dumps({"seconds": {k: _mean(v) for k, v in seconds.items()}, "cpu": {k: _mean(v) for k, v in cpu.items()},
                      "wall": time.perf_counter() - started, "peak_rss_mib": peak_rss_mib()}))


if __name__ == "__main__":
    _export_in_this_process(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
