"""`anima-ui bench crowd`: the served app (the tiny demo model, in a child process) under a hostile crowd, as another
user sees it: a job's time alone and under the crowd (as a ratio), a status call's latency with 100 watchers, the
worst latency of any of the user's requests while the hostile requests run, and the time the server takes to refuse
a 1 MB prompt and a 1 MB infotext. It prints a table.

The crowd's parts are tests/test_hostile.py's too: light async clients that speak Gradio's queue protocol (join,
then the session's event stream), each bound to its own loopback address so the server sees separate devices, the
app served from a child process (a request that holds the server's GIL cannot freeze the caller), and `Flood`: one
device with 100 watchers that sends, over and over, everything the issue's table lists."""

import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx
from gradio_client.utils import apply_diff
from PIL import Image
from PIL.PngImagePlugin import PngInfo

from anima_ui.sampling.spectrum import DEFAULT_FORECASTER

# The app in a child process, on the loopback, as `anima-ui serve` starts it (demo mode: the page says so).
SERVE = """
import sys
from pathlib import Path

from anima_ui.ui.app import App, AppConfig

models, port, password = sys.argv[1], int(sys.argv[2]), sys.argv[3]
app = App(AppConfig(models_dir=Path(models), host="127.0.0.1", port=port, demo=True, preview_size=64,
                    password=password or None))
app.launch(quiet=True)
"""


class RemoteError(Exception):
    """The server ended an event with an error (what the page shows as a bare "Error" toast)."""


class Device:
    """One client device: its own source address on the loopback (127.0.0.x), its own cookies. Use as an async
    context manager. Calls take the api_name of any event, private ones included (their index is in /config)."""

    def __init__(self, url: str, address: str = "127.0.0.1", page: bool = False):
        """page: every call uses one session hash, as a page does (its calls must then not overlap); else each call
        has its own, which costs the server a new session per call."""
        self.url = url
        self.address = address
        self.session_hash = uuid.uuid4().hex if page else None
        self.http = httpx.AsyncClient(
            base_url=url, timeout=httpx.Timeout(60.0, read=None),
            transport=httpx.AsyncHTTPTransport(local_address=address),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))
        self._functions = None

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.http.aclose()

    async def login(self, password: str, user: str = "guest") -> httpx.Response:
        return await self.http.post("login", data={"username": user, "password": password})

    async def function(self, name: str) -> int:
        if self._functions is None:
            config = (await self.http.get("config")).raise_for_status().json()
            self._functions = {d.get("api_name"): d["id"] for d in config["dependencies"]}
        return self._functions[name]

    async def stream(self, name: str, *data):
        """Async iterator of the event's outputs (a list per update, diffs applied); the last one is the result."""
        session = self.session_hash or uuid.uuid4().hex
        body = {"data": list(data), "fn_index": await self.function(name), "session_hash": session}
        # json.dumps, not httpx's json=: a hostile client sends NaN and Infinity, which JSON encoders refuse.
        joined = await self.http.post("gradio_api/queue/join", content=json.dumps(body),
                                      headers={"Content-Type": "application/json"})
        if joined.status_code != 200:
            raise RemoteError(f"join {name}: HTTP {joined.status_code} {joined.text}")
        event = joined.json()["event_id"]
        outputs = None
        async with self.http.stream("GET", "gradio_api/queue/data", params={"session_hash": session}) as response:
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                message = json.loads(line[5:])
                if message.get("event_id") not in (None, event):
                    continue
                kind = message.get("msg")
                if kind == "process_generating":
                    data = message["output"]["data"]
                    outputs = data if outputs is None else [apply_diff(o, d) for o, d in zip(outputs, data)]
                    yield outputs
                elif kind == "process_completed":
                    if not message.get("success"):
                        raise RemoteError(f"{name}: {message.get('title')}: {message['output'].get('error')}")
                    data = message["output"].get("data")
                    if data is not None and outputs is None:
                        yield data
                    return
        raise RemoteError(f"{name}: the event stream ended without a result")

    async def call(self, name: str, *data) -> list:
        result = None
        async for outputs in self.stream(name, *data):
            result = outputs
        return result

    async def upload(self, path) -> dict:
        """The file as an event input (Gradio's FileData), after uploading it."""
        path = Path(path)
        with open(path, "rb") as f:
            response = await self.http.post("gradio_api/upload", files={"files": (path.name, f)})
        if response.status_code != 200:
            raise RemoteError(f"upload {path.name}: HTTP {response.status_code} {response.text}")
        return {"path": response.json()[0], "orig_name": path.name, "meta": {"_type": "gradio.FileData"}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ChildServer:
    """The app served by a child process from `workdir` (its outputs/ and presets/ live there). `pythonpath` serves
    another checkout's anima_ui (a before/after comparison)."""

    def __init__(self, models_dir, workdir, password: str | None = None, pythonpath: str | None = None,
                 presets_from=None):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        if presets_from is not None and not (self.workdir / "presets").exists():
            shutil.copytree(presets_from, self.workdir / "presets")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        env = dict(os.environ)
        # The tiny model runs in milliseconds on one thread; two OpenMP threads on a shared machine stall at barriers.
        env["OMP_NUM_THREADS"] = "1"
        if pythonpath:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, env.get("PYTHONPATH")]))
        self.log = open(self.workdir / "server.log", "ab")
        self.process = subprocess.Popen([sys.executable, "-c", SERVE, str(models_dir), str(self.port), password or ""],
                                        cwd=self.workdir, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 300.0) -> "ChildServer":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the app exited with {self.process.returncode}; see {self.workdir / 'server.log'}")
            try:
                if httpx.get(self.url, timeout=2.0).status_code in (200, 401):
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the app did not answer within {timeout:.0f} s; see {self.workdir / 'server.log'}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=20)
        self.log.close()


def form(prompt="a red fox", seed="5", steps=2, size="64x64", cfg=4.0, negative="", spectrum="off") -> list:
    """The generate event's inputs after the session, as the page sends them."""
    return [prompt, negative, seed, cfg, steps, size, spectrum, DEFAULT_FORECASTER, "projection"]


def png_with_parameters(path: Path, text: str, compressed: bool = True) -> Path:
    """A 1x1 PNG whose `parameters` chunk is `text` (zTXt when compressed: 1 MB of one letter is ~1 KB)."""
    info = PngInfo()
    info.add_text("parameters", text, zip=compressed)
    Image.new("L", (1, 1)).save(path, pnginfo=info)
    return path


FLOOD_WATCHDOG = 120.0


class Flood:
    """A crowd in a thread of its own: `watchers` phones (127.0.1.x, one page each) that follow the newest job of one
    flooding device (127.0.0.2), whose submitters send, over and over, a job the size of the user's, one far over any
    budget, a 1 MB prompt, a 5000-deep prompt, and the 1 MB-infotext PNG (`bomb`) to the restore box. A refused call
    is sent again after 0.1 s (an attacker on another machine would not pause, but would not use these cores)."""

    def __init__(self, url: str, bomb: Path, watchers: int = 100):
        self.url, self.bomb, self.watchers = url, bomb, watchers
        self.session = None
        self.watching = 0
        self.ready, self.stopped = threading.Event(), threading.Event()
        self.calls = self.refused = 0
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stopped.set()
        self.thread.join(timeout=FLOOD_WATCHDOG)

    async def _run(self):
        phones = [Device(self.url, f"127.0.1.{1 + i}", page=True) for i in range(self.watchers)]
        async with Device(self.url, "127.0.0.2") as device:
            tasks = [asyncio.create_task(self._submit(device, i)) for i in range(3)]
            tasks += [asyncio.create_task(self._watch(phone)) for phone in phones]
            while not self.stopped.is_set():
                if self.session and self.watching >= self.watchers:
                    self.ready.set()
                await asyncio.sleep(0.1)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for phone in phones:
                await phone.http.aclose()
            if isinstance(self.session, dict) and self.session.get("jobs"):
                for _ in range(10):  # the device has just flooded: the app refuses it for a second (HTTP 429)
                    try:
                        await device.call("cancel", self.session)
                        break
                    except RemoteError:
                        await asyncio.sleep(1.0)

    async def _watch(self, phone):
        counted, watched = False, None
        while True:
            if self.session is not None and self.session is not watched:  # the page follows the newest job
                watched = self.session
                try:
                    async for _ in phone.stream("watch", watched):
                        if not counted:
                            counted, self.watching = True, self.watching + 1
                except (RemoteError, httpx.HTTPError):
                    pass
            await asyncio.sleep(0.5)

    async def _submit(self, device, worker):
        floods = [form(prompt="flood", seed=str(worker), steps=12, size="128x128"),
                  form(size="2048x2048", steps=200), form(prompt="a" * 2**20), form(prompt="(" * 5000 + "x" + ")" * 5000)]
        while True:
            for values in floods:
                try:
                    session, message = (await device.call("generate", self.session, *values))[:2]
                    if not message:
                        self.session = session
                    await device.call("restore_png", await device.upload(self.bomb))  # read once, then deleted
                except (RemoteError, httpx.HTTPError):
                    self.refused += 1
                    await asyncio.sleep(0.1)
                self.calls += 2


# -- the benchmark ------------------------------------------------------------------------------------------------------
class User:
    """The well-behaved user at 127.0.0.1, on a thread and event loop of its own; records every request's latency."""

    def __init__(self, url: str):
        self.url = url
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.device = self.do(self._open())
        self.latencies: list[tuple[str, float]] = []

    async def _open(self):
        return Device(self.url, "127.0.0.1")

    def do(self, coroutine, timeout: float = 600.0):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def timed(self, what: str, coroutine, timeout: float = 600.0) -> tuple[float, object]:
        async def timing():
            started = time.perf_counter()
            result = await coroutine
            return time.perf_counter() - started, result

        seconds, result = self.do(timing(), timeout)
        self.latencies.append((what, seconds))
        return seconds, result

    def status(self, timeout: float = 600.0) -> float:
        return self.timed("status", self.device.call("status"), timeout)[0]

    def page(self) -> float:
        return self.timed("page", self.device.http.get("/"))[0]

    def job(self, seed: str, timeout: float = 600.0) -> float:
        """Seconds from Generate to the watcher's last update for a 128x128, 12-step job; the Generate call itself
        counts as one request."""
        started = time.perf_counter()
        _, outputs = self.timed("generate", self.device.call("generate", None, *form("a job on time", seed, 12,
                                                                                      "128x128")))
        session, message = outputs[:2]
        if message:
            raise RuntimeError(f"the user's job was refused: {message}")
        final = self.do(self.device.call("watch", session), timeout)
        if "Done" not in str(final[1]):
            raise RuntimeError(f"the user's job did not finish: {final[1]}")
        return time.perf_counter() - started

    def close(self):
        self.do(self.device.http.aclose())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


async def _refusal(url: str, call) -> tuple[float, str]:
    """(seconds, message) of one hostile call from 127.0.0.3; the upload, if any, is not timed."""
    async with Device(url, "127.0.0.3") as stranger:
        return await call(stranger)


def refuse_prompt(url: str, prompt: str) -> tuple[float, str]:
    async def call(stranger):
        started = time.perf_counter()
        outputs = await stranger.call("generate", None, *form(prompt=prompt))
        return time.perf_counter() - started, outputs[1]

    return asyncio.run(_refusal(url, call))


def refuse_png(url: str, png: Path) -> tuple[float, str]:
    async def call(stranger):
        upload = await stranger.upload(png)
        started = time.perf_counter()
        outputs = await stranger.call("restore_png", upload)
        return time.perf_counter() - started, outputs[-1]

    return asyncio.run(_refusal(url, call))


def add_arguments(parser):
    parser.add_argument("--models", type=Path, help="model folder (default: the tiny demo model, made once)")
    parser.add_argument("--watchers", type=int, default=100, help="watchers the flooding device keeps open")
    parser.add_argument("--seconds", type=float, default=30.0,
                        help="how long the user keeps probing (status calls and page loads) under the crowd")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each timed refusal and of the job alone")


def run(args) -> int:
    from anima_ui.fixtures.model import demo_model_dir  # writes the demo model on first use

    models = args.models or demo_model_dir()
    with tempfile.TemporaryDirectory(prefix="anima-crowd-") as scratch:
        scratch = Path(scratch)
        presets = Path(__file__).resolve().parents[2] / "presets"
        server = ChildServer(models, scratch / "served", presets_from=presets if presets.is_dir() else None)
        try:
            server.wait_ready()
            rows = _measure(server.url, scratch, args)
        finally:
            server.stop()
    width = max(len(name) for name, _ in rows)
    print(f"{'measure':<{width}}  value")
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0


def _measure(url: str, scratch: Path, args) -> list[tuple[str, str]]:
    rows = []
    prompt = "a" * 2**20
    bomb = png_with_parameters(scratch / "bomb.png", "p\n" + "a" * 1_000_000)
    for name, refuse in (("1 MB prompt", lambda: refuse_prompt(url, prompt)),
                         ("1 MB infotext (1 KB zTXt PNG)", lambda: refuse_png(url, bomb))):
        answers = [refuse() for _ in range(args.repeats)]
        message = answers[-1][1]
        if not str(message).startswith("⚠️"):
            raise RuntimeError(f"the {name} was not refused: {message!r}")
        rows.append((f"refuse a {name}, s (median of {args.repeats})",
                     f"{statistics.median(s for s, _ in answers):.3f}  ({str(message)[:70]}…)"))

    user = User(url)
    try:
        user.job("70")  # the first job of a fresh server loads the pipeline
        alone = statistics.median(user.job(str(71 + i)) for i in range(args.repeats))
        status_alone = statistics.median(user.status() for _ in range(5))
        page_alone = statistics.median(user.page() for _ in range(5))
        user.latencies.clear()
        with Flood(url, bomb, args.watchers) as flood:
            if not flood.ready.wait(FLOOD_WATCHDOG):
                raise RuntimeError(f"the flood did not start ({flood.watching} of {args.watchers} watchers)")
            status_flood = statistics.median(user.status() for _ in range(5))
            crowded = user.job("80")
            deadline = time.monotonic() + args.seconds
            while time.monotonic() < deadline:
                user.status()
                user.page()
            calls, refused, watching = flood.calls, flood.refused, flood.watching
    finally:
        user.close()
    worst_what, worst = max(user.latencies, key=lambda row: row[1])
    rows += [
        ("user's job (128x128, 12 steps) alone, s", f"{alone:.2f}"),
        (f"the same job under the crowd, s", f"{crowded:.2f}  ({crowded / alone:.2f}x alone)"),
        ("status call alone, ms (median of 5)", f"{status_alone * 1000:.0f}"),
        (f"status call with {watching} watchers + the flood, ms (median of 5)", f"{status_flood * 1000:.0f}"),
        ("page load alone, ms (median of 5)", f"{page_alone * 1000:.0f}"),
        (f"worst latency of the user's {len(user.latencies)} requests under the crowd, s",
         f"{worst:.2f}  ({worst_what})"),
        ("worst status call / page load under the crowd, s",
         " / ".join(f"{max(s for w, s in user.latencies if w == what):.2f}" for what in ("status", "page"))),
        ("hostile calls the flood made (refused by the rate limit)", f"{calls} ({refused})"),
    ]
    return rows
