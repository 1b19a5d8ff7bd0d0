"""`manifest.json` of an exported (ONNX) or converted (RKNN) graphs folder: one entry per branch graph.

Written by `anima-ui export` / `anima-ui convert-rknn`, read by the runtime. A graph's inputs are listed
in the order the graph takes them; `batched` inputs carry the CFG batch on axis 0 (h, k, v), the others
(the RoPE tables) are shared by the whole batch."""

import hashlib
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from anima_ui.errors import UserError
from anima_ui.files import write_atomically
from anima_ui.model.config import BRANCH_KINDS

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  # numpy dtype name: "float32" | "float16"
    batched: bool = False


@dataclass(frozen=True)
class GraphEntry:
    file: str
    block: int
    kind: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    sha256: str
    extra: dict = field(default_factory=dict)  # per-format facts: toolkit version, simulator check, ...


@dataclass
class Manifest:
    format: str  # "onnx" | "rknn"
    width: int
    height: int
    batch: int
    dtype: str  # "fp32" | "fp16"
    graphs: list[GraphEntry]
    source: dict  # {"file": ..., "sha256": ...} of the checkpoint (onnx) or the ONNX folder (rknn)
    tools: dict  # tool name -> version

    def graph(self, block: int, kind: str) -> GraphEntry:
        return self._index()[(block, kind)]

    def first_blocks(self, count: int) -> "Manifest":
        """The same graphs for blocks 0..count-1 only (what `tune` runs as its sample: a cycle of its own)."""
        if not 1 <= count <= len({g.block for g in self.graphs}):
            raise UserError(f"a sample of {count} blocks: the graphs have {len({g.block for g in self.graphs})}")
        return replace(self, graphs=[g for g in self.graphs if g.block < count])

    def cycle(self) -> list[tuple[int, str]]:
        """The fixed visiting order of dit_forward: block 0 sa, ca, mlp, block 1 sa, ..."""
        return sorted(self._index(), key=lambda bk: (bk[0], BRANCH_KINDS.index(bk[1])))

    def _index(self) -> dict:
        return {(g.block, g.kind): g for g in self.graphs}

    def write(self, folder) -> None:
        """Atomically: a reader sees the old manifest, none, or the whole new one."""
        text = json.dumps(asdict(self), indent=1) + "\n"
        write_atomically(Path(folder, MANIFEST), lambda f: f.write(text.encode()))

    @classmethod
    def read(cls, folder) -> "Manifest":
        path = Path(folder, MANIFEST)
        if not path.is_file():
            raise UserError(f"no {MANIFEST} in {folder}: export the graphs first (`anima-ui export` / `anima-ui convert-rknn`)")
        try:
            raw = json.loads(path.read_text())
            graphs = [_entry(g) for g in raw.pop("graphs")]
            manifest = cls(graphs=graphs, **raw)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise UserError(f"{path} is damaged ({exc}); export the graphs again") from None
        manifest.check_complete(folder)
        return manifest

    def check_complete(self, folder) -> None:
        blocks = {g.block for g in self.graphs}
        expected = {(b, k) for b in range(len(blocks)) for k in BRANCH_KINDS}
        if set(self._index()) != expected or len(self.graphs) != len(expected):
            raise UserError(f"{Path(folder, MANIFEST)} does not list 3 branch graphs for each of blocks 0..{len(blocks) - 1}; export again")
        for g in self.graphs:
            if not Path(folder, g.file).is_file():
                raise UserError(f"graph {g.file} listed in {Path(folder, MANIFEST)} is missing; export again")


def _entry(raw: dict) -> GraphEntry:
    specs = lambda items: tuple(TensorSpec(s["name"], tuple(s["shape"]), s["dtype"], s.get("batched", False)) for s in items)
    return GraphEntry(raw["file"], int(raw["block"]), raw["kind"], specs(raw["inputs"]), specs(raw["outputs"]), raw["sha256"], raw.get("extra", {}))


def sha256_file(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()
