"""A safetensors file read on demand, without torch: the header is parsed once, and each read copies one
tensor (or some rows of one) out of the file. Nothing stays mapped, so a tensor costs memory only while the
caller holds it: the text encoder streams its layers this way, and the host re-reads once-per-prompt tensors.

bf16 (what the release files store) is widened to float32 exactly: a bf16 value is the top half of a float32."""

import sys
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from anima_ui.errors import UserError
from anima_ui.modelfiles import read_safetensors_header

STORED_DTYPES = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32}
_HIGH_HALF = 1 if sys.byteorder == "little" else 0  # which uint16 of a uint32 holds the top bits


class TensorFile:
    """`rename(key) -> name | None` maps the file's keys to the caller's names (None skips a key)."""

    def __init__(self, path, rename=lambda key: key):
        self.path = Path(path)
        header, self.data_start = read_safetensors_header(self.path)
        self.entries = {}
        for key, entry in header.items():
            name = rename(key) if key != "__metadata__" else None
            if name is not None:
                self.entries[name] = entry

    @property
    def shapes(self) -> dict[str, tuple]:
        return {name: tuple(entry["shape"]) for name, entry in self.entries.items()}

    def stored(self, name: str) -> np.ndarray:
        """The tensor as the file stores it (bf16 as its uint16 bit patterns)."""
        entry = self._checked(name)
        out = np.empty(entry["shape"], STORED_DTYPES[entry["dtype"]])
        begin, _ = entry["data_offsets"]
        with open(self.path, "rb", buffering=0) as f:
            _read_exactly(f, self.data_start + begin, out)
        return out

    def read(self, name: str, dtype=np.float32) -> np.ndarray:
        return to_float(self.stored(name), self.entries[name]["dtype"], dtype)

    def read_into(self, name: str, out: np.ndarray, staging: np.ndarray) -> None:
        """Overwrite the float32 array `out` with tensor `name`, reading the file's bytes through `staging`
        (an array of the stored dtype and the same shape). Reusing both for tensor after tensor of one shape
        (layer after layer) spares a page fault per 4 KiB per read. For bf16 only the high halves of `out` are
        written, so `out` must come from np.zeros and be written by nothing else."""
        entry = self._checked(name)
        if tuple(entry["shape"]) != out.shape or staging.shape != out.shape or staging.dtype != STORED_DTYPES[entry["dtype"]]:
            raise ValueError(f"{name}: buffers of shape {out.shape}/{staging.dtype} for a {entry['dtype']} tensor of shape {entry['shape']}")
        with open(self.path, "rb", buffering=0) as f:
            _read_exactly(f, self.data_start + entry["data_offsets"][0], staging)
        if entry["dtype"] == "BF16":
            out.view(np.uint16).reshape(*out.shape, 2)[..., _HIGH_HALF] = staging
        else:
            out[...] = staging

    def read_rows(self, name: str, rows) -> np.ndarray:
        """float32 rows of a 2-D tensor (an embedding lookup without reading the whole table)."""
        entry = self._checked(name)
        stored = np.dtype(STORED_DTYPES[entry["dtype"]])
        height, width = entry["shape"]
        rows = np.asarray(rows, dtype=np.int64).ravel()
        if rows.size and (rows.min() < 0 or rows.max() >= height):
            bad = int(rows.max() if rows.max() >= height else rows.min())
            raise IndexError(f"row {bad} outside 0..{height - 1} of {name}")
        out = np.empty((rows.size, width), stored)
        begin = self.data_start + entry["data_offsets"][0]
        with open(self.path, "rb", buffering=0) as f:
            for i, row in enumerate(rows):
                _read_exactly(f, begin + int(row) * width * stored.itemsize, out[i])
        return to_float(out, entry["dtype"], np.float32)

    def _checked(self, name: str) -> dict:
        """The entry of `name`, with its dtype and byte size checked (only tensors that are read: a file may
        carry extra tensors of other types)."""
        entry = self.entries[name]
        stored = STORED_DTYPES.get(entry["dtype"])
        if stored is None:
            raise UserError(f"{self.path.name}: tensor {name!r} is {entry['dtype']}; only BF16, F16 and F32 files are supported")
        begin, end = entry["data_offsets"]
        if end - begin != int(np.prod(entry["shape"], dtype=np.int64)) * np.dtype(stored).itemsize:
            raise UserError(f"{self.path.name}: tensor {name!r} has a damaged header entry (size does not match its shape); re-download the file")
        return entry


def to_float(values: np.ndarray, stored_dtype: str, dtype=np.float32) -> np.ndarray:
    if stored_dtype == "BF16":
        return bf16_to_float32(values).astype(dtype, copy=False)
    return values.astype(dtype, copy=False)


def bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    """uint16 bf16 bit patterns -> float32 (exact). The low halves come zeroed from calloc, so this is one
    strided copy, several times faster than a uint32 shift."""
    out = np.zeros(bits.shape, np.uint32)
    out.view(np.uint16).reshape(*bits.shape, 2)[..., _HIGH_HALF] = bits
    return out.view(np.float32)


def _read_exactly(f, offset: int, out: np.ndarray) -> None:
    view = memoryview(out.reshape(-1).view(np.uint8))
    done = 0
    while done < len(view):
        f.seek(offset + done)
        n = f.readinto(view[done:])
        if not n:
            raise UserError(f"{f.name} ended early (truncated while in use?); re-download it")
        done += n


class FileTensors(Mapping):
    """A read-only mapping name -> float32 array that reads each tensor from the file when it is looked up
    (and keeps nothing): for tensors used once per prompt. `names` maps the caller's names to the file's."""

    def __init__(self, file: TensorFile, names: dict[str, str]):
        self.file = file
        self.names = names

    def __getitem__(self, name: str) -> np.ndarray:
        return self.file.read(self.names[name])

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def shape(self, name: str) -> tuple:
        return tuple(self.file.entries[self.names[name]]["shape"])


def embedding_rows(weights: Mapping, name: str, rows: np.ndarray) -> np.ndarray:
    """weights[name][rows] (float32), reading only those rows when `weights` reads from a file. A row outside
    the table, negative ones included, raises IndexError."""
    rows = np.asarray(rows, dtype=np.int64)
    if isinstance(weights, FileTensors):
        return weights.file.read_rows(weights.names[name], rows)
    table = weights[name]
    if rows.size and (rows.min() < 0 or rows.max() >= table.shape[0]):
        bad = int(rows.max() if rows.max() >= table.shape[0] else rows.min())
        raise IndexError(f"row {bad} outside 0..{table.shape[0] - 1} of {name}")
    return np.asarray(table[rows], dtype=np.float32)
