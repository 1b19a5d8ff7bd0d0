"""Writing files so that a reader, or a later run after a kill, never sees half of one: the one atomic writer of
the app (images and their sidecars, presets, latents, graphs, their records and manifests)."""

import os
import shutil
import tempfile
import uuid
from pathlib import Path

PARTIAL = ".partial-"  # in the name of a temp file that a killed writer may leave behind


def write_atomically(path, write) -> None:
    """write(binary_file) into a temp file beside `path` (same filesystem), flushed to disk, then renamed over
    `path`: a reader sees the old file, none, or the whole new one."""
    path = Path(path)
    temp = path.with_name(f".{path.name}{PARTIAL}{uuid.uuid4().hex[:8]}")
    try:
        with open(temp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)


def write_folder_atomically(path, fill) -> None:
    """fill(temp_folder) into a temp folder beside `path`, then swapped in for `path` (an old `path` is moved
    aside first and removed after): a reader sees the old folder, none, or the whole new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = Path(tempfile.mkdtemp(prefix=f".{path.name}{PARTIAL}", dir=path.parent))
    try:
        temp.chmod(0o755)  # mkdtemp makes it private; the finished folder is an ordinary one
        fill(temp)
        if path.exists():
            old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
            path.rename(old)
            shutil.rmtree(old)
        temp.rename(path)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
