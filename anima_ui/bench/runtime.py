"""`anima-ui bench runtime`: the split runtime, measured. Every part drives the real runners and reads their own
per-kind phase timings, and steps with the sampler's Euler + CFG (cfg_x0_predictor over runtime.forward).

(a) sim: the simulated board (runtime/sim.py) with the board's latencies at 512x512: every variant side by side
    under each NPU-contention assumption, in board seconds per CFG step, and the total for a 20-step Spectrum image
    (11 computed steps, text encoding and the sd.cpp decode), next to the blog's 120.4 s/step and 1512 s. Runs at
    --time-scale. onnxruntime computes the numbers with a 28-block model of the tiny widths at 256x256: the real
    compute must stay well inside every scaled phase (at 512x512 a cross-attention call alone takes ~7% of its
    board time here), and the board's latencies do not depend on it.
(b) machine: full-size weights at 512x512 on this machine, each variant in its own process (so peak RSS is
    per variant): split onnxruntime (prefetch, resident sessions as MemAvailable allows), the torch reference,
    diffusers' CosmosTransformer3DModel (one step), cross-attention with host K/V vs a projecting graph.
(c) --board: on an RK3588 (or --backend sim anywhere), real steps of the chosen variant: a line per step as it
    goes, then the blog's table per branch kind (load / init / inference / release) and memory."""

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from anima_ui.commands.pipeline_flags import add_runtime_arguments, open_options, runtime_plan
from anima_ui.convert.export import export_graphs
from anima_ui.errors import UserError
from anima_ui.fixtures.model import write_random_model
from anima_ui.fixtures.weights import write_random_dit
from anima_ui.model.branch_graphs import cross_attention_body
from anima_ui.model.checkpoint import load_dit
from anima_ui.model.config import BRANCH_KINDS, AnimaConfig
from anima_ui.model.forward import dit_forward, prepare_kv, prepare_rope
from anima_ui.model.host import EPS, block_weights, cross_attention_kv
from anima_ui.model.onnx_graph import Graph, linear, reshape, rms_norm
from anima_ui.modelfiles import ModelPaths
from anima_ui.runtime import VARIANTS, Plan, board_latency, open_runtime
from anima_ui.runtime.graphs import graphs_ready
from anima_ui.runtime.host_weights import load_host_weights
from anima_ui.runtime.manifest import Manifest, TensorSpec
from anima_ui.runtime.quantized_ffn import KEY
from anima_ui.runtime.memory import GIB, MIB, PAGE, process_memory, read_meminfo, read_vmstat
from anima_ui.sampling.cfg import cfg_x0_predictor
from anima_ui.sampling.euler import euler_steps
from anima_ui.sampling.schedule import simple_sigmas
from anima_ui.sampling.spectrum import plan as spectrum_plan

# torch (and the torch reference's modules, model.reference and model.branches), onnxruntime and diffusers are
# imported where they are used: `--board` runs on a board that has no torch, and each (b) variant runs this module in
# a process of its own and reports that process's peak RSS.

CFG_SCALE = 4.0
SIM_COMPUTE_SIDE = 256  # (a): the size onnxruntime computes at; the simulated latencies are the board's at 512x512


def add_arguments(parser):
    parser.add_argument("--parts", default="sim,machine", help="comma list of: sim, machine (default both)")
    parser.add_argument("--steps", type=int, default=None,
                        help="CFG steps: (a) per variant (default 3: the first opens every context, the rest are steady), "
                             "(b) per variant (default 1), (c) default 3")
    parser.add_argument("--models", help="(b): a full-size model folder (default: write random full-size weights into --work)"
                                         "; (c): the board's model folder")
    parser.add_argument("--work", help="(b): keep the random model and its ONNX export here (reused by the next run); "
                                       "default: a temporary folder, deleted after")
    parser.add_argument("--graphs", help="(b): an exported full-size ONNX folder to reuse (default: export into --work)")
    parser.add_argument("--variants", default="onnx,torch,diffusers,cross_attention",
                        help=f"(b): which of {', '.join(MACHINE_RUNS)} to run")
    parser.add_argument("--board", action="store_true", help="(c): run on an RK3588 with the rknn backend")
    parser.add_argument("--backend", default="rknn", help="(c): backend to measure (rknn on a board; sim to try it anywhere)")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--height", type=int, default=512)
    add_runtime_arguments(parser, profile=False)
    parser.set_defaults(time_scale=0.1)


def run(args) -> int:
    if args.board:
        return board_table(args)
    parts = set(args.parts.split(","))
    if not parts <= {"sim", "machine"}:
        raise UserError(f"--parts {args.parts!r}: use sim, machine or sim,machine")
    if "sim" in parts:
        simulated_board_table(args.time_scale, args.steps or 3, args.max_contexts or 2)
    if "machine" in parts:
        machine_table(args)
    return 0


# -- shared -----------------------------------------------------------------------------------------------------
def conditioning(cfg, weights, width, height, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1, cfg.latent_channels, height // 8, width // 8)).astype(np.float32)
    context = rng.standard_normal((2, cfg.context_len, cfg.context_dim)).astype(np.float32)
    return x, prepare_kv(weights, context), prepare_rope(cfg, height // 8, width // 8)


def cfg_steps(velocity, x, steps: int):
    """The sampler's Euler steps with CFG 4 over `velocity(xs, sigmas)`: yields after each step."""
    return euler_steps(cfg_x0_predictor(velocity, CFG_SCALE), x, simple_sigmas(steps))


def timed_steps(runtime, weights, x, kv, rope, steps: int, on_step=None) -> list[dict]:
    """Run `steps` CFG steps through the runtime; per step: seconds and the runtime's timing counters it added."""
    records = []
    before, started = runtime.timings, time.perf_counter()
    for info in cfg_steps(lambda xs, sigmas: runtime.forward(weights, xs, sigmas, kv, rope), x, steps):
        after, now = runtime.timings, time.perf_counter()
        record = {"seconds": now - started, **_diff(before, after)}
        records.append(record)
        before, started = after, now  # what on_step takes is the next step's host time, and in its seconds
        if on_step:
            on_step(info, record)
    return records


def _diff(before: dict, after: dict) -> dict:
    out = {k: after[k] - before[k] for k in after if k != "per_kind"}
    out["per_kind"] = {kind: {k: after["per_kind"][kind][k] - before["per_kind"][kind][k] for k in after["per_kind"][kind]}
                       for kind in after["per_kind"]}
    return out


def median(values):
    return statistics.median(values) if values else float("nan")


# -- (a) simulated board ------------------------------------------------------------------------------------------
def simulated_board_table(time_scale: float, steps: int, contexts: int) -> None:
    computed = len(spectrum_plan(20)[0])
    cfg = replace(AnimaConfig.tiny(), num_blocks=board_latency.BLOCKS)
    print(f"\n(a) simulated RK3588 board, its latencies at 512x512 (28 blocks), CFG 4, {steps} steps per row "
          f"(s/step: median of the steps after the first), run at time scale {time_scale:g}; board seconds = measured / {time_scale:g}")
    with tempfile.TemporaryDirectory(prefix="anima-bench-sim-") as work:
        checkpoint = Path(work, "anima-bench-28-blocks.safetensors")
        write_random_dit(checkpoint, cfg, 0)
        cfg, weights = load_dit(checkpoint)
        graphs = [Path(work, f"onnx-b{batch}") for batch in (1, 2)]
        for batch, folder in zip((1, 2), graphs):
            export_graphs(checkpoint, SIM_COMPUTE_SIDE, SIM_COMPUTE_SIDE, folder, batch=batch)
        x, kv, rope = conditioning(cfg, weights, SIM_COMPUTE_SIDE, SIM_COMPUTE_SIDE)

        stand_in_quantized_ffns(graphs[0])

        def measure(plan, contention, ffn="fp16"):
            options = {"time_scale": time_scale, "resident": "all", "threads": 1, "contention": contention, "ffn": ffn}
            with open_runtime("sim", graphs, plan, **options) as runtime:
                records = timed_steps(runtime, weights, x, kv, rope, steps)
            steady = records[1:] or records
            per_kind = {kind: median([r["per_kind"][kind]["wall"] for r in steady]) / time_scale for kind in BRANCH_KINDS}
            keys = ("inference", "host", "lifecycle", "lifecycle_exposed")
            return median([r["seconds"] for r in steady]) / time_scale, per_kind, {k: median([r[k] for r in steady]) / time_scale for k in keys}

        rows = []
        for name, variant in VARIANTS.items():
            plan = Plan.uniform(name, contexts=contexts)
            # contention only acts when two contexts run on two cores at once: only the two-chain variant does that
            results = {c: measure(plan, c) for c in (board_latency.CONTENTION if variant.chains == 2 else ["none"])}
            rows.append((name, variant.about, results))
        # the per-kind choice `anima-ui tune` would make here: each kind's fastest variant (wall time in its visits)
        best = {}
        for contention in board_latency.CONTENTION:
            chosen = {kind: min(rows, key=lambda row: row[2].get(contention, row[2]["none"])[1][kind])[0] for kind in BRANCH_KINDS}
            mixed = Plan(chosen, contexts=contexts)
            best[contention] = (mixed, measure(mixed, contention))
        # with W8A8 + low-rank FFNs in every block: the per-kind best with the FFN on its fastest batch-1 variant
        quantized = {}
        for contention, (mixed, _) in best.items():
            batch1 = [row for row in rows if VARIANTS[row[0]].graph_batch == 1]
            ffn_variant = min(batch1, key=lambda row: row[2].get(contention, row[2]["none"])[1]["mlp"])[0]
            plan = Plan({**mixed.variants, "mlp": ffn_variant}, contexts=contexts)
            quantized[contention] = (plan, measure(plan, contention, ffn="w8a8-lowrank"))

    def image_seconds(per_step):
        return board_latency.TEXT_SECONDS + computed * per_step + board_latency.DECODE_SECONDS

    contentions = list(board_latency.CONTENTION)
    head = "".join(f" {'s/step ' + c:>14} {'image ' + c:>13}" for c in contentions)
    print(f"{'variant':<14}{head} {'NPU':>6} {'host':>6} {'lifecycle':>9} {'exposed':>7}   K={contexts}")
    print(f"{'blog (serial)':<14}" + "".join(f" {board_latency.BLOG_SECONDS_PER_STEP:14.1f} {board_latency.BLOG_SPECTRUM_IMAGE_SECONDS:13.0f}" for _ in contentions))
    for name, about, results in rows:
        cells = "".join(f" {results.get(c, results['none'])[0]:14.1f} {image_seconds(results.get(c, results['none'])[0]):13.0f}" for c in contentions)
        t = results["none"][2]
        same = "" if len(results) > 1 else "  (one context at a time: contention does not apply)"
        print(f"{name:<14}{cells} {t['inference']:6.1f} {t['host']:6.1f} {t['lifecycle']:9.1f} {t['lifecycle_exposed']:7.1f}{same}")
    for label, chosen in (("per-kind best", best), ("+ W8A8 FFNs", quantized)):
        for contention, (mixed, result) in chosen.items():
            t = result[2]
            print(f"{label:<14} under {contention}: {result[0]:.1f} s/step, image {image_seconds(result[0]):.0f} s  "
                  f"[{mixed.describe()}]  NPU {t['inference']:.1f} host {t['host']:.1f} lifecycle {t['lifecycle']:.1f} exposed {t['lifecycle_exposed']:.1f}")
    print(f"    image = text encoding {board_latency.TEXT_SECONDS:.1f} s (estimate) + {computed} computed Spectrum steps of 20 x s/step "
          f"+ sd.cpp decode {board_latency.DECODE_SECONDS:.0f} s (blog); forecast steps cost ~0. Goal: <= 50 s/step, <= 480 s per image.")
    print("    NPU = inference seconds summed over cores (two chains: both); host, lifecycle (load+init+release), exposed "
          "(lifecycle a chain waited for): board seconds per step")
    print("    assumptions (runtime/board_latency.py, docs/runtime.md): blog per-model latencies; two cores at once: "
          + ", ".join(f"{c} = each call x{f:.3f}" for c, f in board_latency.CONTENTION.items())
          + f"; core_mask 0_1 / 0_1_2 speed up the conv share (self-attn {board_latency.CONV_SHARE['self_attn']:.2f}, "
          f"cross-attn {board_latency.CONV_SHARE['cross_attn']:.2f}, FFN 1.0) by {board_latency.TENSOR_PARALLEL_SPEEDUP[2]} / "
          f"{board_latency.TENSOR_PARALLEL_SPEEDUP[3]}; a batch-2 call does {board_latency.BATCH2_WORK:g}x the work; loads share one "
          f"storage stream; host ops, init and release share {board_latency.HOST_CORES} host cores; a W8A8 + low-rank FFN "
          f"takes the FP16 one's NPU time / {board_latency.QUANTIZED_FFN_SPEEDUP:.2f} and load x {board_latency.QUANTIZED_FFN_LOAD_SHARE:.2f} "
          "(its timing only: the FP16 graphs compute the numbers; every block quantized, which only a real model's gates can say)")


def stand_in_quantized_ffns(folder: Path) -> None:
    """List each block's FP16 FFN graph as its own quantized graph with λ1 = 1 in `folder`'s manifest: the simulated
    board then times the FFNs as quantized ones (board_latency.QUANTIZED_FFN_SPEEDUP) while computing the FP16
    numbers. For the timing table only: real quantized graphs come from `anima-ui prepare --ffn w8a8-lowrank`."""
    manifest = Manifest.read(folder)
    graphs = []
    for g in manifest.graphs:
        if g.kind == "mlp":
            scale = f"block{g.block:02d}_mlp.ones.npy"
            np.save(folder / scale, np.ones(g.inputs[0].shape[-1], np.float32))
            g = replace(g, extra={**g.extra, KEY: {"file": g.file, "sha256": g.sha256, "smooth_in": scale}})
        graphs.append(g)
    manifest.graphs = graphs
    manifest.write(folder)


# -- (b) this machine, full size --------------------------------------------------------------------------------------
def machine_table(args) -> None:
    steps = args.steps or 1
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(MACHINE_RUNS)
    if unknown:
        raise UserError(f"--variants: unknown {', '.join(sorted(unknown))}; choose from {', '.join(MACHINE_RUNS)}")
    available = read_meminfo()["MemAvailable"] / GIB
    print(f"\n(b) this machine, full-size random weights, {args.width}x{args.height}, {steps} CFG step(s) per variant (batch 2, CFG 4); "
          f"MemAvailable at start {available:.1f} GiB")
    if available < 14 and not args.models:
        raise UserError(f"(b) needs ~14 GiB free (the torch reference holds 8.4 GB of fp32 weights); MemAvailable is {available:.1f} GiB")
    work = Path(args.work or tempfile.mkdtemp(prefix="anima-bench-full-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        models = Path(args.models) if args.models else _random_full_model(work)
        graphs = Path(args.graphs) if args.graphs else work / f"onnx-{args.width}x{args.height}"
        if not graphs_ready(graphs):  # an export kept in --work is reused
            started = time.perf_counter()
            subprocess.run([sys.executable, "-m", "anima_ui", "export", "--models", str(models), "--width", str(args.width),
                            "--height", str(args.height), "--out", str(graphs)], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            size = sum(p.stat().st_size for p in graphs.glob("*.onnx")) / 1e9
            print(f"    export of {len(list(graphs.glob('*.onnx')))} fp32 graphs: {time.perf_counter() - started:.0f} s, {size:.2f} GB")
        results = {}
        for variant in variants:
            command = [sys.executable, "-m", "anima_ui.bench.runtime", variant, str(models), str(graphs), str(args.width),
                       str(args.height), str(1 if variant == "diffusers" else steps), str(args.mem_floor_gib)]
            started = time.perf_counter()
            print(f"    {variant}: started", flush=True)
            done = subprocess.run(command, stdout=subprocess.PIPE, text=True)  # its progress lines go to stderr as they come
            lines = done.stdout.strip().splitlines()
            results[variant] = json.loads(lines[-1]) if done.returncode == 0 and lines else {"error": f"exit {done.returncode} (see above)"}
            results[variant]["process_seconds"] = time.perf_counter() - started
        _print_machine_rows(results)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


def _random_full_model(work: Path) -> Path:
    started = time.perf_counter()
    out = write_random_model(work / "full-model", "full", 0)
    print(f"    random full-size model written in {time.perf_counter() - started:.0f} s")
    return out


def _print_machine_rows(results: dict) -> None:
    print(f"{'variant':<40} {'steps':>5} {'s/step':>7} {'first':>7} {'host s':>7} {'branches s':>10} {'peak RSS GiB':>12} {'process s':>9}")
    names = {"onnx": "split onnxruntime, prefetch K=2, resident", "torch": "torch reference (split, in-process)",
             "diffusers": "diffusers CosmosTransformer3DModel"}
    for variant, r in results.items():
        if variant not in names:
            continue
        if "error" in r:
            print(f"{names[variant]:<40} failed: {r['error'][:80]}")
            continue
        host, branch = r.get("host_seconds"), r.get("branch_seconds")
        print(f"{names[variant]:<40} {r['steps']:5d} {r['step_seconds']:7.1f} {r['first_step_seconds']:7.1f} "
              f"{'-' if host is None else f'{host:.1f}':>7} {'-' if branch is None else f'{branch:.1f}':>10} "
              f"{r['peak_rss_gib']:12.2f} {r['process_seconds']:9.0f}")
    print("    s/step: median over the steps after the first (the first alone when there is one); host, branches: per step")
    onnx, ca = results.get("onnx", {}), results.get("cross_attention", {})
    if "resident" in onnx:
        print(f"    onnx: {onnx['resident']} of {onnx['graphs']} sessions resident (K from MemAvailable at open and the graphs' sizes); "
              f"session creation (init) {onnx['init_first_step']:.1f} s in the first step, {onnx['init_later_steps']:.2f} s in all later "
              f"steps together; inference {onnx['inference']:.1f} s/step")
    if "ca_graph_ms" in ca:
        per_step = 2 * ca["blocks"] * (ca["ca_projecting_ms"] - ca["ca_graph_ms"]) / 1000
        print(f"    cross-attention, block 0, one batch-1 call: graph with host K/V {ca['ca_graph_ms']:.1f} ms vs graph that "
              f"also projects the 512-token context {ca['ca_projecting_ms']:.1f} ms (medians of 5): {per_step:.2f} s per CFG step "
              f"({ca['blocks']} blocks x cond+uncond) saved for {ca['prepare_kv_s']:.2f} s once per prompt (prepare_kv, cond+uncond)")
    elif "error" in ca:
        print(f"    cross-attention comparison failed: {ca['error'][:100]}")


def _peak_rss_gib() -> float:
    """VmHWM: the peak RSS of this process image. (getrusage's ru_maxrss survives fork + exec on Linux, so
    a variant started by a parent that once held the random model would report the parent's peak.)"""
    return process_memory()["peak_rss"] / GIB


def _progress(info, record) -> None:
    print(f"      step {info.index0 + 1}/{info.total}: {record['seconds']:.1f} s, RSS peak so far {_peak_rss_gib():.2f} GiB",
          file=sys.stderr, flush=True)


def _step_summary(seconds: list[float], host: list[float]) -> dict:
    later = seconds[1:] or seconds
    steady_host = host[1:] or host
    step, host_step = median(later), median(steady_host)
    return {"steps": len(seconds), "step_seconds": step, "first_step_seconds": seconds[0], "host_seconds": host_step,
            "branch_seconds": step - host_step}


def _variant_onnx(models, graphs, width, height, steps, mem_floor_gib) -> dict:
    cfg, weights = load_host_weights(ModelPaths.find(models).dit)
    x, kv, rope = conditioning(cfg, weights, width, height)
    with open_runtime("onnx", graphs, prefetch=True, max_contexts=2, mem_floor_gib=mem_floor_gib) as runtime:
        records = timed_steps(runtime, weights, x, kv, rope, steps, _progress)
        resident, total = len(runtime.backend.resident), len(runtime.manifest.graphs)
    later = records[1:]
    return {**_step_summary([r["seconds"] for r in records], [r["host"] for r in records]),
            "inference": median([r["inference"] for r in later or records]), "resident": resident, "graphs": total,
            "init_first_step": records[0]["init"], "init_later_steps": sum(r["init"] for r in later),
            "peak_rss_gib": _peak_rss_gib()}


def _variant_torch(models, graphs, width, height, steps, mem_floor_gib) -> dict:
    from anima_ui.model.reference import TorchBranches  # torch: see the note on imports at the top

    cfg, weights = load_dit(_dit_path(models))
    x, kv, rope = conditioning(cfg, weights, width, height)
    branches = TorchBranches(weights, cfg)
    branch_seconds = [0.0]

    def timed(block, kind, inputs):
        started = time.perf_counter()
        out = branches(block, kind, inputs)
        branch_seconds[0] += time.perf_counter() - started
        return out

    seconds, host = [], []
    started = time.perf_counter()
    for info in cfg_steps(lambda xs, sigmas: dit_forward(weights, timed, xs, sigmas, kv, rope), x, steps):
        seconds.append(time.perf_counter() - started)
        _progress(info, {"seconds": seconds[-1]})
        host.append(seconds[-1] - branch_seconds[0])
        branch_seconds[0], started = 0.0, time.perf_counter()
    return {**_step_summary(seconds, host), "peak_rss_gib": _peak_rss_gib()}


def _variant_cross_attention(models, graphs, width, height, steps, mem_floor_gib) -> dict:
    """Block 0's cross-attention as exported (k, v inputs) vs a graph that also projects the context."""
    import onnxruntime  # see the note on imports at the top
    import torch

    from anima_ui.model.branches import CrossAttentionBranch

    cfg, host = load_host_weights(_dit_path(models))
    rng = np.random.default_rng(0)
    prompt = rng.standard_normal((2, cfg.context_len, cfg.context_dim)).astype(np.float32)
    started = time.perf_counter()
    kv = prepare_kv(host, prompt)
    prepare_kv_s = time.perf_counter() - started
    del host
    entry = Manifest.read(graphs).graph(0, "cross_attn")
    h_spec = entry.inputs[0]
    session = onnxruntime.InferenceSession(str(Path(graphs, entry.file)), providers=["CPUExecutionProvider"])
    h = rng.standard_normal(h_spec.shape).astype(np.float32)
    graph_ms = _median_ms(lambda: session.run(None, {"h": h, "k": kv[0][0][:1], "v": kv[0][1][:1]}))
    del session
    _, state = load_dit(_dit_path(models))
    block = {k: v for k, v in block_weights(state, 0).items() if k.startswith("cross_attn.")}
    del state
    context_spec = TensorSpec("context", (1, cfg.context_len, block["cross_attn.k_proj.weight"].shape[1]), "float32", True)
    graph = _projecting_cross_attention(block, h_spec.shape[1], cfg.context_len)
    session = onnxruntime.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"])
    context = rng.standard_normal(context_spec.shape).astype(np.float32)
    projecting_ms = _median_ms(lambda: session.run(None, {"h": h, "context": context}))
    with torch.inference_mode():  # the two graphs compute the same thing
        k, v = cross_attention_kv(block, context)
        same = CrossAttentionBranch(block)(torch.from_numpy(h), torch.from_numpy(k), torch.from_numpy(v)).numpy()
    got = session.run(None, {"h": h, "context": context})[0]
    assert np.abs(got - same).max() <= 1e-3 * np.abs(same).max(), "projecting CA graph disagrees with host K/V"
    return {"ca_graph_ms": graph_ms, "ca_projecting_ms": projecting_ms, "prepare_kv_s": prepare_kv_s, "blocks": cfg.num_blocks,
            "peak_rss_gib": _peak_rss_gib()}


def _dit_path(models) -> Path:
    return ModelPaths.find(models).dit


def _projecting_cross_attention(block: dict, tokens: int, context_len: int):
    """Cross-attention that computes k/v from the 512-token context inside the graph (what the graphs
    would do without host K/V): k_proj, per-head k_norm, v_proj, then the exported branch's body."""
    width, context_dim = block["cross_attn.k_proj.weight"].shape
    head_dim = block["cross_attn.k_norm.weight"].shape[0]
    split = (1, context_len, width // head_dim, head_dim)
    g = Graph("float32", "ca_projecting")
    h, context = g.input("h", (1, tokens, width)), g.input("context", (1, context_len, context_dim))
    k = rms_norm(g, reshape(g, linear(g, context, block["cross_attn.k_proj.weight"]), split), block["cross_attn.k_norm.weight"], EPS)
    v = reshape(g, linear(g, context, block["cross_attn.v_proj.weight"]), split)
    return g.model({"out": (cross_attention_body(g, block, h, k, v, 1, tokens), (1, tokens, width))})


def _median_ms(fn, repeats=5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1000)
    return median(times)


def _variant_diffusers(models, graphs, width, height, steps, mem_floor_gib) -> dict:
    import torch  # see the note on imports at the top
    from diffusers import CosmosTransformer3DModel
    from diffusers.loaders.single_file_utils import convert_cosmos_transformer_checkpoint_to_diffusers

    cfg, weights = load_dit(_dit_path(models))
    dit = {k: torch.from_numpy(v) for k, v in weights.items() if not k.startswith("llm_adapter.")}
    with torch.device("meta"):
        model = CosmosTransformer3DModel(
            in_channels=cfg.latent_channels + 1, out_channels=cfg.latent_channels, num_attention_heads=cfg.num_heads,
            attention_head_dim=cfg.head_dim, num_layers=cfg.num_blocks, mlp_ratio=cfg.mlp_dim / cfg.width,
            text_embed_dim=cfg.context_dim, adaln_lora_dim=cfg.adaln_lora_dim, max_size=(128, 240, 240),
            patch_size=(1, cfg.patch, cfg.patch), rope_scale=(1.0, cfg.rope_hw_extrapolation, cfg.rope_hw_extrapolation),
            concat_padding_mask=False, extra_pos_embed_type=None,
        )
    model.load_state_dict(convert_cosmos_transformer_checkpoint_to_diffusers(dit), strict=True, assign=True)  # shares memory
    model.eval()
    rng = np.random.default_rng(0)
    latent = torch.from_numpy(rng.standard_normal((2, cfg.latent_channels, 1, height // 8, width // 8)).astype(np.float32))
    context = torch.from_numpy(rng.standard_normal((2, cfg.context_len, cfg.context_dim)).astype(np.float32))
    started = time.perf_counter()
    with torch.inference_mode():
        model(hidden_states=torch.cat([latent, torch.zeros_like(latent[:, :1])], dim=1), timestep=torch.full((2,), 0.9),
              encoder_hidden_states=context, return_dict=False)
    seconds = time.perf_counter() - started
    return {"steps": 1, "step_seconds": seconds, "first_step_seconds": seconds, "peak_rss_gib": _peak_rss_gib()}


MACHINE_RUNS = {"onnx": _variant_onnx, "torch": _variant_torch, "diffusers": _variant_diffusers, "cross_attention": _variant_cross_attention}


# -- (c) on the board -----------------------------------------------------------------------------------------------
def board_table(args) -> int:
    if not args.models:
        raise UserError("--board needs --models DIR (the folder with rknn/WxH from `anima-ui convert-rknn`)")
    steps = args.steps or 3
    plan = runtime_plan(args)
    paths = ModelPaths.find(args.models)
    folder = paths.rknn_dir if args.backend == "rknn" else paths.exported_dir
    graphs = [folder(args.width, args.height, batch) for batch in sorted(plan.graph_batches())]
    cfg, weights = load_host_weights(paths.dit)
    x, kv, rope = conditioning(cfg, weights, args.width, args.height)
    print(f"(c) {args.backend} backend, {args.width}x{args.height}, {steps} CFG steps, {plan.describe()}, graphs in "
          f"{', '.join(map(str, graphs))}", flush=True)
    swap_in_start = read_vmstat().get("pswpin", 0)
    low_available, peak_pss = [float("inf")], [0]

    def on_step(info, record):
        available, pss = read_meminfo()["MemAvailable"], process_memory()["pss"]
        low_available[0], peak_pss[0] = min(low_available[0], available), max(peak_pss[0], pss)
        print(f"step {info.index0 + 1}/{steps}: {record['seconds']:.2f} s (NPU {record['inference']:.2f} s, host {record['host']:.2f} s, "
              f"lifecycle {record['lifecycle']:.2f} s of which exposed {record['lifecycle_exposed']:.2f} s); "
              f"MemAvailable {available / GIB:.2f} GiB, PSS {pss / MIB:.0f} MiB", flush=True)

    with open_runtime(args.backend, graphs, plan, **open_options(args)) as runtime:
        records = timed_steps(runtime, weights, x, kv, rope, steps, on_step)
        gate = runtime.gate_status
    t = runtime.timings
    seconds = [r["seconds"] for r in records]
    print(f"\n{median(seconds[1:] or seconds):.2f} s/step (median of the steps after the first); per step: NPU {t['inference'] / steps:.2f} s, "
          f"host {t['host'] / steps:.2f} s, lifecycle {t['lifecycle'] / steps:.2f} s (exposed {t['lifecycle_exposed'] / steps:.2f} s)")
    print(f"{'branch':<11} {'models':>6} {'load s':>8} {'init s':>8} {'inference s':>12} {'release s':>10} {'visit s':>8}   "
          "(means per model opened; inference per call; visit: wall per visit)")
    for kind in BRANCH_KINDS:
        p = t["per_kind"][kind]
        n, calls, visits = max(p["inits"], 1), max(p["calls"], 1), max(p["visits"], 1)
        print(f"{kind:<11} {int(p['inits']):>6} {p['load'] / n:8.4f} {p['init'] / n:8.4f} {p['inference'] / calls:12.4f} "
              f"{p['release'] / n:10.4f} {p['wall'] / visits:8.4f}")
    swapped_in = (read_vmstat().get("pswpin", 0) - swap_in_start) * PAGE / MIB
    print(f"lowest MemAvailable {low_available[0] / GIB:.2f} GiB, peak process PSS {peak_pss[0] / MIB:.0f} MiB, "
          f"swapped in during the run {swapped_in:.1f} MiB, gate: {gate.message}" + (f"; {gate.warning}" if gate.warning else ""))
    return 0


if __name__ == "__main__":
    # python -m anima_ui.bench.runtime VARIANT MODELS GRAPHS WIDTH HEIGHT STEPS MEM_FLOOR_GIB: one (b) variant; JSON on the last line
    variant, models, graphs, width, height, steps, floor = sys.argv[1:8]
    print(json.dumps(MACHINE_RUNS[variant](models, graphs, int(width), int(height), int(steps), float(floor))))
