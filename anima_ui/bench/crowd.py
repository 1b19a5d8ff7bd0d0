"""A crowd for the served app: light async clients that speak Gradio's queue protocol (join, then the session's event
stream), each bound to its own loopback address so the server sees separate devices, and the app served from a child
process, so a request that holds the server's GIL cannot freeze the caller. tests/test_hostile.py and
`anima-ui bench hostile` use them."""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
from gradio_client.utils import apply_diff

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

    def __init__(self, url: str, address: str = "127.0.0.1"):
        self.url = url
        self.address = address
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
        session = uuid.uuid4().hex
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
