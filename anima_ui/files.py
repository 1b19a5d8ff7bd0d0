"""Writing files so that a reader, or a later run after a kill, never sees half of one."""

import os
from pathlib import Path

PARTIAL = ".partial-"  # in the name of a temp file that a killed writer may leave behind


def write_atomic(path, data: bytes | str) -> None:
    """Write `data` to a temp file beside `path` (same filesystem), flush it to disk, then rename it over `path`."""
    path = Path(path)
    temp = path.with_name(f".{path.name}{PARTIAL}{os.getpid()}")
    try:
        with open(temp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)
