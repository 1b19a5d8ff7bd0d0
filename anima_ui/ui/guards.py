"""Guards in front of the app, per client address (ASGI middleware): a back-off on wrong passwords (Gradio's /login
takes guesses as fast as they come, hundreds a second on a board, and the meetup's password is a short word on a
whiteboard), and a rate limit on the calls that make the server work (every event joins the queue; every file is
uploaded first), so one device cannot take the event loop from everyone else."""

import json
import math
import time

LOGIN_PATHS = ("/login", "/login/")
FIRST_WAIT = 2.0  # seconds after the first wrong password; each one after it doubles the wait
LONGEST_WAIT = 300.0  # so a guesser gets a dozen tries an hour, and someone who mistyped waits a few seconds
FORGET_AFTER = 3600.0  # an address with no wrong password for this long starts over


def backoff_seconds(failures: int) -> float:
    """How long an address waits after `failures` wrong passwords in a row."""
    return 0.0 if failures <= 0 else min(FIRST_WAIT * 2 ** (failures - 1), LONGEST_WAIT)


class LoginBackoff:
    """ASGI middleware in front of the app: while an address waits, its POST /login gets 429 and a line that says
    for how long, without the password being checked; a wrong password (400) starts the next, longer wait; a right
    one clears the address. Other addresses are not affected."""

    def __init__(self, app, clock=time.monotonic):
        self.app = app
        self.clock = clock
        self.failures: dict[str, tuple[int, float]] = {}  # address -> (wrong passwords in a row, last one's time)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in LOGIN_PATHS:
            await self.app(scope, receive, send)
            return
        address = (scope.get("client") or ("unknown",))[0]
        now = self.clock()
        self._forget_old(now)
        count, last = self.failures.get(address, (0, now))
        wait = last + backoff_seconds(count) - now
        if wait > 0:
            await _refuse(send, wait)
            return
        status = {}

        async def watching(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        await self.app(scope, receive, watching)
        if status.get("code") == 400:  # Gradio's "Incorrect credentials."
            self.failures[address] = (count + 1, self.clock())
        elif status.get("code") == 200:
            self.failures.pop(address, None)

    def _forget_old(self, now: float) -> None:
        """Keeps the table as small as the set of addresses still waiting or recently wrong."""
        stale = [a for a, (_, last) in self.failures.items() if now - last > max(FORGET_AFTER, LONGEST_WAIT)]
        for address in stale:
            del self.failures[address]


async def _refuse(send, wait: float, why: str = "Too many wrong passwords from this device") -> None:
    body = json.dumps({"detail": f"{why}: try again in {math.ceil(wait)} s"})
    await send({"type": "http.response.start", "status": 429,
                "headers": [(b"content-type", b"application/json"), (b"retry-after", str(math.ceil(wait)).encode())]})
    await send({"type": "http.response.body", "body": body.encode()})


# A page load joins the queue 3 times, Generate twice (submit, then the watcher), a dropped PNG once after its upload;
# a phone stays far below these. Each join costs the server a few milliseconds of its event loop (a fresh session
# alone builds the config of every component), so a device sending hundreds a second would starve everyone else.
CALLS_PATHS = ("/gradio_api/queue/join", "/gradio_api/upload")
CALLS_BURST = 30  # calls a device may make at once
CALLS_PER_SECOND = 5.0  # and then on average


class CallRateLimit:
    """ASGI middleware: a token bucket per client address over the queue joins and uploads; a call beyond it gets
    429 and a line that says when to try again. Other addresses are not affected."""

    def __init__(self, app, burst: int = CALLS_BURST, per_second: float = CALLS_PER_SECOND, clock=time.monotonic):
        self.app = app
        self.burst, self.per_second, self.clock = burst, per_second, clock
        self.buckets: dict[str, tuple[float, float]] = {}  # address -> (tokens, when they were counted)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].endswith(CALLS_PATHS):
            await self.app(scope, receive, send)
            return
        address = (scope.get("client") or ("unknown",))[0]
        now = self.clock()
        tokens, then = self.buckets.get(address, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - then) * self.per_second)
        if tokens < 1.0:
            self.buckets[address] = (tokens, now)
            await _refuse(send, (1.0 - tokens) / self.per_second, "Too many requests from this device")
            return
        self.buckets[address] = (tokens - 1.0, now)
        if len(self.buckets) > 10_000:  # addresses whose bucket is full again are forgotten
            self.buckets = {a: (t, w) for a, (t, w) in self.buckets.items() if t + (now - w) * self.per_second < self.burst}
        await self.app(scope, receive, send)
