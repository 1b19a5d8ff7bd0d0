"""The RK3588's NPU stack as this process sees it, and what to do about each missing piece.

The pieces, bottom up: the rknpu kernel driver and its DRM render node (/dev/dri/renderD129, group render), the
user's access to it, librknnrt.so (Rockchip's runtime library: neither the rknn-toolkit-lite2 wheel nor
rknn-toolkit2 ships it; RKNNLite loads /usr/lib/librknnrt.so or the file LIBRKNNRT_PATH names), and the
rknn-toolkit-lite2 package. Graphs converted by a newer toolkit than the runtime can fail to load ("Invalid RKNN
model version"), so the runtime must be at least the toolkit version the manifest records.

Every probe takes the paths it reads, so tests can point it at a made-up tree. `anima-ui doctor` prints them,
the backend choice asks `rknn_unavailable`, and RKNN-Lite errors name their likely causes with `explain_failure`."""

import ctypes
import grp
import importlib
import importlib.metadata
import os
import pwd
import re
from dataclasses import dataclass
from pathlib import Path

from anima_ui.runtime.native_output import runtime_errors

LIBRKNNRT_DEFAULT = Path("/usr/lib/librknnrt.so")
NPU_NODE = Path("/dev/dri/renderD129")  # RK3588: renderD128 is the GPU, renderD129 the NPU
NPU_GROUPS = ("render", "video")
GROUP_FIX = "`sudo usermod -aG render,video $USER`, then log out and back in"
LIBRKNNRT_FIX = ("get librknnrt.so for aarch64 (Rockchip's rknn-toolkit2 repository: rknpu2/runtime/Linux/librknn_api/"
                 "aarch64/librknnrt.so), then `sudo cp librknnrt.so /usr/lib/` or `export LIBRKNNRT_PATH=/path/to/librknnrt.so`")
LITE_FIX = "`.venv/bin/pip install rknn-toolkit-lite2==2.5.0` (aarch64, Python 3.7-3.12; scripts/setup.sh does it on the board)"
DOCTOR = "`anima-ui doctor` checks each of these"

_VERSION = re.compile(rb"librknnrt version: ([0-9][0-9A-Za-z.+-]*)")


# -- versions ------------------------------------------------------------------------------------------------------
def version_tuple(text: str | None) -> tuple[int, ...] | None:
    """(2, 5, 0) from "2.5.0", "2.3.2 (429f97ae6b@...)" or "2.0.0b0"; None when it holds no version."""
    match = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", text or "")
    return tuple(int(part or 0) for part in match.groups()) if match else None


def runtime_covers(runtime: str | None, toolkit: str | None) -> bool | None:
    """Whether a librknnrt of version `runtime` is known to load graphs converted by rknn-toolkit2 `toolkit`
    (runtime >= toolkit); None when either version is unknown."""
    r, t = version_tuple(runtime), version_tuple(toolkit)
    return None if r is None or t is None else r >= t


# -- librknnrt.so --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Librknnrt:
    path: Path
    exists: bool
    version: str | None  # the "librknnrt version: x.y.z" the library embeds
    load_error: str | None  # None when it loads into this process

    @property
    def ok(self) -> bool:
        return self.exists and self.load_error is None


def librknnrt_path(environ=os.environ) -> Path:
    return Path(environ["LIBRKNNRT_PATH"]) if environ.get("LIBRKNNRT_PATH") else LIBRKNNRT_DEFAULT


def librknnrt_version(path: Path) -> str | None:
    try:
        match = _VERSION.search(Path(path).read_bytes())
    except OSError:
        return None
    return match.group(1).decode() if match else None


def find_librknnrt(environ=os.environ, load: bool = True) -> Librknnrt:
    path = librknnrt_path(environ)
    if not path.is_file():
        return Librknnrt(path, False, None, f"{path} not found")
    load_error = None
    if load:
        try:
            ctypes.CDLL(str(path))
        except OSError as exc:
            load_error = str(exc)
    return Librknnrt(path, True, librknnrt_version(path), load_error)


# -- rknn-toolkit-lite2 ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Lite2:
    version: str | None  # the installed distribution's version
    import_error: str | None  # None when `from rknnlite.api import RKNNLite` works


def find_lite2() -> Lite2:
    try:
        version = importlib.metadata.version("rknn-toolkit-lite2")
    except importlib.metadata.PackageNotFoundError:
        version = None
    try:
        importlib.import_module("rknnlite.api").RKNNLite
    except ImportError as exc:
        return Lite2(version, str(exc) or type(exc).__name__)
    except AttributeError:
        return Lite2(version, "rknnlite.api has no RKNNLite")
    return Lite2(version, None)


# -- the NPU device, its driver, the user's access ---------------------------------------------------------------
@dataclass(frozen=True)
class NpuDevice:
    soc: str | None  # "rockchip,rk3588" from the device tree
    driver: str | None  # the kernel driver bound to the NPU ("RKNPU"), None when none is
    driver_version: str | None  # from debugfs (readable by root only); the runtime reports it after an init
    node: Path | None  # the NPU's render node, None when there is none
    access: bool  # this process may open the node read-write
    node_group: str | None  # the group owning the node
    user: str
    groups: tuple[str, ...]  # this process's groups
    listed_groups: tuple[str, ...]  # groups /etc/group lists the user in (a new login picks them up)

    @property
    def present(self) -> bool:
        return self.node is not None or self.driver is not None

    def access_fix(self) -> str | None:
        """The command that gives this user the NPU, None when it has it (or there is no NPU)."""
        if self.node is None or self.access:
            return None
        group = self.node_group or "render"
        if group in self.listed_groups and group not in self.groups:
            return f"{self.user} is in group {group} but this login predates it: log out and back in (or `newgrp {group}`)"
        return GROUP_FIX


def find_npu(root: Path = Path("/"), access=os.access) -> NpuDevice:
    root = Path(root)
    soc = _device_tree_soc(root / "proc/device-tree/compatible")
    driver, node = None, None
    drm = root / "sys/class/drm"
    for card in sorted(drm.glob("renderD*")) if drm.is_dir() else []:
        bound = (card / "device" / "driver")
        name = os.path.basename(os.path.realpath(bound)) if bound.exists() else ""
        if name.lower() == "rknpu":
            driver, node = name, root / "dev/dri" / card.name
    if driver is None and (root / "sys/bus/platform/drivers/RKNPU").is_dir():
        driver = "RKNPU"
    if node is None and (root / "dev/dri" / NPU_NODE.name).exists() and (driver or (soc or "").startswith("rockchip,rk3588")):
        node = root / "dev/dri" / NPU_NODE.name
    node_group = None
    if node is not None and node.exists():
        try:
            node_group = grp.getgrgid(node.stat().st_gid).gr_name
        except KeyError:
            node_group = str(node.stat().st_gid)
    user = pwd.getpwuid(os.getuid()).pw_name
    return NpuDevice(
        soc=soc, driver=driver, driver_version=_debugfs_driver_version(root), node=node,
        access=node is not None and access(node, os.R_OK | os.W_OK), node_group=node_group, user=user,
        groups=tuple(sorted({_group_name(g) for g in {os.getgid(), *os.getgroups()}})),
        listed_groups=tuple(sorted(g.gr_name for g in grp.getgrall() if user in g.gr_mem)),
    )


def _device_tree_soc(path: Path) -> str | None:
    try:
        names = path.read_bytes().split(b"\0")
    except OSError:
        return None
    rockchip = [n.decode() for n in names if n.startswith(b"rockchip,rk")]
    return rockchip[-1] if rockchip else None  # the SoC comes last, after the board's name


def _debugfs_driver_version(root: Path) -> str | None:
    try:
        text = (root / "sys/kernel/debug/rknpu/version").read_text()  # "RKNPU driver: v0.9.8"
    except OSError:
        return None
    match = re.search(r"v?(\d+\.\d+\.\d+)", text)
    return match.group(1) if match else None


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


# -- what the runtime reports ----------------------------------------------------------------------------------------
def parse_sdk_version(text: str | None) -> dict[str, str]:
    """{"api": ..., "driver": ...} from RKNNLite.get_sdk_version() ("API: 2.3.2 (...)", "DRV: rknpu: 0.9.8") or from
    the runtime's init lines ("librknnrt version: 2.3.2", "RKNN Driver Information, version: 0.9.8")."""
    found = {}
    patterns = {"api": (r"API:\s*([0-9][^\s]*)", r"librknnrt version:\s*([0-9][^\s]*)"),
                "driver": (r"DRV:[^0-9\n]*([0-9][0-9.]*[0-9])", r"Driver Information[,:]? version:\s*([0-9][0-9.]*[0-9])")}
    for key, options in patterns.items():
        for pattern in options:
            match = re.search(pattern, text or "")
            if match:
                found[key] = match.group(1)
                break
    return found


# -- why an RKNN-Lite call failed --------------------------------------------------------------------------------------
_SIGNS = (  # (cause, substrings of the runtime's error lines that point to it)
    ("version", ("Invalid RKNN model version", "RKNN_ERR_MODEL_INVALID", "invalid RKNN_MAGIC", "Invalid RKNN fromat",
                 "Invalid RKNN format", "RKNN_ERR_TARGET_PLATFORM_UNMATCH", "exportDataSize")),
    ("device", ("failed to open rknpu module", "failed to open rknn device", "Permission denied",
                "RKNN_ERR_DEVICE_UNAVAILABLE")),
    ("memory", ("failed to malloc npu memory", "failed to allocate handle", "Cannot allocate memory", "Bad address",
                "RKNN_ERR_MALLOC_FAIL", "Too many open files")),
    ("submit", ("failed to submit", "RKNN_ERR_TIMEOUT")),
)


def failure_causes(call: str, errors: list[str], npu: NpuDevice | None, runtime: str | None, toolkit: str | None) -> list[str]:
    """The likely causes of a failed RKNNLite call, most likely first: what the runtime's error lines name,
    else what the facts of this machine point to, else every cause that gives the same -1."""
    text = "\n".join(errors).lower()
    named = [cause for cause, signs in _SIGNS if any(s.lower() in text for s in signs)]
    if call == "load_rknn":  # RKNNLite only reads the file here; the runtime first sees it at init
        return named or ["file"]
    no_access = npu is not None and (npu.node is None or not npu.access)
    covers = runtime_covers(runtime, toolkit)
    facts = (["device"] if no_access else []) + (["version"] if covers is False else [])
    if named:
        return list(dict.fromkeys(named + facts))
    if facts:
        return facts
    # nothing points anywhere: every cause that gives the same -1 and that this machine does not rule out
    possible = ["memory", "device", "version"] if call != "inference" else ["submit", "memory"]
    ruled_out = {"device"} if npu is not None and npu.access else set()
    ruled_out |= {"version"} if covers else set()
    return [cause for cause in possible if cause not in ruled_out]


def cause_text(cause: str, npu: NpuDevice | None, runtime: str | None, toolkit: str | None) -> str:
    if cause == "file":
        return "the graph file is missing or unreadable: convert the graphs again with `anima-ui convert-rknn`"
    if cause == "device":
        if npu is not None and npu.node is None:
            return "no NPU device node (the rknpu kernel driver is not loaded): use a board image whose kernel has the RKNPU driver"
        node = npu.node if npu is not None else NPU_NODE
        fix = (npu.access_fix() if npu is not None else None) or GROUP_FIX
        return f"no access to the NPU device {node}: {fix}"
    if cause == "version":
        want = f"rknn-toolkit2 {toolkit}, which converted the graphs" if toolkit else "the rknn-toolkit2 that converted the graphs"
        have = f"librknnrt.so {runtime} is" if runtime_covers(runtime, toolkit) is False else "librknnrt.so may be"
        return f"{have} older than {want} (\"Invalid RKNN model version\"): install librknnrt.so >= {toolkit or 'that version'}: {LIBRKNNRT_FIX}"
    if cause == "memory":
        return ("out of NPU memory (every context of a process shares one 4 GB NPU address space, other NPU programs "
                "count too): stop other NPU programs, or open one context at a time with --no-prefetch")
    return "the NPU driver failed to run the graph (seen under concurrent init and inference): run with --no-prefetch, update the board's rknpu driver"


def explain_failure(call: str, file: str, captured: str, toolkit: str | None, npu: NpuDevice | None = None,
                    library: Librknnrt | None = None) -> str:
    """One line for a failed load_rknn / init_runtime / inference: the runtime's own error lines, then the
    likely causes with their fixes."""
    errors = runtime_errors(captured)
    if npu is None:
        npu = find_npu()
    if library is None:
        library = find_librknnrt(load=False)
    runtime = parse_sdk_version(captured).get("api") or library.version
    quoted = f" (the runtime said: {' | '.join(errors[:4])})" if errors else ""
    causes = failure_causes(call, errors, npu, runtime, toolkit)
    listed = "; ".join(cause_text(c, npu, runtime, toolkit) for c in causes)
    label = "likely cause" if len(causes) == 1 else "likely causes, most likely first"
    return f"RKNNLite {call} failed for {file}{quoted}. {label}: {listed}. {DOCTOR}"

