"""What the board is doing, as the status panel shows it (memory, the process, the NPU runtime; the numbers are read
by anima_ui.runtime.memory), and the LAN address with its QR code."""

import socket

import segno

from anima_ui import checkup
from anima_ui.runtime import quantized_ffn
from anima_ui.runtime.memory import GIB, process_memory, read_meminfo, swap_used
from anima_ui.runtime.profile import find_profiles


def lan_address() -> str:
    """The address other devices on the LAN reach us at. Connecting a UDP socket sends no packet; it only makes
    the kernel choose the outgoing interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def public_url(host: str, port: int) -> str:
    shown = lan_address() if host in ("0.0.0.0", "", "::") else host
    return f"http://{shown}:{port}/"


def qr_html(url: str) -> str:
    data_uri = segno.make(url, error="m").svg_data_uri(scale=8, border=2)
    return (f'<div id="qr" style="text-align:center"><img src="{data_uri}" alt="QR code for {url}" '
            f'style="width:min(70vw,320px);image-rendering:pixelated"><p><a href="{url}">{url}</a></p></div>')


def status_markdown(manager, backend: str, models_dir=None) -> str:
    mem = read_meminfo()
    proc = process_memory()
    pipeline = manager.pipeline
    runtime = pipeline.runtime if pipeline is not None else None
    if pipeline is not None:
        model = pipeline.paths.dit.name
    else:
        model = f"not loaded ({manager.load_error})" if manager.load_error else "loading…"
    lines = [
        f"**Backend** {backend} · **Model** {model}",
        f"**NPU contexts open** {runtime.open_contexts if runtime is not None else 0}"
        + (f" · **FFNs running** {runtime.ffn}" if runtime is not None else ""),
        f"**MemAvailable** {mem.get('MemAvailable', 0) / GIB:.2f} GiB · **Swap used** {swap_used(mem) / GIB:.2f} GiB",
        f"**This process** RSS {proc['rss'] / GIB:.2f} GiB · PSS {proc['pss'] / GIB:.2f} GiB",
        f"**Jobs in line** {len(manager.line())}",
    ]
    lines += runtime_lines(pipeline, backend, models_dir)
    if models_dir is not None:
        lines += quantized_ffn.folder_lines(models_dir)
        lines += checkup.panel_lines(models_dir)  # the NPU stack, as `anima-ui doctor --quick` sees it
    gate = gate_warning(runtime)
    if gate:
        lines.append(f"⚠️ **Memory gate:** {gate}")
    swap = swap_warning(runtime)
    if swap:
        lines.append(f"⚠️ **Swap:** {swap}")
    return "\n\n".join(lines)


def runtime_lines(pipeline, backend: str, models_dir) -> list[str]:
    """How the branch graphs run: the current (or last) generation's plan and why; before any, the tune profiles
    `anima-ui tune` left for this backend."""
    choice = pipeline.choice if pipeline is not None else None
    if choice is not None:
        return [f"**Runtime** {choice.summary()}"]
    if backend == "torch" or models_dir is None:
        return []
    profiles = find_profiles(models_dir, backend)
    if not profiles:
        return ["**Tune profile** none: `anima-ui tune` measures the fastest way to run the graphs here"]
    return [f"**Tune profile** {profile.summary()}" for profile in profiles]


def gate_warning(runtime) -> str | None:
    """The memory gate's message while it holds the next context back (runtime.gate_status is a
    anima_ui.runtime.memory.GateStatus); None when it lets contexts open or nothing is running."""
    status = runtime.gate_status if runtime is not None else None
    if status is None or status.ok:
        return None
    return status.message


def swap_warning(runtime) -> str | None:
    """Swap that grew since the run opened without being swapped back in: shown, never a reason to refuse."""
    status = runtime.gate_status if runtime is not None else None
    return getattr(status, "warning", None)
