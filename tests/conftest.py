"""Shared fixtures: the tiny random-weight Anima model in the official key layout."""

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from anima_ui.model.checkpoint import random_dit_state
from anima_ui.model.config import AnimaConfig


@pytest.fixture(scope="session")
def tiny_cfg() -> AnimaConfig:
    return AnimaConfig.tiny()


@pytest.fixture(scope="session")
def tiny_state(tiny_cfg) -> dict[str, np.ndarray]:
    """Read-only by convention: shared by every test in the session."""
    return random_dit_state(tiny_cfg, seed=0)


def save_dit_file(state: dict[str, np.ndarray], path, prefix: str = "net.", dtype=torch.bfloat16) -> None:
    """Write a state dict the way the release files are written (torch safetensors, bf16, `net.` keys)."""
    save_file({prefix + k: torch.from_numpy(v).to(dtype) for k, v in state.items()}, str(path))


@pytest.fixture(scope="session")
def write_dit_file():
    """save_dit_file(state, path, prefix="net.", dtype=torch.bfloat16)."""
    return save_dit_file
