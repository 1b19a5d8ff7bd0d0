"""The DiT tensors the host needs when the branches run as graphs: embeddings, AdaLN modulations, the
final layer, and the cross-attention K/V projections (used once per prompt by prepare_kv). The branch
weights (attention q/k/v/o, FFN) live in the graphs; loading them again would cost ~7 GB of RAM at full
size."""

import re

import numpy as np

from anima_ui.model.checkpoint import ADAPTER_PREFIX, load_dit
from anima_ui.model.config import AnimaConfig

BRANCH_TENSOR = re.compile(r"blocks\.\d+\.(self_attn\.|cross_attn\.(q_proj|output_proj|q_norm)\.|mlp\.)")


def is_host_tensor(key: str, with_adapter: bool = True) -> bool:
    return not BRANCH_TENSOR.match(key) and (with_adapter or not key.startswith(ADAPTER_PREFIX))


def load_host_weights(path, with_adapter: bool = True) -> tuple[AnimaConfig, dict[str, np.ndarray]]:
    """Like load_dit, without the tensors of the branch graphs (and without the LLM adapter's, which the
    text encoder needs, when with_adapter=False)."""
    return load_dit(path, keep=lambda key: is_host_tensor(key, with_adapter))
