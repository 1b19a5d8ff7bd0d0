"""The one way a model folder's branch graphs are exported, whoever asks: `anima-ui export`, `anima-ui verify`,
`anima-ui prepare`, and the pipeline's "export" phase when a size has no graphs yet."""

from anima_ui.convert.export import export_graphs
from anima_ui.runtime.manifest import Manifest


def export_model_graphs(paths, width: int, height: int, out=None, dtype: str = "fp32", batch: int = 1,
                        progress=None) -> Manifest:
    """The 84 graphs of the model in `paths` (a ModelPaths) for width x height, written into `out` (default: the
    folder the onnx and sim backends read). Streamed: one graph's weights at a time, no torch."""
    out = out if out is not None else paths.exported_dir(width, height, batch)
    return export_graphs(paths, width, height, out, dtype, batch, progress)
