"""Step previews: the latent->RGB projection and the taew2_1 tiny decoder (an onnxruntime graph, no torch)
against a straightforward re-implementation of madebyollin's TAEHV decoder semantics (nn.Sequential, all 4
frames, trim 3) and against the torch last-frame preview the app ran before."""

import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file

from anima_ui.errors import UserError
from anima_ui.vae.preview import COMFYUI_WAN21_BIAS, COMFYUI_WAN21_FACTORS, latent_to_rgb, preview_image
from anima_ui.vae.latent import to_uint8
from anima_ui.vae.taehv import MEMBLOCKS, N_F, build_taehv_graph, load_taehv_decoder, taehv_decoder_shapes
from anima_ui.vae.onnx_decoder import ort_session
from helpers import WITHOUT_TORCH
from vae_helpers import random_latent

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_projection_is_the_comfyui_wan21_linear_map():
    x0 = random_latent(5, 7)
    rgb = latent_to_rgb(x0)
    assert rgb.shape == (5, 7, 3) and rgb.dtype == np.uint8
    pixel = x0[0, :, 2, 3] @ COMFYUI_WAN21_FACTORS + COMFYUI_WAN21_BIAS
    expected = np.floor(np.clip((pixel + 1) / 2, 0, 1) * 255 + 0.5)
    np.testing.assert_array_equal(rgb[2, 3], expected)
    # the latent mean (zero in model space) previews as the bias colour
    np.testing.assert_array_equal(latent_to_rgb(np.zeros((1, 16, 1, 1), np.float32))[0, 0], [104, 116, 85])


def test_preview_image_is_upscaled_to_the_longer_side():
    image = preview_image(random_latent(64, 48), 384)
    assert image.size == (288, 384) and image.mode == "RGB"


def test_preview_rejects_nan():
    latent = random_latent(4, 4)
    latent[0, 1, 1, 1] = np.nan
    with pytest.raises(UserError, match="NaN"):
        preview_image(latent, 64)


# ---------------------------------------------------------------- taew2_1


class MemBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(2 * c, c, 3, padding=1), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1),
                                  nn.ReLU(), nn.Conv2d(c, c, 3, padding=1))

    def forward(self, x, past):
        return F.relu(self.conv(torch.cat([x, past], 1)) + x)


class TGrow(nn.Module):
    def __init__(self, c, stride):
        super().__init__()
        self.conv = nn.Conv2d(c, c * stride, 1, bias=False)

    def forward(self, x):
        return self.conv(x).reshape(-1, x.shape[1], *x.shape[-2:])


class Clamp(nn.Module):
    def forward(self, x):
        return torch.tanh(x / 3) * 3


def reference_taehv_decoder() -> nn.Sequential:
    """madebyollin's TAEHV decoder, default taew2_1 configuration (time upscale False, True, True)."""
    f = [256, 128, 64, 64]
    conv = lambda i, o, bias=True: nn.Conv2d(i, o, 3, padding=1, bias=bias)
    return nn.Sequential(
        Clamp(), conv(16, f[0]), nn.ReLU(),
        MemBlock(f[0]), MemBlock(f[0]), MemBlock(f[0]), nn.Upsample(scale_factor=2), TGrow(f[0], 1), conv(f[0], f[1], False),
        MemBlock(f[1]), MemBlock(f[1]), MemBlock(f[1]), nn.Upsample(scale_factor=2), TGrow(f[1], 2), conv(f[1], f[2], False),
        MemBlock(f[2]), MemBlock(f[2]), MemBlock(f[2]), nn.Upsample(scale_factor=2), TGrow(f[2], 2), conv(f[2], f[3], False),
        nn.ReLU(), conv(f[3], 3))


def reference_decode(decoder: nn.Sequential, latent: torch.Tensor) -> torch.Tensor:
    """TAEHV's parallel apply over NTCHW frames, clamp, drop the first t_upscale - 1 = 3 frames."""
    x = latent[:, None]  # N=1, T=1
    n = x.shape[0]
    x = x.reshape(-1, *x.shape[2:])
    for block in decoder:
        if isinstance(block, MemBlock):
            frames = x.reshape(n, -1, *x.shape[1:])
            past = F.pad(frames, (0, 0, 0, 0, 0, 0, 1, 0))[:, :-1].reshape(x.shape)
            x = block(x, past)
        else:
            x = block(x)
    frames = x.reshape(n, -1, *x.shape[1:]).clamp(0, 1)
    assert frames.shape[1] == 4
    return frames[:, 3]


@pytest.fixture(scope="module")
def taehv_file(tmp_path_factory):
    """A random taew2_1 file in madebyollin's layout: decoder.* (64 tensors) and encoder.* (64)."""
    torch.manual_seed(0)
    decoder = reference_taehv_decoder()
    with torch.no_grad():
        for name, p in decoder.named_parameters():
            p.copy_(torch.randn_like(p) * (0.05 if name.endswith("bias") else p[0].numel() ** -0.5))
        decoder[22].weight.mul_(0.5)  # keep the image mostly inside (0, 1) so the comparison means something
        decoder[22].bias.fill_(0.5)
    state = {f"decoder.{k}": v.detach().clone() for k, v in decoder.state_dict().items()}
    state |= {f"encoder.{k}": torch.randn(v) * 0.01 for k, v in encoder_shapes().items()}
    path = tmp_path_factory.mktemp("vae_approx") / "taew2_1.safetensors"
    save_file(state, str(path))
    return path, decoder


def encoder_shapes() -> dict[str, tuple]:
    shapes = {"0.weight": (64, 3, 3, 3), "0.bias": (64,), "17.weight": (16, 64, 3, 3), "17.bias": (16,)}
    for pool, stride in ((2, 2), (7, 2), (12, 1)):
        shapes[f"{pool}.conv.weight"] = (64, 64 * stride, 1, 1)
        shapes[f"{pool + 1}.weight"] = (64, 64, 3, 3)
        for block in range(pool + 2, pool + 5):
            shapes |= {f"{block}.conv.0.weight": (64, 128, 3, 3), f"{block}.conv.0.bias": (64,),
                       f"{block}.conv.2.weight": (64, 64, 3, 3), f"{block}.conv.2.bias": (64,),
                       f"{block}.conv.4.weight": (64, 64, 3, 3), f"{block}.conv.4.bias": (64,)}
    return shapes


def test_key_layout_matches_appendix_b(taehv_file):
    shapes = taehv_decoder_shapes()
    assert len(shapes) == 64 and len(encoder_shapes()) == 64  # 128 tensors in the file
    assert sum(int(np.prod(s)) for s in shapes.values()) == 9_844_611
    assert sum(int(np.prod(s)) for s in encoder_shapes().values()) == 1_470_928
    _, reference = taehv_file
    assert {f"{k}": tuple(v.shape) for k, v in reference.state_dict().items()} == shapes


def test_taehv_matches_the_reference_semantics(taehv_file):
    path, reference = taehv_file
    latent = random_latent(6, 10)
    with torch.inference_mode():
        expected = reference_decode(reference, torch.from_numpy(latent))[0].permute(1, 2, 0).numpy()
    ours = load_taehv_decoder(path).decode(latent)
    assert ours.shape == (48, 80, 3) and ours.dtype == np.uint8
    assert 0.05 < expected.std() and ((expected > 0) & (expected < 1)).mean() > 0.5  # not flat, not clipped
    assert np.abs(ours.astype(np.float32) / 255.0 - expected).max() <= 1.0 / 255.0 + 1e-6


def torch_last_frame(w: dict[str, torch.Tensor], z: torch.Tensor) -> torch.Tensor:
    """The torch preview the app ran before the graph (only the last frame's dependencies, zero memory as a
    concatenated zero frame), kept here as a second reference."""
    def conv(x, name, weight=None):
        weight = w[f"{name}.weight"] if weight is None else weight
        return F.conv2d(x, weight, w.get(f"{name}.bias"), padding=weight.shape[-1] // 2)

    def memblocks(frames, indices):
        for index in indices:
            past = torch.cat([torch.zeros_like(frames[:1]), frames[:-1]], 0)
            h = F.relu(conv(torch.cat([frames, past], 1), f"{index}.conv.0"))
            frames = F.relu(conv(F.relu(conv(h, f"{index}.conv.2")), f"{index}.conv.4") + frames)
        return frames

    x = memblocks(F.relu(conv(torch.tanh(z / 3.0) * 3.0, "1")), MEMBLOCKS[0])
    x = conv(F.conv2d(F.interpolate(x, scale_factor=2.0, mode="nearest"), w["7.conv.weight"]), "8")
    x = F.conv2d(F.interpolate(memblocks(x, MEMBLOCKS[1]), scale_factor=2.0, mode="nearest"), w["13.conv.weight"])
    x = memblocks(conv(x.reshape(2, N_F[1], *x.shape[-2:]), "14"), MEMBLOCKS[2])
    x = F.conv2d(F.interpolate(x[1:], scale_factor=2.0, mode="nearest"), w["19.conv.weight"][-N_F[2]:])
    return conv(F.relu(conv(x, "20")), "22").clamp(0.0, 1.0)


def test_taehv_graph_matches_the_reference_and_the_torch_preview_in_float(taehv_file):
    path, reference = taehv_file
    latent = random_latent(7, 5)
    decoder = load_taehv_decoder(path)
    ours = ort_session(build_taehv_graph(decoder.w, 7, 5)).run(None, {"latent": latent})[0]
    with torch.inference_mode():
        expected = reference_decode(reference, torch.from_numpy(latent)).numpy()
        before = torch_last_frame({k: torch.from_numpy(v) for k, v in decoder.w.items()}, torch.from_numpy(latent)).numpy()
    assert ours.shape == expected.shape == before.shape == (1, 3, 56, 40)
    for name, other in (("madebyollin's semantics", expected), ("the torch preview", before)):
        print(f"\ntaew2_1 graph vs {name}: max abs {np.abs(ours - other).max():.1e}")
        assert np.abs(ours - other).max() < 1e-5
    assert np.abs(to_uint8(ours[0].transpose(1, 2, 0)).astype(int) - to_uint8(before[0].transpose(1, 2, 0))).max() <= 1


def test_taehv_preview_imports_no_torch(taehv_file):
    path, _ = taehv_file
    code = WITHOUT_TORCH + f"""
import numpy as np
from anima_ui.vae.preview import preview_image
image = preview_image(np.random.default_rng(0).standard_normal((1, 16, 6, 10)).astype(np.float32), 80, taesd_path={str(path)!r})
assert image.size == (80, 48) and np.asarray(image).std() > 0
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_preview_uses_taehv_when_the_file_exists(taehv_file, tmp_path):
    path, _ = taehv_file
    latent = random_latent(6, 10)
    image = preview_image(latent, 80, taesd_path=path)
    np.testing.assert_array_equal(np.asarray(image), load_taehv_decoder(path).decode(latent))
    fallback = preview_image(latent, 80, taesd_path=tmp_path / "absent.safetensors")
    np.testing.assert_array_equal(np.asarray(fallback), np.asarray(preview_image(latent, 80)))


def test_broken_taehv_file_is_a_user_error(tmp_path):
    path = tmp_path / "taew2_1.safetensors"
    save_file({"decoder.1.weight": torch.zeros(256, 16, 3, 3), "decoder.22.weight": torch.zeros(3, 64, 5, 5)}, str(path))
    with pytest.raises(UserError, match=r"missing decoder\.1\.bias"):
        load_taehv_decoder(path)
    path.write_bytes(b"truncated download")
    with pytest.raises(UserError, match="cannot read the preview decoder"):
        load_taehv_decoder(path)
