"""The W8A8 + low-rank FFN parts on their own: quantizer rules, the transform's algebra, the graph, the host's AdaLN
fold, the calibration recorder and the op-table check (the simulator itself is in test_quant_rknn.py)."""

import numpy as np
import onnxruntime
import pytest
import torch

from anima_ui.model import host
from anima_ui.model.branches import FeedForwardBranch
from anima_ui.model.host import block_weights
from anima_ui.model.forward import dit_forward, prepare_kv, prepare_rope
from anima_ui.model.reference import TorchBranches
from anima_ui.quant.capture import FfnRecorder
from anima_ui.convert.rknn_worker import parse_op_table
from anima_ui.quant.convert import hybrid_op_problems
from anima_ui.quant.ffn import QuantizedFfn, add_tree, emulate, emulate_plain, k_pieces, low_rank, quantize_ffn
from anima_ui.quant.gate import rel_error
from anima_ui.quant.graph import float_ffn_model, quantized_ffn_model
from anima_ui.quant.numerics import Quantizer, erf, ffn_fp16, ffn_fp32, gelu, quantize_weight


def outlier_ffn(d=64, f=256, tokens=1024, seed=0):
    """A DiT-like FFN: heavy-tailed weights, four input channels 20-50x larger with a consistent sign."""
    rng = np.random.default_rng(seed)
    w1 = (rng.standard_t(3, (d, f)) / np.sqrt(3 * d)).astype(np.float32)
    w2 = (rng.standard_t(3, (f, d)) / np.sqrt(3 * f)).astype(np.float32)
    channels = rng.choice(d, 4, replace=False)
    scales = np.array([20.0, 30.0, 40.0, 50.0])

    def activations(n, s):
        r = np.random.default_rng(s)
        x = r.standard_normal((n, d)) * (1 + 0.3 * r.uniform(-1, 1, (n, 1)))
        x[:, channels] = np.abs(x[:, channels]) * scales + 0.5 * scales
        return x.astype(np.float32)

    return w1, w2, activations(tokens, seed + 1), activations(tokens // 2, seed + 2)


def run_onnx(model, x):
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"h": x})[0]


def test_quantizer_reproduces_the_toolkit_scale_and_zero_point():
    # min/max and the resulting scale/zero point as rknn-toolkit2 2.5.0 wrote them into a .quantization.cfg
    q = Quantizer.from_range(-3.713390827178955, 4.083823204040527)
    assert q.scale == pytest.approx(0.030577309926350913, rel=1e-12) and q.zero_point == -7
    assert Quantizer.from_range(0.5, 2.0).zero_point == -128  # the range always includes 0
    x = np.linspace(-3.7, 4.08, 1001, dtype=np.float32)
    assert np.abs(q(x) - x).max() <= q.scale / 2 + 1e-6
    assert q(np.float32(0.0)) == 0.0


def test_weights_are_quantized_per_output_channel():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((32, 8)).astype(np.float32) * np.array([1, 10, 100, 0.01, 1, 1, 1, 1], np.float32)
    wq = quantize_weight(w)
    step = (np.maximum(w.max(0), 0) - np.minimum(w.min(0), 0)) / 255
    assert np.all(np.abs(wq - w) <= step / 2 + 1e-6 * np.abs(w).max(0))
    assert np.abs(wq[:, 3] - w[:, 3]).max() < step[2] / 1000  # a small column keeps its own fine step


def test_erf_and_gelu_match_torch():
    x = np.linspace(-8, 8, 20001, dtype=np.float32)
    assert np.abs(erf(x) - torch.erf(torch.from_numpy(x)).numpy()).max() < 1e-6  # A&S 1.5e-7 plus float32 rounding
    # gelu = x·(1 + erf)/2 carries erf's error times |x|/2, and float32's rounding of a result near 8 is 9.5e-7 alone
    # (torch's own erf differs by CPU: 1.19e-6 seen at |x| near 8 on an AVX-512 machine)
    gelu_error = np.abs(gelu(x) - torch.nn.functional.gelu(torch.from_numpy(x)).numpy())
    assert np.all(gelu_error < 1e-6 * np.maximum(1.0, np.abs(x))), gelu_error.max()


def test_low_rank_is_as_good_as_the_truncated_svd():
    w = np.random.default_rng(0).standard_t(3, (128, 512)).astype(np.float32)
    la, lb = low_rank(w, 16)
    u, s, vt = np.linalg.svd(w.astype(np.float64), full_matrices=False)
    best = np.linalg.norm(w - (u[:, :16] * s[:16]) @ vt[:16])
    assert la.shape == (128, 16) and lb.shape == (16, 512)
    assert np.linalg.norm(w - la @ lb) <= 1.01 * best


def test_residual_gemms_split_into_aligned_pieces_no_wider_than_the_limit():
    assert k_pieces(8192) == (2752, 2720, 2720)  # layer 2 at full size: the compiler would tile K = 8192
    assert k_pieces(2048) == (2048,) and k_pieces(8192, None) == (8192,)
    assert k_pieces(256, 96) == (96, 96, 64) and k_pieces(1000, 300) == (256, 256, 256, 232)
    for k, max_k in ((8192, 3072), (256, 96), (1000, 300), (4096, 2048)):
        assert sum(k_pieces(k, max_k)) == k and max(k_pieces(k, max_k)) <= max_k


def test_add_tree_adds_pairwise_with_one_fp16_rounding_per_add():
    a, b, c = (np.float32(v) for v in (1.0, 2.0 ** -11, 2.0 ** -11))
    assert add_tree([a, b, c]) == 1.0  # ((a + b) + c): half an FP16 step at 1 is lost twice
    assert add_tree([b, c, a]) == 1.0 + 2.0 ** -10  # ((b + c) + a): together they make one step
    terms = [np.full(3, v, np.float32) for v in (1.0, 2.0, 3.0, 4.0, 5.0)]
    assert np.array_equal(add_tree(terms), np.full(3, 15.0))


@pytest.mark.parametrize("max_k", [None, 32])
def test_the_graph_in_float_is_the_original_ffn(tiny_state, max_k):
    """Smoothing, the low-rank split and the residual GEMMs' K pieces are exact rewrites: in float32 the quantized
    graph computes the FFN branch (the torch module the project exports) of x from its input x/λ1."""
    weights = block_weights(tiny_state, 0)
    w1, w2 = weights["mlp.layer1.weight"].T.copy(), weights["mlp.layer2.weight"].T.copy()
    x = np.random.default_rng(1).standard_normal((1, 16, 64)).astype(np.float32) * 3
    q = quantize_ffn(w1, w2, x[0], rank=8, max_k=max_k)
    assert (len(q.pieces1), len(q.pieces2)) == ((1, 1) if max_k is None else (2, 8))
    expected = FeedForwardBranch(weights)(torch.from_numpy(x)).detach().numpy()
    model = quantized_ffn_model(q, x.shape)
    assert sum(node.op_type == "MatMul" for node in model.graph.node) == len(q.pieces1) + len(q.pieces2) + 4
    assert rel_error(run_onnx(model, x / q.smooth_in), expected) < 1e-5
    assert rel_error(run_onnx(float_ffn_model(w1, w2, x.shape), x), expected) < 1e-6
    assert rel_error(ffn_fp32(x, w1, w2), expected) < 1e-6


def test_low_rank_smoothed_w8a8_beats_plain_w8a8_on_outliers():
    w1, w2, calib, heldout = outlier_ffn()
    reference = ffn_fp32(heldout, w1, w2)
    plain = rel_error(emulate_plain(w1, w2, calib, heldout), reference)
    smoothed = quantize_ffn(w1, w2, calib, rank=0)
    lowrank = quantize_ffn(w1, w2, calib, rank=16)
    errors = [rel_error(emulate(q, heldout / q.smooth_in), reference) for q in (smoothed, lowrank)]
    fp16 = rel_error(ffn_fp16(heldout, w1, w2), reference)
    assert fp16 < 1e-3 < errors[1] < errors[0] < plain
    assert plain > 0.02 > errors[1]
    # the branch takes the outlier directions: the residual GEMM's output range shrinks
    span = lambda q: q.ranges["res1"][1] - q.ranges["res1"][0]
    assert span(lowrank) < span(smoothed) / 5


def test_save_and_load_keep_everything(tmp_path):
    w1, w2, calib, _ = outlier_ffn(tokens=256)
    q = quantize_ffn(w1, w2, calib, rank=8, max_k=96)
    assert q.pieces2 == (96, 96, 64) and {"mid0", "mid2", "res2_0", "res2_2"} <= set(q.ranges)
    q.save(tmp_path / "q.npz")
    loaded = QuantizedFfn.load(tmp_path / "q.npz")
    assert (loaded.rank, loaded.alpha1, loaded.alpha2, loaded.ranges) == (q.rank, q.alpha1, q.alpha2, q.ranges)
    assert (loaded.pieces1, loaded.pieces2) == (q.pieces1, q.pieces2)
    x = calib[:32] / q.smooth_in
    assert np.array_equal(emulate(loaded, x), emulate(q, x))


def test_adaln_fold_divides_the_ffn_input_by_lambda(tiny_cfg, tiny_state):
    """dit_forward with ffn_input_scales hands block 1's FFN x/λ and nothing else changes."""
    rng = np.random.default_rng(0)
    lam = rng.uniform(0.2, 5.0, tiny_cfg.width).astype(np.float32)
    kv = prepare_kv(tiny_state, rng.standard_normal((2, 32, tiny_cfg.context_dim)).astype(np.float32))
    rope = prepare_rope(tiny_cfg, 8, 8)
    x = rng.standard_normal((2, 16, 8, 8)).astype(np.float32)
    sigma = np.array([0.7, 0.7], np.float32)
    branches = TorchBranches(tiny_state, tiny_cfg)

    def recording(store, undo_fold=False):
        def run(block, kind, inputs):
            store[(block, kind)] = inputs["h"].copy()
            if undo_fold and (block, kind) == (1, "mlp"):
                inputs = {"h": inputs["h"] * lam}  # what the smoothed graph's λ1·W1 does
            return branches(block, kind, inputs)

        return run

    folded_h, plain_h = {}, {}
    folded = dit_forward(tiny_state, recording(folded_h, undo_fold=True), x, sigma, kv, rope, ffn_input_scales={1: lam})
    reference = dit_forward(tiny_state, recording(plain_h), x, sigma, kv, rope)
    assert rel_error(folded_h[(1, "mlp")], plain_h[(1, "mlp")] / lam) < 1e-5
    assert all(np.array_equal(folded_h[k], plain_h[k]) for k in plain_h if k[0] == 0 or k[1] != "mlp")
    assert rel_error(folded, reference) < 1e-5


def test_recorder_stores_what_the_ffn_saw(tiny_cfg, tiny_state):
    rng = np.random.default_rng(3)
    kv = prepare_kv(tiny_state, rng.standard_normal((2, 32, tiny_cfg.context_dim)).astype(np.float32))
    rope = prepare_rope(tiny_cfg, 8, 8)
    x = rng.standard_normal((2, 16, 8, 8)).astype(np.float32)
    sigma = np.array([0.4, 0.4], np.float32)
    branches = TorchBranches(tiny_state, tiny_cfg)
    seen, residuals = {}, {}

    def spy(block, kind, inputs):
        seen[(block, kind)] = inputs["h"].copy()
        return branches(block, kind, inputs)

    layer1 = lambda block: tiny_state[f"blocks.{block}.mlp.layer1.weight"]
    recorder = FfnRecorder(spy, tiny_state, layer1, tiny_cfg.num_blocks, tokens=5, seed=0)
    recorder.start_forward("heldout", sigma, 16)

    def on_block(i, residual):
        residuals[i] = residual.copy()
        recorder.on_block(i, residual)

    dit_forward(tiny_state, recorder, x, sigma, kv, rope, on_block=on_block)
    e, lora = host.t_embedding(tiny_state, sigma)
    gates = [m["mlp"][2] for m in host.block_modulations(tiny_state, tiny_cfg.num_blocks, e, lora)]
    index = recorder._token_index
    for block in range(tiny_cfg.num_blocks):
        split = recorder.blocks[block]["heldout"]
        h = seen[(block, "mlp")]
        assert len(index) == 5 and not recorder.blocks[block]["calib"].x
        assert np.array_equal(np.concatenate(split.x), h[:, index].reshape(10, -1).astype(np.float16))
        assert np.array_equal(split.amax_x, np.abs(h).max(axis=(0, 1)))
        assert np.allclose(split.amax_hidden, np.abs(gelu(h @ layer1(block).T)).max(axis=(0, 1)), rtol=1e-6)
        assert np.allclose(np.concatenate(split.residual_norm), np.linalg.norm(residuals[block][:, index], axis=-1).ravel())
        assert np.array_equal(np.stack(split.gates), gates[block])
        assert np.array_equal(np.concatenate(split.capture), np.repeat([0, 1], 5))


# The op table of a real build (rknn-toolkit2 2.5.0, RKNN_LOG_LEVEL=5) of a 64-wide rank-16 graph, layout and data-convert rows left out.
BUILD_LOG = """\
D RKNN: [18:07:05.288]                                                         Network Layer Information Table
D RKNN: [18:07:05.288] --------------------------------------------------------------------------------------------------------------------------------------------------------------------------
D RKNN: [18:07:05.288] ID   OpType             DataType Target InputShape                               OutputShape            Cycles(DDR/NPU/Total)    RW(KB)       FullName
D RKNN: [18:07:05.288] --------------------------------------------------------------------------------------------------------------------------------------------------------------------------
D RKNN: [18:07:05.288] 0    InputOperator      FLOAT16  CPU    \\                                        (1,64,64)              0/0/0                    0            InputOperator:h
D RKNN: [18:07:05.288] 3    exDataConvert      FLOAT16  NPU    (1,64,1,64)                              (1,64,1,64)            0/0/0                    8            exDataConvert:h_tp-rs__cvt_float16_int8
D RKNN: [18:07:05.288] 4    Conv               FLOAT16  NPU    (1,64,1,64),(16,64,1,1)                  (1,16,1,64)            520/128/520              10           Conv:lra1#2
D RKNN: [18:07:05.288] 5    Conv               INT8     NPU    (1,64,1,64),(256,64,1,1),(256)           (1,256,1,64)           1646/2048/2048           22           Conv:res1#2
D RKNN: [18:07:05.288] 7    ConvAdd            FLOAT16  NPU    (1,16,1,64),(256,16,1,1),...             (1,256,1,64)           3204/2048/3204           42           Conv:lrb1#2_ConvAdd
D RKNN: [18:07:05.288] 8    exGelu             FLOAT16  NPU    (1,256,1,64)                             (1,256,1,64)           0/0/0                    32           exGelu:gelu_2gelu
D RKNN: [18:07:05.288] 9    Mul                FLOAT16  NPU    (1,256,1,64),(1,256,1,1)                 (1,256,1,64)           0/0/0                    32           Mul:mid
D RKNN: [18:07:05.288] 11   Conv               FLOAT16  NPU    (1,256,1,64),(16,256,1,1)                (1,16,1,64)            1819/512/1819            40           Conv:lra2#2
D RKNN: [18:07:05.288] 12   Conv               INT8     NPU    (1,256,1,64),(64,256,1,1),(64)           (1,64,1,64)            1581/1024/1581           32           Conv:res2#2
D RKNN: [18:07:05.288] 14   ConvAdd            FLOAT16  NPU    (1,16,1,64),(64,16,1,1),(1,64,1,64)      (1,64,1,64)            866/512/866              12           Conv:lrb2#2_ConvAdd
D RKNN: [18:07:05.288] 17   OutputOperator     FLOAT16  CPU    (1,64,64)                                \\                      0/0/0                    8            OutputOperator:out
D RKNN: [18:07:05.288] --------------------------------------------------------------------------------------------------------------------------------------------------------------------------
"""


def test_op_table_check_accepts_the_hybrid_graph_and_names_each_deviation():
    ops = parse_op_table(BUILD_LOG)
    assert [op.index for op in ops] == [0, 3, 4, 5, 7, 8, 9, 11, 12, 14, 17]
    assert sum(op.cycles_total for op in ops) == 520 + 2048 + 3204 + 1819 + 1581 + 866
    assert hybrid_op_problems(ops) == []
    bad = BUILD_LOG.replace("Conv               INT8     NPU    (1,256,1,64),(64", "Conv               FLOAT16  NPU    (1,256,1,64),(64")
    bad = bad.replace("OutputOperator     FLOAT16", "OutputOperator     INT8   ").replace("exGelu             FLOAT16  NPU", "exGelu             FLOAT16  CPU")
    problems = hybrid_op_problems(parse_op_table(bad))
    assert any("Conv:res2#2 is FLOAT16, expected INT8" in p for p in problems)
    assert any("output is INT8" in p for p in problems)
    assert any("exGelu:gelu_2gelu runs on the CPU" in p for p in problems)
    # what the compiler makes of an INT8 residual GEMM with too large a K: tiles chained by an INT8 ConvAdd
    tiled = BUILD_LOG.replace("Conv:res2#2\n", "Conv:res2#2_tile1\n").replace(
        "D RKNN: [18:07:05.288] 14   ConvAdd", "D RKNN: [18:07:05.288] 13   ConvAdd            INT8     NPU    "
        "(1,256,1,64),(64,256,1,1),(64)           (1,64,1,64)            1581/1024/1581           32           Conv:res2#2_tile0_ConvAdd\n"
        "D RKNN: [18:07:05.288] 14   ConvAdd")
    problems = hybrid_op_problems(parse_op_table(tiled))
    assert len(problems) == 2 and all("the compiler tiled Conv:res2#2_tile" in p for p in problems)
    assert hybrid_op_problems(parse_op_table("no table here")) == ["the build log has no op table"]
