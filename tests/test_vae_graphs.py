"""The decoder as ONNX graphs built from the safetensors (no torch), on onnxruntime: against the own torch
decoder and diffusers on the same random weights, tiled and untiled; the node patterns the NPU compiler
fuses; and a decode in a process where torch cannot be imported."""

import subprocess
import sys
import textwrap
from collections import Counter

import numpy as np
import onnx
import pytest

from anima_ui.errors import UserError
from anima_ui.metrics import psnr
from anima_ui.vae.graphs import build_decoder_graph
from anima_ui.vae.onnx_decoder import OnnxDecoder, ort_session
from anima_ui.vae.wan_decoder import load_vae_decoder
from anima_ui.vae.weights import load_decoder_weights
from helpers import WITHOUT_TORCH
from vae_helpers import SMALL_VAE_DIM, diffusers_decode, random_latent, small_vae_file, write_vae_file

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BASE_DIM = SMALL_VAE_DIM


@pytest.fixture(scope="module")
def small_vae(tmp_path_factory):
    return small_vae_file(tmp_path_factory)


@pytest.fixture(scope="module")
def latent():
    return random_latent(12, 20)


def test_untiled_matches_the_torch_decoder_and_diffusers(small_vae, latent):
    path, state = small_vae
    ours = OnnxDecoder(path, threads=1).decode_float(latent)
    torch_image = load_vae_decoder(path).decode_float(latent)
    assert ours.shape == (96, 160, 3) and ours.std() > 0.05
    assert psnr(ours, torch_image) >= 100.0  # same maths, other kernels: float rounding only
    assert psnr(ours, diffusers_decode(state, BASE_DIM, latent)) >= 45.0


def test_tiled_matches_the_torch_decoders_tiling(small_vae, latent):
    path, _ = small_vae
    decoder = OnnxDecoder(path, threads=1)
    tiled = decoder.decode_float(latent, tiled=True, tile=8, overlap=0.5)
    assert psnr(tiled, load_vae_decoder(path).decode_float(latent, tiled=True, tile=8, overlap=0.5)) >= 100.0
    assert psnr(tiled, decoder.decode_float(latent)) < 80.0  # really tiled
    pixels = decoder.decode(latent, tiled=True, tile=8)
    assert pixels.dtype == np.uint8 and pixels.shape == (96, 160, 3)


def test_trunk_then_up_path_is_the_full_graph(small_vae):
    path, _ = small_vae
    base_dim, weights = load_decoder_weights(path)
    latent = random_latent(6, 10)
    full = ort_session(build_decoder_graph(weights, base_dim, 6, 10)).run(None, {"latent": latent})[0]
    features = ort_session(build_decoder_graph(weights, base_dim, 6, 10, part="trunk")).run(None, {"latent": latent})[0]
    assert features.shape == (1, 4 * BASE_DIM, 6, 10)
    image = ort_session(build_decoder_graph(weights, base_dim, 6, 10, part="up")).run(None, {"features": features})[0]
    assert image.shape == (1, 3, 48, 80)
    np.testing.assert_allclose(image, full, rtol=0, atol=1e-6)


def test_graphs_use_the_patterns_the_npu_compiler_fuses(small_vae):
    path, _ = small_vae
    base_dim, weights = load_decoder_weights(path)
    model = build_decoder_graph(weights, base_dim, 4, 4)
    onnx.checker.check_model(model, full_check=True)
    assert model.opset_import[0].version == 19 and model.ir_version == 9
    nodes = model.graph.node
    ops = Counter(n.op_type for n in nodes)
    assert set(ops) == {"Conv", "ReduceL2", "Clip", "Expand", "Div", "Mul", "Sigmoid", "Add", "Reshape",
                        "Transpose", "MatMul", "Softmax", "Resize"}
    # every channel norm: ReduceL2 -> Clip -> Expand -> Div (never Max(eps)); 30 norms in the decoder
    producer = {out: n for n in nodes for out in n.output}
    divs = [n for n in nodes if n.op_type == "Div"]
    assert len(divs) == ops["ReduceL2"] == 30
    for div in divs:
        expand = producer[div.input[1]]
        clip = producer[expand.input[0]]
        assert (expand.op_type, clip.op_type, producer[clip.input[0]].op_type) == ("Expand", "Clip", "ReduceL2")
    assert ops["Softmax"] == 1 and ops["MatMul"] == 2 and ops["Resize"] == 3
    assert ops["Clip"] == 31  # the 30 norms and the final clamp to [0, 1]
    unclipped = build_decoder_graph(weights, base_dim, 4, 4, clip=False)
    assert Counter(n.op_type for n in unclipped.graph.node)["Clip"] == 30


def test_bad_graph_requests_are_user_errors(small_vae):
    path, _ = small_vae
    base_dim, weights = load_decoder_weights(path)
    with pytest.raises(UserError, match="unknown decoder graph part"):
        build_decoder_graph(weights, base_dim, 4, 4, part="middle")
    with pytest.raises(UserError, match="must be positive"):
        build_decoder_graph(weights, base_dim, 0, 4)


DECODE_WITHOUT_TORCH = WITHOUT_TORCH + textwrap.dedent("""
    import numpy as np
    from anima_ui.vae.decode import decode_latent

    image, name, warning = decode_latent(np.load(sys.argv[2]), sys.argv[1], threads=1)
    np.save(sys.argv[3], np.asarray(image))
    print(name, "|", warning)
""")


def test_the_fallback_decodes_where_torch_cannot_be_imported(small_vae, tmp_path):
    """The tiny VAE (width 16) is one sd.cpp cannot run: decode_latent falls back to the graph decoder,
    and nothing on that path imports torch (the board has none)."""
    path, _ = small_vae
    latent = random_latent(8, 8)
    np.save(tmp_path / "latent.npy", latent)
    done = subprocess.run([sys.executable, "-c", DECODE_WITHOUT_TORCH, str(path), str(tmp_path / "latent.npy"),
                           str(tmp_path / "image.npy")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    name, warning = done.stdout.strip().split(" | ")
    assert name == "onnx" and "VAE width 16" in warning
    expected = OnnxDecoder(path, threads=1).decode(latent, tiled=True)
    np.testing.assert_array_equal(np.load(tmp_path / "image.npy"), expected)


@pytest.mark.slow
def test_full_width_graphs_match_the_torch_decoder_and_diffusers(tmp_path):
    path = tmp_path / "qwen_image_vae.safetensors"
    state = write_vae_file(path, 96)
    latent = random_latent(16, 16)
    ours = OnnxDecoder(path).decode_float(latent)
    assert psnr(ours, load_vae_decoder(path).decode_float(latent)) >= 100.0
    assert psnr(ours, diffusers_decode(state, 96, latent)) >= 45.0
