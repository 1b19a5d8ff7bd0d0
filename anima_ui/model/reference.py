"""The float32 torch reference of the DiT: `dit_forward` with the branch modules of branches.py run in torch.
The PC's torch backend, `verify --reference torch` and the oracle tests use it; the board never imports it."""

from collections.abc import Callable

import numpy as np
import torch

from anima_ui.model.branches import BRANCH_CLASSES
from anima_ui.model.config import BRANCH_INPUTS, AnimaConfig
from anima_ui.model.forward import dit_forward, prepare_kv, prepare_rope
from anima_ui.model.host import block_weights


class TorchBranches:
    """`run_branch` over the torch branch modules (the float32 reference); each module is built on first use."""

    def __init__(self, weights: dict[str, np.ndarray], cfg: AnimaConfig):
        self.weights = weights
        self.cfg = cfg
        self.modules: dict[tuple[int, str], torch.nn.Module] = {}

    def module(self, block: int, kind: str) -> torch.nn.Module:
        if not 0 <= block < self.cfg.num_blocks:
            raise IndexError(f"block {block} out of range: the model has {self.cfg.num_blocks}")
        if (block, kind) not in self.modules:
            self.modules[(block, kind)] = BRANCH_CLASSES[kind](block_weights(self.weights, block)).eval()
        return self.modules[(block, kind)]

    def __call__(self, block: int, kind: str, inputs: dict[str, np.ndarray]) -> np.ndarray:
        module = self.module(block, kind)
        args = [torch.from_numpy(np.ascontiguousarray(inputs[name], dtype=np.float32)) for name in BRANCH_INPUTS[kind]]
        with torch.inference_mode():
            return module(*args).numpy()


def reference_forward(
    weights: dict[str, np.ndarray],
    x: np.ndarray,
    sigma: np.ndarray,
    context: np.ndarray,
    branches: TorchBranches | None = None,
    on_block: Callable[[int, np.ndarray], None] | None = None,
) -> np.ndarray:
    """The whole DiT in float32 on this machine: `dit_forward` with the torch branch modules.
    Pass `branches` to reuse modules across calls."""
    cfg = AnimaConfig.from_shapes({k: v.shape for k, v in weights.items()})
    branches = branches or TorchBranches(weights, cfg)
    kv = prepare_kv(weights, context)
    rope = prepare_rope(cfg, x.shape[2], x.shape[3])
    return dit_forward(weights, branches, x, sigma, kv, rope, on_block=on_block)
