"""The DiT tensors the host needs when the branches run as graphs: embeddings, AdaLN modulations, the
final layer, and the cross-attention K/V projections. The branch weights (attention q/k/v/o, FFN) live in
the graphs; loading them again would cost ~7 GB of RAM at full size.

In float32 these host tensors alone are 1.25 GB at full size, too much next to the NPU contexts on an 8 GB
board. So `HostWeights` keeps the tensors every step uses (AdaLN, t-embedder, patch embed, final layer:
0.4 GB in bf16) as the file stores them and widens one to float32 each time it is looked up, and reads
the cross-attention K/V projections (used once per prompt, by prepare_kv) from the file when asked."""

import re
from collections.abc import Mapping

import numpy as np

from anima_ui.model.checkpoint import ADAPTER_PREFIX, dit_param_shapes, open_dit
from anima_ui.model.config import AnimaConfig
from anima_ui.model.tensor_file import TensorFile, to_float

BRANCH_TENSOR = re.compile(r"blocks\.\d+\.(self_attn\.|cross_attn\.(q_proj|output_proj|q_norm)\.|mlp\.)")
PER_PROMPT_TENSOR = re.compile(r"blocks\.\d+\.cross_attn\.(k_proj|v_proj)\.weight")


def is_host_tensor(key: str) -> bool:
    """Not a branch graph's tensor, and not the LLM adapter's (the text encoder reads those itself)."""
    return not BRANCH_TENSOR.match(key) and not key.startswith(ADAPTER_PREFIX)


class HostWeights(Mapping):
    """name -> float32 array, a new one on every lookup (callers must not keep writing into it)."""

    def __init__(self, file: TensorFile, names: list[str]):
        self.file = file
        self._stored = {name: (file.stored(name), file.entries[name]["dtype"]) for name in names if not PER_PROMPT_TENSOR.match(name)}
        self._per_prompt = [name for name in names if PER_PROMPT_TENSOR.match(name)]
        self._names = list(names)

    def __getitem__(self, name: str) -> np.ndarray:
        if name in self._stored:
            return to_float(*self._stored[name])
        if name in self._per_prompt:
            return self.file.read(name)
        raise KeyError(name)

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    @property
    def resident_bytes(self) -> int:
        return sum(bits.nbytes for bits, _ in self._stored.values())


def load_host_weights(path) -> tuple[AnimaConfig, HostWeights]:
    """The host's tensors of the DiT file. Every key of the file is checked, as load_dit does."""
    cfg, file = open_dit(path)
    return cfg, HostWeights(file, [key for key in dit_param_shapes(cfg) if is_host_tensor(key)])
