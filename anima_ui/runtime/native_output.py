"""What a native library prints during a call, captured at the file-descriptor level so an error can quote it.

librknnrt writes its `E RKNN: ...` lines from C (printf, buffered by the C library when stdout is not a
terminal), below anything Python's sys.stdout sees. `captured_output()` points file descriptors 1 and 2 at
temporary files for the length of a call, flushes the C and Python buffers before reading them back, then
passes everything on to the real descriptors, so nothing printed is lost.

Calls may overlap (the prefetch thread initialises the next context while the caller's thread runs
inference): the first call in redirects, each call reads back only what arrived since it started, and the
last one out restores the descriptors and passes the text on. Output of other threads during that window
reaches the terminal when the window closes, a fraction of a second late."""

import ctypes
import os
import re
import sys
import tempfile
import threading
from contextlib import contextmanager

_LIBC = ctypes.CDLL(None)
_FDS = (1, 2)
_lock = threading.Lock()
_window = None  # while redirected: {"depth": int, "files": {fd: file}, "saved": {fd: duplicate of the real fd}}
_seen_info = set()  # info lines already passed on once (the runtime repeats them on every init)
_TIMESTAMP = re.compile(r"\[\d\d:\d\d:\d\d\.\d+\]\s*")


class Captured:
    text = ""  # what descriptors 1 and 2 received during the block (stdout's text, then stderr's)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    _LIBC.fflush(None)  # every C stdio stream, so printf output reaches the descriptor now


def _size(file) -> int:
    return os.fstat(file.fileno()).st_size


def _read(file, start: int) -> str:
    return os.pread(file.fileno(), max(0, _size(file) - start), start).decode("utf-8", "replace")


@contextmanager
def captured_output():
    """with captured_output() as out: call(); then out.text holds what the call (and any thread meanwhile) printed."""
    global _window
    captured = Captured()
    with _lock:
        if _window is None:
            try:
                saved = {fd: os.dup(fd) for fd in _FDS}
            except OSError:  # no descriptor to redirect (a daemon with fd 1/2 closed): nothing to capture
                saved = None
            if saved is not None:
                _flush()
                files = {fd: tempfile.TemporaryFile() for fd in _FDS}
                for fd, file in files.items():
                    os.dup2(file.fileno(), fd)
                _window = {"depth": 0, "files": files, "saved": saved}
        window = _window
        if window is not None:
            window["depth"] += 1
            starts = {fd: _size(file) for fd, file in window["files"].items()}
    try:
        yield captured
    finally:
        if window is not None:
            with _lock:
                _flush()
                captured.text = "".join(_read(window["files"][fd], starts[fd]) for fd in _FDS)
                window["depth"] -= 1
                if window["depth"] == 0:
                    _close(window)
                    _window = None


def _close(window) -> None:
    for fd in _FDS:
        os.dup2(window["saved"][fd], fd)
        os.close(window["saved"][fd])
    for fd, file in window["files"].items():
        text = _read(file, 0)
        file.close()
        passed = "".join(line for line in text.splitlines(keepends=True) if _pass_on(line))
        if passed:
            os.write(fd, passed.encode())


def _pass_on(line: str) -> bool:
    """Everything passes except a repeat of a runtime info line (`I RKNN: ...` on every one of 84 inits a step)."""
    if not line.startswith("I RKNN:"):
        return True
    key = _TIMESTAMP.sub("", line).strip()
    if key in _seen_info:
        return False
    _seen_info.add(key)
    return True


def runtime_errors(text: str) -> list[str]:
    """The runtime's error lines in captured text: `E RKNN: ...` from librknnrt and the `RKNN_ERR_...` code
    RKNNLite's traceback names; timestamps dropped, repeats dropped."""
    lines = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("E RKNN:") or "RKNN_ERR_" in line:
            line = _TIMESTAMP.sub("", line)
            if line not in lines:
                lines.append(line)
    return lines
