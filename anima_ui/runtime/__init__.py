"""Branch runtime: the DiT's 84 branch graphs run through onnxruntime, a simulated board or RKNN-Lite."""

from anima_ui.runtime.executor import BranchRuntime, open_runtime

__all__ = ["BranchRuntime", "open_runtime"]
