"""The app driven through gradio_client, on the real pipeline with the tiny random-weight model."""

import json
import shutil
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from gradio_client import Client, handle_file
from PIL import Image

from anima_ui.fixtures.model import demo_model_dir
from anima_ui.jobs import QueueLimits
from anima_ui.modelfiles import missing_message
from anima_ui.sampling.spectrum import DEFAULT_FORECASTER, plan
from helpers import GRADIO_PANDAS_NOISE, WITHOUT_TORCH, RecordingRuntimes, free_port, occupy_worker, start_app, wait_idle

pytestmark = GRADIO_PANDAS_NOISE
PRESETS = Path(__file__).parent.parent / "presets"


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    presets = tmp_path_factory.mktemp("presets")
    for preset in PRESETS.glob("*.json"):
        shutil.copy(preset, presets)
    # Every client of these tests is at 127.0.0.1, one device to the job manager: no per-device limit here
    # (tests/test_hostile.py checks it from other addresses).
    app, url = start_app(tiny_model, tmp_path_factory.mktemp("outputs"), presets,
                         queue_limits=QueueLimits.for_backend("torch", max_jobs_per_client=None))
    yield app, url
    app.close()


@pytest.fixture
def client(served):
    return Client(served[1], verbose=False)


def form(prompt="a red fox", seed="5", steps=3, size="64x64", spectrum="off", cfg=4.0, negative="", forecaster="taylor"):
    return [prompt, negative, seed, cfg, steps, size, spectrum, forecaster, "projection"]


def generate_and_watch(client, **kwargs):
    session, message = client.predict(None, *form(**kwargs), api_name="/generate")
    assert message == "", message
    job = client.submit(session, api_name="/watch")
    outputs = list(job)
    return session, outputs, job.outputs()[-1]


def test_generate_streams_previews_then_the_png_with_parameters(client, served):
    # Our job waits behind a 20-step one, so we watch before its first step however loaded the machine is (behind a
    # 6-step blocker, a loaded machine once let both jobs finish before /watch was called).
    occupy_worker(served[0].manager, steps=20)
    session, outputs, final = generate_and_watch(client, prompt="a red fox", seed="4242", steps=4)
    statuses = [o[1] for o in outputs]
    # The watcher shows the latest state when it wakes, so fast steps may be merged: some step must show.
    assert any("step" in s and "/4" in s for s in statuses), statuses
    assert "Done" in final[1] and "seed 4242" in final[1] and "VAE onnx" in final[1]  # the tiny VAE: sd.cpp cannot run it
    previews = {Path(o[0]).name for o in outputs if isinstance(o[0], str) and o[0].endswith(".jpg")}
    assert previews, "no preview was streamed"
    with Image.open(final[0]) as png:  # the client downloads exactly the file the server saved
        assert "Seed: 4242" in png.info["parameters"] and "Spectrum: off" in png.info["parameters"]
        assert "VAE decoder: onnx" in png.info["parameters"]
    assert any("left" in s for s in statuses if "step" in s), statuses  # an ETA once a step was measured
    assert final[4][0]["caption"].startswith("seed 4242")
    assert session["last_seed"] == 4242


def test_ten_users_at_once_are_served_in_order_without_overlap(served, monkeypatch):
    app, url = served
    wait_idle(app.manager)  # jobs of earlier tests finish before the recorder starts watching
    pipeline = app.manager.pipeline
    runtimes = RecordingRuntimes()  # watches the branch runtimes from outside the job engine
    monkeypatch.setattr(pipeline, "open_runtime", runtimes.wrap(pipeline.open_runtime))
    results, errors = [None] * 10, []
    barrier = threading.Barrier(10)

    def user(i):
        try:
            client = Client(url, verbose=False)
            barrier.wait()
            session, message = client.predict(None, *form(prompt="ten users", seed=str(1000 + i), steps=1),
                                              api_name="/generate")
            results[i] = (session["jobs"][0], client.submit(session, api_name="/watch").result(timeout=300)[1])
        except Exception as exc:  # noqa: BLE001 -- collected and reported by the assertion below
            errors.append(repr(exc))

    threads = [threading.Thread(target=user, args=(i,)) for i in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    job_ids = [r[0] for r in results]
    assert all("Done" in r[1] for r in results), [r[1] for r in results]
    assert len(runtimes.intervals) == 10  # one branch runtime per job: none lost, none run twice
    submitted = sorted(job_ids, key=app.manager._order.index)
    assert sorted(job_ids, key=lambda i: app.manager.get(i).started) == submitted  # served in submission order
    assert runtimes.max_open == 1 and runtimes.max_calls == 1  # never two generations on the backend at once
    assert all(end <= start for (_, end), (start, _) in zip(runtimes.intervals, runtimes.intervals[1:]))


@pytest.mark.parametrize("overrides,message", [
    ({"seed": "twelve"}, "seed must be a whole number"),
    ({"steps": 0}, "steps must be a whole number from 1"),
    ({"steps": None}, "steps must be a whole number"),
    ({"size": "100000x100000"}, "width must be a multiple of 16"),
    ({"size": "huge"}, "size must look like"),
])
def test_bad_input_gets_an_inline_message(client, served, overrides, message):
    queued_before = len(served[0].manager._order)
    session, text = client.predict({"jobs": [], "ab": None}, *form(**overrides), api_name="/generate")
    assert text.startswith("⚠️") and message in text and "Traceback" not in text
    assert session == {"jobs": [], "ab": None}  # the page keeps following what it followed
    assert len(served[0].manager._order) == queued_before


def test_empty_prompt_with_cfg_is_a_valid_job(client):
    _, _, final = generate_and_watch(client, prompt="", cfg=7.0, seed="77", steps=2)
    assert "Done" in final[1]


def test_cancel_stops_the_running_job(client, served):
    session, message = client.predict(None, *form(seed="66", steps=120, size="128x128"), api_name="/generate")
    watcher = client.submit(session, api_name="/watch")
    for output in watcher:
        if "step" in output[1]:
            break
    # Meanwhile a second user sees their place in line.
    other = client  # users are told apart by their session (BrowserState), not by their connection
    queued, _ = other.predict(None, *form(seed="67", steps=2), api_name="/generate")
    first_status = next(iter(other.submit(queued, api_name="/watch")))[1]
    assert "Queued: 1 job ahead" in first_status, first_status
    assert "Stopping" in client.predict(session, api_name="/cancel")
    # Watched from a new client: gradio_client shares one event stream per client, and the server may close it (no
    # events left once the second job is done) just as a new watch joins it, which the client reports as cancelled.
    final = Client(served[1], verbose=False).submit(session, api_name="/watch").result(timeout=120)
    assert "Cancelled" in final[1]
    job = served[0].manager.get(session["jobs"][0])
    assert job.state == "cancelled" and job.step < 120 and job.item is None
    assert "Done" in Client(served[1], verbose=False).submit(queued, api_name="/watch").result(timeout=120)[1]


def test_ab_runs_both_then_reuses_them_from_history(client, served):
    values = form(prompt="ab fox", seed="808", steps=6)
    session, message = client.predict(None, *values, api_name="/ab")
    assert len(session["jobs"]) == 2 and message == ""
    final = client.submit(session, api_name="/watch").result(timeout=300)
    off, on = final[2]
    assert Path(off).suffix == ".png" and Path(on).suffix == ".png"
    assert "speed-up" in final[3] and "PSNR" in final[3] and "SSIM" in final[3]
    assert "model evaluations 6 vs 5" in final[3] and "Forecast steps (1 of 6): 5" in final[3]
    with Image.open(off) as a, Image.open(on) as b:
        assert "Spectrum: off" in a.info["parameters"] and "Spectrum: on" in b.info["parameters"]
    again, message = client.predict(None, *values, api_name="/ab")
    assert again["jobs"] == [] and "Reusing" in message
    assert "SSIM" in client.submit(again, api_name="/watch").result(timeout=60)[3]


def test_the_demos_default_step_count_lets_spectrum_forecast(served):
    app = served[0]
    assert app.config.demo and app.ui.spectrum.value == "off" and app.ui.forecaster.value == DEFAULT_FORECASTER
    assert len(plan(int(app.ui.steps.value))[1]) > 0


def test_ab_at_4_steps_says_spectrum_forecast_nothing_and_shows_no_speed_up(client):
    session, message = client.predict(None, *form(prompt="ab short", seed="809", steps=4), api_name="/ab")
    text = client.submit(session, api_name="/watch").result(timeout=300)[3]
    assert "At 4 steps Spectrum on (taylor) forecasts no step; it needs at least 6" in text
    assert "×" not in text  # no speed-up figure


def test_a_dropped_png_restores_its_settings_with_spectrum_setting_and_forecaster(client, served):
    _, _, final = generate_and_watch(client, prompt="restore me", seed="31", steps=4, spectrum="fast",
                                     forecaster="velocity-ab")
    restored = client.predict(handle_file(final[0]), api_name="/restore_png")
    drop, prompt, negative, seed, cfg, steps, size, spectrum, forecaster, message = restored
    assert drop is None  # the upload was read, deleted and the box cleared
    assert (prompt, seed, steps, size) == ("restore me", "31", 4, "64x64")
    assert (spectrum, forecaster) == ("fast", "velocity-ab")
    assert "Restored" in message


def test_a_png_without_parameters_is_refused_inline(client, tmp_path):
    Image.new("RGB", (16, 16)).save(tmp_path / "plain.png")
    restored = client.predict(handle_file(str(tmp_path / "plain.png")), api_name="/restore_png")
    assert restored[-1].startswith("⚠️") and "no generation parameters" in restored[-1]


def test_presets_apply_and_save(client, served):
    applied = client.predict("draft", api_name="/apply_preset")
    assert applied[3] == 16 and applied[5] == "on" and "draft" in applied[-1]
    choices, message = client.predict("Night walk", "at night", "", 5.0, 7, "64x64", "fast", "reuse",
                                      api_name="/save_preset")
    assert "night-walk" in message
    saved = json.loads((served[0].user_presets_dir / "night-walk.json").read_text())
    assert (saved["steps"], saved["spectrum"], saved["forecaster"]) == (7, "fast", "reuse")


def test_status_panel_reports_the_machine(client):
    text = client.predict(api_name="/status")
    assert "MemAvailable" in text and "PSS" in text and "Backend** torch" in text and "NPU contexts open" in text
    assert "**NPU** none on this" in text or "**NPU driver**" in text  # the NPU stack, as `anima-ui doctor --quick` sees it


def test_watching_a_job_the_server_forgot(client):
    final = client.predict({"jobs": ["0123456789ab"], "ab": None}, api_name="/watch")
    assert "server restarted" in final[1]


def test_api_does_not_bypass_the_queue(served):
    request = urllib.request.Request(f"{served[1]}gradio_api/run/generate", data=b'{"data": []}',
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request)
    assert info.value.code == 404


def test_missing_model_page_and_failed_job(tmp_path):
    app, url = start_app(tmp_path / "empty-models", tmp_path / "outputs", tmp_path / "presets")
    try:
        assert "missing" in app.missing or "does not exist" in app.missing
        page = json.dumps(app.demo.config, default=str)
        assert "The model is not ready" in page and "Download the official files" in page
        assert "circlestone-labs/Anima/resolve/main/split_files/vae/qwen_image_vae.safetensors" in page
        client = Client(url, verbose=False)
        session, _ = client.predict(None, *form(), api_name="/generate")
        final = client.predict(session, api_name="/watch")
        assert "Failed" in final[1] and "does not exist" in final[1]
        assert app.history.items() == []
    finally:
        app.close()


def test_password_protects_the_app(tiny_model, tmp_path):
    app, url = start_app(tiny_model, tmp_path / "outputs", tmp_path / "presets", password="meetup-pw")
    try:
        with pytest.raises(Exception, match="(?i)auth|login|401"):
            Client(url, verbose=False)
        assert "MemAvailable" in Client(url, auth=("anyone", "meetup-pw"), verbose=False).predict(api_name="/status")
    finally:
        app.close()


def test_memory_gate_warning_reaches_the_status_panel():
    from anima_ui.runtime.memory import GateStatus
    from anima_ui.ui.system import gate_warning

    class Runtime:
        gate_status = GateStatus(False, 1.2, 0.0, "memory gate: MemAvailable 1.20 GiB is under the 1.5 GiB floor")

    assert "under the 1.5 GiB floor" in gate_warning(Runtime())
    Runtime.gate_status = GateStatus(True, 5.0, 0.0, "memory ok")
    assert gate_warning(Runtime()) is None and gate_warning(None) is None


def test_qr_code_carries_the_lan_url():
    from anima_ui.ui.system import public_url, qr_html

    url = public_url("0.0.0.0", 7860)
    assert url.startswith("http://") and url.endswith(":7860/") and "0.0.0.0" not in url
    html = qr_html(url)
    assert "data:image/svg+xml" in html and url in html


def test_demo_model_is_made_once_and_reused(tmp_path):
    folder = demo_model_dir(tmp_path)
    assert missing_message(folder) is None
    stamp = (folder / "vae" / "qwen_image_vae.safetensors").stat().st_mtime_ns
    assert demo_model_dir(tmp_path) == folder
    assert (folder / "vae" / "qwen_image_vae.safetensors").stat().st_mtime_ns == stamp


def test_python_app_py_serves_the_page_and_prints_the_url(tmp_path):
    import subprocess
    import sys

    port = free_port()
    root = Path(__file__).parent.parent
    server = subprocess.Popen([sys.executable, str(root / "app.py"), "--host", "127.0.0.1", "--port", str(port),
                               "--models", str(tmp_path / "no-models"), "--outputs", str(tmp_path / "out")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    try:
        lines = []
        for line in server.stdout:
            lines.append(line)
            if "open http://" in line:
                break
        assert any("model not ready" in line for line in lines), lines
        assert f"open http://127.0.0.1:{port}/" in lines[-1]
        for _ in range(100):
            try:
                page = urllib.request.urlopen(f"http://127.0.0.1:{port}/config").read().decode()
                break
            except OSError:
                time.sleep(0.2)
        assert "The model is not ready" in page
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_the_app_and_its_commands_import_without_torch():
    """The board installs no torch (requirements.txt): the app, the job engine and every command must still import,
    so `serve` starts and a missing torch shows as a failed job, not a dead server."""
    import subprocess
    import sys

    script = WITHOUT_TORCH + """
import importlib
from anima_ui.cli import COMMANDS
for module in ["anima_ui.ui.app", "anima_ui.jobs", "anima_ui.pipeline"] + [f"anima_ui.commands.{m}" for m, _ in COMMANDS.values()]:
    if module != "anima_ui.commands.bench":  # the benchmarks are a PC tool: torch is their requirement
        importlib.import_module(module)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr

