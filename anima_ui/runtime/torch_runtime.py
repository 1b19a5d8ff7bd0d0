"""The torch backend: the DiT branches run as the float32 torch reference modules, in the caller's thread.

It has the graph runtimes' interface (`forward(...)`, `runtime(block, kind, inputs)` as `run_branch`, `close()`,
`timings`, `open_contexts`, `gate_status`), so the pipeline treats every backend alike. It needs no exported graphs, opens no
contexts and so has no memory gate; its modules share the NumPy weights (no copy)."""

import threading

import numpy as np

from anima_ui.errors import Cancelled
from anima_ui.model.config import AnimaConfig
from anima_ui.model.forward import dit_forward
from anima_ui.model.reference import TorchBranches


class TorchRuntime:
    open_contexts = 0
    gate_status = None

    def __init__(self, weights: dict[str, np.ndarray], config: AnimaConfig, cancel: threading.Event):
        self.branches = TorchBranches(weights, config)
        self.cancel = cancel
        self.ffn = "fp32"  # the float32 reference: no quantized FFNs

    @property
    def timings(self) -> dict:
        """No per-phase counters: every branch runs inside the caller's step."""
        return {}

    def forward(self, weights, x, sigma, kv, rope, on_block=None) -> np.ndarray:
        """One DiT forward over the batch in x, every branch in the caller's thread."""
        return dit_forward(weights, self, x, sigma, kv, rope, on_block)

    def __call__(self, block: int, kind: str, inputs: dict) -> np.ndarray:
        if self.cancel.is_set():
            raise Cancelled("cancelled")
        return self.branches(block, kind, inputs)

    def close(self) -> None:
        self.branches.modules.clear()
