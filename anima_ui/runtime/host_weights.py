"""The DiT tensors the host needs when the branches run as graphs: embeddings, AdaLN modulations, the
final layer, and the cross-attention K/V projections (used once per prompt by prepare_kv). The branch
weights (attention q/k/v/o, FFN) live in the graphs; loading them again would cost ~7 GB of RAM at full
size. Reuses the checkpoint module's reader (load_dit reads every tensor)."""

import re
from pathlib import Path

import numpy as np

from anima_ui.model.checkpoint import ADAPTER_PREFIX, _read_header, _tensor, dit_param_shapes, strip_prefix
from anima_ui.model.config import AnimaConfig

BRANCH_TENSOR = re.compile(r"blocks\.\d+\.(self_attn\.|cross_attn\.(q_proj|output_proj|q_norm)\.|mlp\.)")


def is_host_tensor(key: str, with_adapter: bool = True) -> bool:
    return not BRANCH_TENSOR.match(key) and (with_adapter or not key.startswith(ADAPTER_PREFIX))


def load_host_weights(path, with_adapter: bool = True) -> tuple[AnimaConfig, dict[str, np.ndarray]]:
    """Like load_dit, without the tensors of the branch graphs (and without the LLM adapter's, which the
    text encoder needs, when with_adapter=False)."""
    path = Path(path)
    header, data_start = _read_header(path)
    entries = {strip_prefix(k): v for k, v in header.items() if k != "__metadata__"}
    cfg = AnimaConfig.from_shapes({k: tuple(v["shape"]) for k, v in entries.items()})
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    keys = [k for k in dit_param_shapes(cfg) if is_host_tensor(k, with_adapter)]
    return cfg, {k: _tensor(path, raw, data_start, k, entries[k], np.float32) for k in keys}
