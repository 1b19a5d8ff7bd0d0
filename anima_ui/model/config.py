"""Dimensions of the Anima DiT (Cosmos-Predict2 MiniTrainDIT) and its in-checkpoint LLM adapter."""

import re
from dataclasses import dataclass

from anima_ui.errors import UserError

BRANCH_KINDS = ("self_attn", "cross_attn", "mlp")  # every block's three branches, in the order they run
CONTEXT_LEN = 512  # text tokens the DiT cross-attends to: the adapter's output, zero-padded to this length
# The graph inputs of each branch kind, in argument order (every branch has one output, `out`).
BRANCH_INPUTS = {"self_attn": ("h", "rope_cos", "rope_sin"), "cross_attn": ("h", "k", "v"), "mlp": ("h",)}


@dataclass(frozen=True)
class AnimaConfig:
    num_blocks: int
    width: int  # DiT model channels
    num_heads: int
    head_dim: int
    mlp_dim: int
    adaln_lora_dim: int
    context_dim: int  # cross-attention context channels (= adapter output)
    adapter_layers: int
    adapter_dim: int
    adapter_heads: int
    adapter_head_dim: int
    adapter_mlp_dim: int
    adapter_source_dim: int  # Qwen3 hidden size
    adapter_vocab: int = 32128
    patch: int = 2
    latent_channels: int = 16
    context_len: int = CONTEXT_LEN
    rope_theta: float = 10000.0
    rope_hw_extrapolation: float = 4.0  # NTK factor on the h/w thetas; t needs none (images are frame 0)

    @classmethod
    def full(cls) -> "AnimaConfig":
        return cls(
            num_blocks=28, width=2048, num_heads=16, head_dim=128, mlp_dim=8192, adaln_lora_dim=256,
            context_dim=1024, adapter_layers=6, adapter_dim=1024, adapter_heads=16, adapter_head_dim=64,
            adapter_mlp_dim=4096, adapter_source_dim=1024,
        )

    @classmethod
    def tiny(cls) -> "AnimaConfig":
        """Random-weight test model: every code path of the full model at a size that runs in milliseconds."""
        return cls(
            num_blocks=2, width=64, num_heads=2, head_dim=32, mlp_dim=256, adaln_lora_dim=16,
            context_dim=64, adapter_layers=2, adapter_dim=64, adapter_heads=4, adapter_head_dim=16,
            adapter_mlp_dim=256, adapter_source_dim=64,
        )

    @property
    def patch_features(self) -> int:
        """Patch-embed input: latent channels + the padding-mask channel, times p*p."""
        return (self.latent_channels + 1) * self.patch * self.patch

    @property
    def out_features(self) -> int:
        return self.patch * self.patch * self.latent_channels

    @property
    def rope_dims(self) -> tuple[int, int, int]:
        """(t, h, w) shares of the head dim, as Cosmos splits them: h = w = head_dim//6*2, t the rest."""
        dim_h = self.head_dim // 6 * 2
        return self.head_dim - 2 * dim_h, dim_h, dim_h

    @classmethod
    def from_shapes(cls, shapes: dict[str, tuple]) -> "AnimaConfig":
        """Everything from tensor shapes (keys without a prefix); no config file exists in the release."""

        def shape(key: str) -> tuple:
            if key not in shapes:
                raise UserError(f"not an Anima diffusion model: tensor {key!r} is missing (use the official anima-*.safetensors)")
            return tuple(shapes[key])

        width, patch_features = shape("x_embedder.proj.1.weight")
        out_features = shape("final_layer.linear.weight")[0]
        patch_area = patch_features - out_features  # (C+1)p² − Cp² = p²
        patch = round(patch_area ** 0.5)
        if patch < 1 or patch * patch != patch_area:
            raise UserError(
                f"not an Anima diffusion model: patch embed {patch_features} and output {out_features} features do not fit one patch size"
            )
        head_dim = shape("blocks.0.self_attn.q_norm.weight")[0]
        adapter_dim = shape("llm_adapter.out_proj.weight")[1]  # [target, model]
        adapter_head_dim = shape("llm_adapter.blocks.0.self_attn.q_norm.weight")[0]
        if width % head_dim or adapter_dim % adapter_head_dim:
            raise UserError(f"not an Anima diffusion model: head dims {head_dim}/{adapter_head_dim} do not divide widths {width}/{adapter_dim}")
        return cls(
            num_blocks=_count_indices(shapes, r"blocks\.(\d+)\."),
            width=width,
            num_heads=width // head_dim,
            head_dim=head_dim,
            mlp_dim=shape("blocks.0.mlp.layer1.weight")[0],
            adaln_lora_dim=shape("blocks.0.adaln_modulation_self_attn.1.weight")[0],
            context_dim=shape("blocks.0.cross_attn.k_proj.weight")[1],
            adapter_layers=_count_indices(shapes, r"llm_adapter\.blocks\.(\d+)\."),
            adapter_dim=adapter_dim,
            adapter_heads=adapter_dim // adapter_head_dim,
            adapter_head_dim=adapter_head_dim,
            adapter_mlp_dim=shape("llm_adapter.blocks.0.mlp.0.weight")[0],
            adapter_source_dim=shape("llm_adapter.blocks.0.cross_attn.k_proj.weight")[1],
            adapter_vocab=shape("llm_adapter.embed.weight")[0],
            patch=patch,
            latent_channels=out_features // patch_area,
        )


def _count_indices(shapes: dict, pattern: str) -> int:
    """Highest block index + 1, so a block missing in the middle shows up later as missing keys."""
    regex = re.compile(pattern)
    indices = [int(m.group(1)) for key in shapes if (m := regex.match(key))]
    return max(indices) + 1 if indices else 0
