"""`anima-ui bench runtime`: the split runtime, measured.

(a) simulated board: 20 CFG steps at 512x512 geometry (1024 image tokens, 512 text tokens, 28 blocks
    of the tiny model's widths) with the blog's latency table (runtime/board_latency.py): serial vs
    prefetch vs batch-2 graphs. Runs at --time-scale and prints board seconds (measured / scale).
(b) this machine: full-size random weights at 512x512, one CFG step, each variant in its own process
    (so peak RSS is per variant): split onnxruntime (prefetch, K=2), the torch reference, diffusers'
    CosmosTransformer3DModel; plus cross-attention with host K/V vs a graph that projects the context.
(c) --board: on an RK3588, the blog's table (load / init / inference / release per branch kind,
    per-step totals, MemAvailable, PSS, swap) from real steps of the rknn backend."""

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from anima_ui.convert.export import export_graphs
from anima_ui.errors import UserError
from anima_ui.fixtures.model import write_random_model
from anima_ui.fixtures.weights import write_random_dit
from anima_ui.model.branch_graphs import cross_attention_body
from anima_ui.model.branches import CrossAttentionBranch
from anima_ui.model.checkpoint import load_dit
from anima_ui.model.config import BRANCH_KINDS, AnimaConfig
from anima_ui.model.forward import dit_forward, prepare_kv, prepare_rope
from anima_ui.model.host import EPS, block_weights, cross_attention_kv
from anima_ui.model.onnx_graph import Graph, linear, reshape, rms_norm
from anima_ui.model.reference import TorchBranches
from anima_ui.modelfiles import ModelPaths
from anima_ui.runtime import board_latency, open_runtime
from anima_ui.runtime.graphs import graphs_ready
from anima_ui.runtime.host_weights import load_host_weights
from anima_ui.runtime.manifest import Manifest, TensorSpec
from anima_ui.runtime.memory import GIB, MIB, process_memory, read_meminfo, swap_used
from anima_ui.sampling.schedule import simple_sigmas

# Each (b) variant runs this module in a process of its own and reports that process's peak RSS, so what only some
# of them use is imported where it is used: onnxruntime (the cross-attention comparison), and diffusers (a test and benchmark requirement, requirements-dev.txt) for its row.

CFG_SCALE = 4.0


def add_arguments(parser):
    parser.add_argument("--parts", default="sim,machine", help="comma list of: sim, machine (default both)")
    parser.add_argument("--time-scale", type=float, default=0.2,
                        help="(a), and (c) with --backend sim: fraction of the board's latencies to sleep (0.2: ~19 min for (a);"
                             " smaller scales let this machine's own compute and scheduling show through)")
    parser.add_argument("--steps", type=int, default=20, help="(a) and (c): CFG steps")
    parser.add_argument("--models", help="(b): a full-size model folder (default: write random full-size weights into --work)"
                                         "; (c): the board's model folder")
    parser.add_argument("--work", help="(b): keep the random model and its ~6.6 GB ONNX export here (reused by the next run); "
                                       "default: a temporary folder, deleted after")
    parser.add_argument("--board", action="store_true", help="(c): run on an RK3588 with the rknn backend")
    parser.add_argument("--backend", default="rknn", help="(c): backend to measure (rknn on a board; sim to try it anywhere)")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--height", type=int, default=512)


def run(args) -> int:
    if args.board:
        return board_table(args)
    parts = set(args.parts.split(","))
    if not parts <= {"sim", "machine"}:
        raise UserError(f"--parts {args.parts!r}: use sim, machine or sim,machine")
    if "sim" in parts:
        simulated_board_table(args.time_scale, args.steps)
    if "machine" in parts:
        machine_table(args)
    return 0


# -- shared -----------------------------------------------------------------------------------------------------
def cfg_step_runner(weights, run_branch, kv, rope, cfg_scale=CFG_SCALE):
    """One Euler CFG step on batch 2 (cond, uncond): returns step(x, sigma, sigma_next) -> x_next."""
    def step(x, sigma, sigma_next):
        velocity = dit_forward(weights, run_branch, np.repeat(x, 2, axis=0), np.full(2, sigma, np.float32), kv, rope)
        guided = velocity[1:] + cfg_scale * (velocity[:1] - velocity[1:])
        return (x + (sigma_next - sigma) * guided).astype(np.float32)

    return step


def conditioning(cfg, weights, width, height, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1, cfg.latent_channels, height // 8, width // 8)).astype(np.float32)
    context = rng.standard_normal((2, cfg.context_len, cfg.context_dim)).astype(np.float32)
    return x, prepare_kv(weights, context), prepare_rope(cfg, height // 8, width // 8)


def median(values):
    return statistics.median(values) if values else float("nan")


# -- (a) simulated board ------------------------------------------------------------------------------------------
def simulated_board_table(time_scale: float, steps: int) -> None:
    cfg = replace(AnimaConfig.tiny(), num_blocks=board_latency.BLOCKS)
    with tempfile.TemporaryDirectory(prefix="anima-bench-sim-") as work:
        checkpoint = Path(work, "anima-bench-28-blocks.safetensors")
        write_random_dit(checkpoint, cfg, 0)
        cfg, weights = load_dit(checkpoint)
        graphs = {batch: Path(work, f"onnx-b{batch}") for batch in (1, 2)}
        for batch, folder in graphs.items():
            export_graphs(checkpoint, 512, 512, folder, batch=batch)
        x0, kv, rope = conditioning(cfg, weights, 512, 512)
        sigmas = simple_sigmas(steps)
        variants = [
            ("serial (blog's loop)", graphs[1], {"prefetch": False}),
            ("prefetch K=2", graphs[1], {"prefetch": True, "max_contexts": 2}),
            ("prefetch K=2, batch-2 graphs*", graphs[2], {"prefetch": True, "max_contexts": 2}),
        ]
        rows = []
        for name, folder, options in variants:
            runtime = open_runtime("sim", folder, time_scale=time_scale, keep_sessions=True, threads=1, **options)
            step = cfg_step_runner(weights, runtime, kv, rope)
            x, seconds, deltas = x0, [], []
            for i in range(steps):
                before, started = runtime.timings, time.perf_counter()
                x = step(x, sigmas[i], sigmas[i + 1])
                seconds.append((time.perf_counter() - started) / time_scale)
                after = runtime.timings
                deltas.append({k: (after[k] - before[k]) / time_scale for k in after})
            runtime.close()
            per_step = {k: median([d[k] for d in deltas]) for k in deltas[0]}
            rows.append((name, median(seconds), sum(seconds), per_step, runtime.peak_open_contexts))
    serial = rows[0][1]
    print(f"\n(a) simulated RK3588 board, {steps} CFG steps at 512x512 (1024 image / 512 text tokens, 28 blocks), "
          f"run at time scale {time_scale:g}; board seconds = measured / {time_scale:g}")
    print(f"    model of the blog's serial loop: {board_latency.serial_seconds_per_step():.1f} s/step "
          f"(blog measured 120.40); lifecycle fully hidden would give "
          f"{board_latency.serial_seconds_per_step() - board_latency.BLOCKS * sum(board_latency.LIFECYCLE_SECONDS_PER_MODEL.values()):.1f}")
    header = (f"{'variant':<30} {'s/step':>7} {f'{steps}-step s':>9} {'vs serial':>9} {'NPU':>6} {'host':>6} {'lifecycle':>9} "
              f"{'exposed':>7} {'hidden':>7} {'contexts':>8}")
    print(header)
    for name, med, total, t, peak in rows:
        print(f"{name:<30} {med:7.1f} {total:9.0f} {100 * (med / serial - 1):+8.1f}% {t['inference']:6.1f} {t['host']:6.1f} "
              f"{t['lifecycle']:9.1f} {t['lifecycle_exposed']:7.1f} {t['lifecycle_hidden']:7.1f} {peak:8d}")
    print("    medians over steps; s/step, NPU, host, lifecycle in board seconds per CFG step; contexts = most alive at once")
    print(f"    * batch-2 NPU time is an assumption, not a board figure: 2 x batch-1 / {board_latency.ASSUMED_BATCH2_SPEEDUP} "
          "(jaylfc/taOS#59, two UNets on two cores)")


# -- (b) this machine, full size --------------------------------------------------------------------------------------
def machine_table(args) -> None:
    available = read_meminfo()["MemAvailable"] / GIB
    print(f"\n(b) this machine, full-size random weights, {args.width}x{args.height}, one CFG step (batch 2); "
          f"MemAvailable at start {available:.1f} GiB")
    if available < 14 and not args.models:
        raise UserError(f"(b) needs ~14 GiB free (the torch reference holds 8.4 GB of fp32 weights); MemAvailable is {available:.1f} GiB")
    work = Path(args.work or tempfile.mkdtemp(prefix="anima-bench-full-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        models = Path(args.models) if args.models else _random_full_model(work)
        graphs = work / f"onnx-{args.width}x{args.height}"
        if not graphs_ready(graphs):  # an export kept in --work is reused
            started = time.perf_counter()
            subprocess.run([sys.executable, "-m", "anima_ui", "export", "--models", str(models), "--width", str(args.width),
                            "--height", str(args.height), "--out", str(graphs)], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            size = sum(p.stat().st_size for p in graphs.glob("*.onnx")) / 1e9
            print(f"    export of {len(list(graphs.glob('*.onnx')))} fp32 graphs: {time.perf_counter() - started:.0f} s, {size:.2f} GB")
        results = {}
        for variant in VARIANTS:
            command = [sys.executable, "-m", "anima_ui.bench.runtime", variant, str(models), str(graphs), str(args.width), str(args.height)]
            done = subprocess.run(command, capture_output=True, text=True)
            lines = done.stdout.strip().splitlines()
            results[variant] = json.loads(lines[-1]) if done.returncode == 0 and lines else {"error": (done.stderr.strip().splitlines() or ["?"])[-1]}
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
    print(f"{'variant':<34} {'s/step':>7} {'host s':>7} {'host %':>7} {'branches s':>10} {'peak RSS GiB':>12}")
    names = {"onnx": "split onnxruntime, prefetch K=2", "torch": "torch reference (split, in-process)",
             "diffusers": "diffusers CosmosTransformer3DModel"}
    for variant, r in results.items():
        if variant not in names:
            continue
        if "error" in r:
            print(f"{names[variant]:<34} failed: {r['error'][:80]}")
            continue
        host = r.get("host_seconds")
        host_text = f"{host:7.1f} {100 * host / r['step_seconds']:6.1f}%" if host is not None else f"{'-':>7} {'-':>7}"
        branch = r.get("branch_seconds")
        print(f"{names[variant]:<34} {r['step_seconds']:7.1f} {host_text} {'-' if branch is None else f'{branch:.1f}':>10} "
              f"{r['peak_rss_gib']:12.2f}")
    onnx, ca = results.get("onnx", {}), results.get("cross_attention", {})
    if "ca_graph_ms" in ca:
        per_step = 2 * ca["blocks"] * (ca["ca_projecting_ms"] - ca["ca_graph_ms"]) / 1000
        print(f"    cross-attention, block 0, one batch-1 call: graph with host K/V {ca['ca_graph_ms']:.1f} ms vs graph that "
              f"also projects the 512-token context {ca['ca_projecting_ms']:.1f} ms (medians of 5): {per_step:.2f} s per CFG step "
              f"({ca['blocks']} blocks x cond+uncond) saved for {ca['prepare_kv_s']:.2f} s once per prompt (prepare_kv, cond+uncond)")
    elif "error" in ca:
        print(f"    cross-attention comparison failed: {ca['error'][:100]}")
    if "lifecycle_hidden" in onnx:
        print(f"    onnx split: inference {onnx['inference']:.1f} s, load+init+release {onnx['lifecycle']:.1f} s of which "
              f"{onnx['lifecycle_hidden']:.1f} s hidden by prefetch; at most {onnx['peak_contexts']} contexts")


def _peak_rss_gib() -> float:
    """VmHWM: the peak RSS of this process image. (getrusage's ru_maxrss survives fork + exec on Linux, so
    a variant started by a parent that once held the random model would report the parent's peak.)"""
    return process_memory()["peak_rss"] / GIB


def _variant_onnx(models, graphs, width, height) -> dict:
    cfg, weights = load_host_weights(ModelPaths.find(models).dit)
    x, kv, rope = conditioning(cfg, weights, width, height)
    with open_runtime("onnx", graphs, prefetch=True, max_contexts=2) as runtime:
        step = cfg_step_runner(weights, runtime, kv, rope)
        started = time.perf_counter()
        step(x, 0.9, 0.85)
        seconds = time.perf_counter() - started
        t = runtime.timings
        peak = runtime.peak_open_contexts
    return {"step_seconds": seconds, "host_seconds": t["host"], "branch_seconds": seconds - t["host"], "inference": t["inference"],
            "lifecycle": t["lifecycle"], "lifecycle_hidden": t["lifecycle_hidden"], "peak_contexts": peak,
            "peak_rss_gib": _peak_rss_gib()}


def _variant_cross_attention(models, graphs, width, height) -> dict:
    """Block 0's cross-attention as exported (k, v inputs) vs a graph that also projects the context."""
    import onnxruntime  # see the note on imports at the top

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


def _variant_torch(models, graphs, width, height) -> dict:
    cfg, weights = load_dit(_dit_path(models))
    x, kv, rope = conditioning(cfg, weights, width, height)
    branches = TorchBranches(weights, cfg)
    branch_seconds = [0.0]

    def timed(block, kind, inputs):
        started = time.perf_counter()
        out = branches(block, kind, inputs)
        branch_seconds[0] += time.perf_counter() - started
        return out

    step = cfg_step_runner(weights, timed, kv, rope)
    started = time.perf_counter()
    step(x, 0.9, 0.85)
    seconds = time.perf_counter() - started
    return {"step_seconds": seconds, "host_seconds": seconds - branch_seconds[0], "branch_seconds": branch_seconds[0],
            "peak_rss_gib": _peak_rss_gib()}


def _variant_diffusers(models, graphs, width, height) -> dict:
    from diffusers import CosmosTransformer3DModel  # see the note on imports at the top
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
    return {"step_seconds": time.perf_counter() - started, "peak_rss_gib": _peak_rss_gib()}


VARIANTS = {"onnx": _variant_onnx, "torch": _variant_torch, "diffusers": _variant_diffusers, "cross_attention": _variant_cross_attention}


# -- (c) on the board -----------------------------------------------------------------------------------------------
def board_table(args) -> int:
    if not args.models:
        raise UserError("--board needs --models DIR (the folder with rknn/WxH from `anima-ui convert-rknn`)")
    paths = ModelPaths.find(args.models)
    graphs = paths.rknn_dir(args.width, args.height) if args.backend == "rknn" else paths.exported_dir(args.width, args.height)
    cfg, weights = load_host_weights(paths.dit)
    x, kv, _ = conditioning(cfg, weights, args.width, args.height)
    rope = prepare_rope(cfg, args.height // 8, args.width // 8)
    sigmas = simple_sigmas(args.steps)
    print(f"(c) {args.backend} backend, {args.width}x{args.height}, {args.steps} CFG steps, graphs in {graphs}")
    for prefetch in (False, True):
        runtime = open_runtime(args.backend, graphs, prefetch=prefetch, time_scale=args.time_scale)
        per_kind = _phase_recorder(runtime)
        swap_start = swap_used(read_meminfo())
        step = cfg_step_runner(weights, runtime, kv, rope)
        seconds, low_available, peak_pss = [], float("inf"), 0
        for i in range(args.steps):
            started = time.perf_counter()
            x = step(x, sigmas[i], sigmas[i + 1])
            seconds.append(time.perf_counter() - started)
            info = read_meminfo()
            low_available = min(low_available, info["MemAvailable"])
            peak_pss = max(peak_pss, process_memory()["pss"])
        t = runtime.timings
        runtime.close()
        print(f"\n{'prefetch K=2' if prefetch else 'serial'}: {median(seconds):.2f} s/step median over {args.steps} steps; "
              f"per step: NPU {t['inference'] / args.steps:.2f} s, host {t['host'] / args.steps:.2f} s, "
              f"lifecycle {t['lifecycle'] / args.steps:.2f} s (exposed {t['lifecycle_exposed'] / args.steps:.2f} s)")
        print(f"{'branch':<11} {'models':>6} {'load s':>8} {'init s':>8} {'inference s':>12} {'release s':>10}   (means per model)")
        for kind in BRANCH_KINDS:
            p = per_kind[kind]
            n = max(p["models"], 1)
            print(f"{kind:<11} {p['models']:>6} {p['load'] / n:8.4f} {p['init'] / n:8.4f} {p['inference'] / n:12.4f} {p['release'] / n:10.4f}")
        print(f"lowest MemAvailable {low_available / GIB:.2f} GiB, peak process PSS {peak_pss / MIB:.0f} MiB, "
              f"swap growth {(swap_used(read_meminfo()) - swap_start) / MIB:.1f} MiB, gate: {runtime.gate_status.message}")
    return 0


def _phase_recorder(runtime) -> dict:
    """Wrap the runtime's backend so each phase's seconds are also summed per branch kind."""
    per_kind = {kind: {"models": 0, "load": 0.0, "init": 0.0, "inference": 0.0, "release": 0.0} for kind in BRANCH_KINDS}
    lock = threading.Lock()
    backend = runtime.backend
    for phase in ("load", "init", "run", "release"):
        original = getattr(backend, phase)

        def timed(*a, _original=original, _phase=phase):
            entry = a[1]
            started = time.perf_counter()
            result = _original(*a)
            del a  # a released context must be freed inside the measured time
            with lock:
                per_kind[entry.kind]["inference" if _phase == "run" else _phase] += time.perf_counter() - started
                per_kind[entry.kind]["models"] += _phase == "init"
            return result

        setattr(backend, phase, timed)
    return per_kind


if __name__ == "__main__":
    # python -m anima_ui.bench.runtime VARIANT MODELS GRAPHS WIDTH HEIGHT: one (b) variant; JSON on the last line
    variant, models, graphs, width, height = sys.argv[1:6]
    print(json.dumps(VARIANTS[variant](models, graphs, int(width), int(height))))
