"""Branch runtime: the DiT's 84 branch graphs run through onnxruntime, a simulated board or RKNN-Lite; or the torch
reference modules (`torch_runtime.py`), which need no graphs."""

from anima_ui.runtime.executor import BranchRuntime, open_runtime
from anima_ui.runtime.variants import VARIANTS, Plan

BACKENDS = ("torch", "onnx", "sim", "rknn")

__all__ = ["BACKENDS", "BranchRuntime", "Plan", "VARIANTS", "open_runtime"]
