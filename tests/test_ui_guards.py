"""The guards per client address (the back-off on wrong passwords, the call rate limit), each in front of a stand-in
for Gradio's routes (the served app is checked in tests/test_hostile.py)."""

import asyncio
import json

from anima_ui.ui.guards import FIRST_WAIT, LONGEST_WAIT, CallRateLimit, LoginBackoff, backoff_seconds


def test_each_wrong_password_doubles_the_wait_up_to_the_longest():
    assert [backoff_seconds(n) for n in range(4)] == [0.0, FIRST_WAIT, 2 * FIRST_WAIT, 4 * FIRST_WAIT]
    assert backoff_seconds(100) == LONGEST_WAIT


class Clock:
    now = 1000.0

    def __call__(self):
        return self.now


def login(middleware, address, password, path="/login"):
    """One POST to `path` through the middleware in front of a stand-in for Gradio's login route -> (status, body)."""
    sent = []

    async def gradio(scope, receive, send):
        status = 200 if password == "right" else 400
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b""}

    middleware.app = gradio
    scope = {"type": "http", "method": "POST", "path": path, "client": (address, 5000)}
    asyncio.run(middleware(scope, receive, send))
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(body)


def test_an_address_waits_after_wrong_passwords_and_others_do_not():
    clock = Clock()
    guard = LoginBackoff(None, clock=clock)
    assert login(guard, "10.0.0.5", "wrong")[0] == 400
    status, body = login(guard, "10.0.0.5", "right")
    assert status == 429 and body["detail"] == f"Too many wrong passwords from this device: try again in {FIRST_WAIT:.0f} s"
    assert login(guard, "10.0.0.6", "right")[0] == 200  # another device
    clock.now += FIRST_WAIT
    assert login(guard, "10.0.0.5", "wrong")[0] == 400  # the wait is over: the second wrong one waits twice as long
    clock.now += FIRST_WAIT
    assert login(guard, "10.0.0.5", "right")[0] == 429
    clock.now += FIRST_WAIT
    assert login(guard, "10.0.0.5", "right")[0] == 200  # a right password clears the address
    assert login(guard, "10.0.0.5", "wrong")[0] == 400 and guard.failures["10.0.0.5"][0] == 1
    assert login(guard, "10.0.0.5", "wrong", path="/config")[0] == 400  # other routes are not held back


def test_calls_beyond_the_rate_wait_per_address():
    clock = Clock()
    guard = CallRateLimit(None, burst=3, per_second=2.0, clock=clock)
    join = "/gradio_api/queue/join"
    assert [login(guard, "10.0.0.7", "right", path=join)[0] for _ in range(3)] == [200] * 3  # the burst
    status, body = login(guard, "10.0.0.7", "right", path=join)
    assert status == 429 and body["detail"] == "Too many requests from this device: try again in 1 s"
    assert login(guard, "10.0.0.7", "right", path="/gradio_api/upload")[0] == 429  # uploads count too
    assert login(guard, "10.0.0.7", "right", path="/config")[0] == 200  # other routes do not
    assert login(guard, "10.0.0.8", "right", path=join)[0] == 200  # another device
    clock.now += 0.5  # one call's worth at 2 a second
    assert [login(guard, "10.0.0.7", "right", path=join)[0] for _ in range(2)] == [200, 429]
