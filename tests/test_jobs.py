"""The job engine on the real pipeline with the tiny random-weight model (torch backend)."""

import asyncio
import shutil
import threading

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from anima_ui import jobs as jobs_module
from anima_ui import request as request_module
from anima_ui.errors import UserError
from anima_ui.fixtures.weights import write_random_taehv
from anima_ui.history import History
from anima_ui.jobs import JobManager, QueueLimits
from anima_ui.pipeline import Pipeline
from anima_ui.request import GenerationRequest
from anima_ui.ui import form
from helpers import RecordingRuntimes, occupy_worker, wait


@pytest.fixture(scope="module")
def pipeline(tiny_model):
    return Pipeline.load(tiny_model, backend="torch")


@pytest.fixture
def manager(pipeline, tmp_path):
    manager = JobManager(lambda: pipeline, History(tmp_path / "outputs"), tmp_path / "previews", preview_size=64)
    yield manager
    manager.close()


def request(seed=1, steps=3, size=64, **kwargs):
    return GenerationRequest(prompt="a red fox", seed=seed, steps=steps, width=size, height=size, **kwargs)


def test_a_job_streams_previews_and_saves_its_png(manager):
    job = wait(manager, manager.submit(request(seed=11, steps=3)))
    assert job.state == "done", job.error
    assert job.step == 3 and job.denoise_seconds > 0
    previews = sorted(job.preview_path.parent.glob("*.jpg"))
    assert [p.name for p in previews] == ["0001.jpg", "0002.jpg", "0003.jpg"]
    assert Image.open(previews[0]).format == "JPEG"
    with Image.open(job.item.png_path) as png:
        assert png.size == (64, 64) and "Seed: 11" in png.info["parameters"]
    assert job.item.summary["model"] == "anima-base-v1.0"
    assert manager.history.items()[0].name == job.item.name


def test_jobs_run_one_at_a_time_in_submission_order(manager, pipeline, monkeypatch):
    runtimes = RecordingRuntimes()  # watches the branch runtimes from outside the job engine
    monkeypatch.setattr(pipeline, "open_runtime", runtimes.wrap(pipeline.open_runtime))
    jobs = [None] * 4
    barrier = threading.Barrier(4)

    def submit(i):
        barrier.wait()
        jobs[i] = manager.submit(request(seed=100 + i, steps=1))

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for job in jobs:
        wait(manager, job)
    assert all(job.state == "done" for job in jobs)
    submitted = sorted(jobs, key=lambda j: manager._order.index(j.id))
    assert sorted(jobs, key=lambda j: j.started) == submitted
    assert len(runtimes.intervals) == 4  # one branch runtime per job: none lost, none run twice
    assert runtimes.max_open == 1 and runtimes.max_calls == 1  # never two generations on the backend at once
    assert all(end <= start for (_, end), (start, _) in zip(runtimes.intervals, runtimes.intervals[1:]))
    assert len(manager.history.items()) == 4


def test_queue_position_and_eta_come_from_measured_steps(manager):
    occupy_worker(manager)  # 128x128: running, so the jobs below wait in line
    first = manager.submit(request(seed=2, steps=2))
    second = manager.submit(request(seed=3, steps=2))
    assert (manager.position(first), manager.position(second)) == (1, 2)
    assert manager.eta_seconds(second) is None  # no 64x64 job has been measured yet
    wait(manager, second)
    occupy_worker(manager)
    third = manager.submit(request(seed=4, steps=2))
    fourth = manager.submit(request(seed=5, steps=2))
    assert 0 < manager.eta_seconds(third) < manager.eta_seconds(fourth)  # now both sizes were measured
    wait(manager, fourth)
    assert first.state == "done" and manager.position(fourth) is None and manager.eta_seconds(fourth) == 0.0


def test_cancel_running_and_queued_jobs(manager):
    running = manager.submit(request(seed=21, steps=60))
    queued = manager.submit(request(seed=22, steps=2))
    version = manager.version
    while running.step < 2:
        version = manager.wait_for_change(version, timeout=60)
    manager.cancel(queued.id)
    manager.cancel(running.id)
    wait(manager, running)
    wait(manager, queued)
    assert running.state == "cancelled" and running.step < 60 and running.item is None
    assert queued.state == "cancelled" and queued.started is None
    assert manager.history.items() == []
    after = wait(manager, manager.submit(request(seed=23, steps=2)))  # the worker is free again
    assert after.state == "done"


def test_nan_latent_fails_visibly_and_saves_nothing(tiny_model, tmp_path):
    broken = tmp_path / "nan-model"
    shutil.copytree(tiny_model, broken)
    dit = broken / "diffusion_models" / "anima-base-v1.0.safetensors"
    state = load_file(dit)
    key = next(k for k in state if "final_layer" in k and k.endswith("weight"))
    state[key] = torch.full_like(state[key], float("nan"))
    save_file(state, dit)
    manager = JobManager(lambda: Pipeline.load(broken), History(tmp_path / "outputs"), tmp_path / "previews")
    try:
        job = wait(manager, manager.submit(request(seed=31, steps=2)))
    finally:
        manager.close()
    assert job.state == "error" and "NaN" in job.error
    assert list((tmp_path / "outputs").glob("*.png")) == [] and list((tmp_path / "outputs").glob("*.json")) == []


def test_missing_model_file_fails_the_job_not_the_worker(tiny_model, tmp_path):
    broken = tmp_path / "no-vae"
    shutil.copytree(tiny_model, broken)
    (broken / "vae" / "qwen_image_vae.safetensors").unlink()
    manager = JobManager(lambda: Pipeline.load(broken), History(tmp_path / "outputs"), tmp_path / "previews")
    try:
        job = wait(manager, manager.submit(request()))
        assert job.state == "error" and "Qwen-Image VAE" in job.error and manager.load_error
        shutil.copy(tiny_model / "vae" / "qwen_image_vae.safetensors", broken / "vae")  # fixed: the next job loads
        assert wait(manager, manager.submit(request())).state == "done"
    finally:
        manager.close()


def test_the_spectrum_plan_is_simulated_once_from_form_to_image(manager, monkeypatch):
    plans = []
    real_plan = request_module.plan
    monkeypatch.setattr(request_module, "plan", lambda *a, **k: plans.append(a) or real_plan(*a, **k))
    job = manager.submit(form.build_request("a fox", "", "9", 4.0, 5, "64x64", True))
    assert wait(manager, job).state == "done" and plans == [(5,)]


def test_a_bad_request_cannot_reach_the_queue(manager):
    with pytest.raises(UserError, match="steps"):
        manager.submit(request(steps=0))
    assert manager.line() == []


def test_taew2_1_previews_when_the_file_is_present(tiny_model, tmp_path):
    model = tmp_path / "with-taesd"
    shutil.copytree(tiny_model, model)
    write_random_taehv(model / "vae_approx" / "taew2_1.safetensors")
    manager = JobManager(lambda: Pipeline.load(model), History(tmp_path / "outputs"), tmp_path / "previews",
                         preview_size=64)
    try:
        by_method = {m: wait(manager, manager.submit(request(seed=41, steps=1), preview_method=m))
                     for m in ("projection", "taew2_1")}
    finally:
        manager.close()
    assert all(job.state == "done" for job in by_method.values())
    projection, taesd = (Image.open(by_method[m].preview_path) for m in ("projection", "taew2_1"))
    assert projection.size == taesd.size == (64, 64)
    assert projection.tobytes() != taesd.tobytes()  # the same x0 went through another decoder


def test_the_queue_takes_in_what_its_limits_allow(pipeline, tmp_path):
    limits = QueueLimits(max_jobs=4, max_jobs_per_client=2, max_pixel_steps=128 * 128 * 200)
    manager = JobManager(lambda: pipeline, History(tmp_path / "outputs"), tmp_path / "previews", limits=limits)
    try:
        occupy_worker(manager, steps=200)  # 128x128 at 200 steps: exactly the budget; no owner, like the CLI
        with pytest.raises(UserError, match=r"128x144 at 200 steps is more than this board takes in one job: the "
                                            r"limit is 3.125 megapixel-steps"):
            manager.submit(GenerationRequest(prompt="p", steps=200, width=128, height=144))
        first = manager.submit(request(seed=1), owner="10.0.0.2")
        with pytest.raises(UserError, match="a device may have 2 jobs in line and this one has 1"):
            manager.submit_all([request(seed=2), request(seed=3)], owner="10.0.0.2")  # an A/B pair: both or neither
        assert len(manager.line()) == 2
        manager.submit_all([request(seed=4), request(seed=5)], owner="10.0.0.3")
        with pytest.raises(UserError, match="the queue is full: 4 jobs at most, and 4 are in line"):
            manager.submit(request(seed=5), owner="10.0.0.4")
        manager.cancel(first.id)  # a place frees up
        assert manager.submit(request(seed=6), owner="10.0.0.2").state == "queued"
    finally:
        manager.close()


def test_a_forgotten_job_id_reads_as_expired(manager, monkeypatch):
    monkeypatch.setattr(jobs_module, "KEEP_FINISHED_JOBS", 1)
    first = manager.submit(request(seed=1, steps=1))
    manager.cancel(first.id)
    manager.cancel(manager.submit(request(seed=2, steps=1)).id)  # the second finished job: the first is forgotten
    wait(manager, manager.submit(request(seed=3, steps=1)))
    assert manager.get(first.id) is None and manager.expired(first.id)
    assert not manager.expired("-" * 12) and not manager.expired(None)  # not this run's: made before a restart


def test_async_watchers_wait_without_threads_and_all_wake_on_a_change(manager):
    async def scenario():
        version = manager.version
        waiters = [asyncio.create_task(manager.changed(version, timeout=60)) for _ in range(100)]
        await asyncio.sleep(0.05)
        threads_while_waiting = threading.active_count()
        job = manager.submit(request(seed=7, steps=1))  # the change, made from this thread; the worker makes more
        woken = await asyncio.wait_for(asyncio.gather(*waiters), 60)
        return threads_while_waiting, woken, job

    threads_before = threading.active_count()
    threads_while_waiting, woken, job = asyncio.run(scenario())
    assert threads_while_waiting == threads_before  # a hundred waiters, no thread among them
    assert all(v > 0 for v in woken) and len(woken) == 100
    wait(manager, job)
