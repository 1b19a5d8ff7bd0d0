"""The Gradio app: a phone-first page (prompt, Generate/Stop, live view, settings, A/B, history, meetup, status) and a
big-screen page at /big. Every handler here only submits, watches or cancels jobs of the JobManager.

Anyone on the LAN can call any handler with any values, so: the job manager's limits decide what is queued (per
device, by the client's address), watchers are coroutines that hold no thread while they wait, user-written text
reaches Markdown only through `plain`, uploads are capped and deleted once read, and with a password, wrong guesses
back off per address, and so do calls beyond a rate per address (anima_ui.ui.guards)."""

import asyncio
import os
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace

import gradio as gr
from starlette.middleware import Middleware

from anima_ui import download, jobs
from anima_ui.errors import UserError
from anima_ui.history import History, request_settings, settings_from_png
from anima_ui.jobs import FINISHED, JobManager, QueueLimits
from anima_ui.modelfiles import ModelPaths, missing_message
from anima_ui.pipeline import Pipeline
from anima_ui.sampling.spectrum import DEFAULT_FORECASTER, FORECASTERS
from anima_ui.ui import form, system
from anima_ui.ui.guards import CALLS_PER_SECOND, CallRateLimit, LoginBackoff
from anima_ui.ui.watch import UNREADABLE, ab_comparison, job_labels, job_status, plain, read_session

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # offline board: no calls to Gradio's analytics host


def _api_info_once_per_data_model(api_info):
    """Gradio (6.x) answers every output a handler leaves out (a watcher's update sets 2 of its 5) by building a new
    component, and each new component derives its data model's JSON schema again: 2-6 ms per skipped output, a whole
    core for 100 watchers at one update a second. The schema is the data model's alone, so it is derived once."""
    schemas = {}

    def cached(component):
        if component.data_model is None:
            return api_info(component)
        if component.data_model not in schemas:
            schemas[component.data_model] = api_info(component)
        return schemas[component.data_model]

    return cached


gr.components.Component.api_info = _api_info_once_per_data_model(gr.components.Component.api_info)

# Fixed, so a job id stored in a phone's localStorage is still readable after a server restart
# (random per start by default: gradio-app/gradio #10263). It is shipped to the page: obfuscation, not security.
SESSION_KEY = "anima-ui-session"
SESSION_SECRET = "anima-ui-browserstate-v1"
GALLERY_SIZE = 48
WATCH_TICK = 1.0  # seconds between status refreshes while nothing changes (the elapsed time moves)
# Seconds at least between two updates of a watcher on another device's jobs: every job's every step is a change, and a
# hundred phones each sent every one would take the server's event loop (a board's step takes seconds; the tiny
# model's, milliseconds). The device that submitted the jobs gets every change.
SPECTATOR_WATCH_EVERY = 2.0

HEAD = """<script>
// A phone tab that slept may look connected while its stream is dead: re-attach when it becomes visible.
document.addEventListener("visibilitychange", () => {
  if (document.visibilityState === "visible") document.querySelector("#resume")?.click();
});
</script>"""
CSS = """
#view img, #big-view img { width: 100%; height: 100%; object-fit: contain; }
#status { min-height: 2.5em; }
"""


@dataclass
class AppConfig:
    models_dir: Path
    backend: str = "torch"
    outputs_dir: Path = Path("outputs")
    presets_dir: Path = Path("presets")
    host: str = "0.0.0.0"
    port: int = 7860
    password: str | None = None
    demo: bool = False
    preview_size: int = 384
    pipeline_options: dict = field(default_factory=dict)  # Pipeline.load keyword arguments (decoder, runtime)
    user_presets_dir: Path | None = None  # where users' presets go (default: <outputs>/presets); presets_dir is read-only
    queue_limits: QueueLimits | None = None  # default: QueueLimits.for_backend(backend)
    max_upload_mb: int | None = 32  # the restore box's PNGs (a 2048x2048 PNG made here is at most 13 MB); None: any
    calls_per_second: float | None = CALLS_PER_SECOND  # queue joins and uploads per device (burst 30); None: any


def client_address(request: gr.Request | None) -> str:
    """The device a call came from, as the job manager's per-device limit counts it."""
    client = getattr(request, "client", None)
    return getattr(client, "host", None) or "unknown"


class App:
    def __init__(self, config: AppConfig):
        self.config = config
        self.history = History(config.outputs_dir)
        # Finished PNGs and previews are served from where they are: Gradio would otherwise hash (and copy) every
        # file of every update, the gallery's 48 included, once per watching phone. (The folder is in allowed_paths.)
        gr.set_static_paths([config.outputs_dir])
        self.missing = missing_message(config.models_dir)
        self.user_presets_dir = Path(config.user_presets_dir or Path(config.outputs_dir) / "presets")
        self.manager = JobManager(
            lambda: Pipeline.load(config.models_dir, backend=config.backend, **config.pipeline_options),
            self.history,
            Path(config.outputs_dir) / ".previews",
            preview_size=config.preview_size,
            limits=config.queue_limits or QueueLimits.for_backend(config.backend),
        )
        self._downloading = threading.Lock()
        paths = None if self.missing else ModelPaths.find(config.models_dir)
        self.sizes = form.size_choices(config.backend, paths, config.demo)
        self.strict_sizes = config.backend == "rknn" or (config.backend in ("onnx", "sim") and paths is not None
                                                         and self.sizes != list(form.STANDARD_SIZES))
        self.has_taesd = paths is not None and paths.taesd is not None
        self.demo = self._build()

    # -- handlers: submit / watch / cancel -----------------------------------------------------------------------
    def _request(self, prompt, negative, seed, cfg, steps, size, spectrum, forecaster):
        return form.build_request(prompt, negative, seed, cfg, steps, size, spectrum, forecaster,
                                  allowed_sizes=self.sizes if self.strict_sizes else None)

    def generate(self, session, prompt, negative, seed, cfg, steps, size, spectrum, forecaster, preview_method,
                 request: gr.Request = None):
        """-> session, inline message, fresh (tells the chained watcher whether there is a new job)."""
        try:
            generation = self._request(prompt, negative, seed, cfg, steps, size, spectrum, forecaster)
            job = self.manager.submit(generation, preview_method, owner=client_address(request))
        except UserError as exc:
            return self._refused(session, exc)
        return self._submitted({"jobs": [job.id], "ab": None, "last_seed": generation.seed}, "")

    def _submitted(self, session: dict, message: str) -> dict:
        return {self.ui.session: session, self.ui.message: message, self.ui.fresh: True}

    def _refused(self, session, exc: UserError) -> dict:
        """The page keeps following what it followed; the problem shows inline."""
        return {self.ui.session: session, self.ui.message: f"⚠️ {plain(exc)}", self.ui.fresh: False}

    def ab(self, session, prompt, negative, seed, cfg, steps, size, spectrum, forecaster, preview_method,
           request: gr.Request = None):
        """The same prompt and seed with Spectrum off and with the chosen setting (on when Settings say off) and
        forecaster; a finished twin in the history is reused. Both jobs are queued, or neither."""
        try:
            base = self._request(prompt, negative, seed, cfg, steps, size, "off", forecaster)
            setting = form.spectrum_setting(spectrum)
            forecast = replace(base, spectrum=True,
                               spectrum_params=form.spectrum_config("on" if setting == "off" else setting, forecaster))
        except UserError as exc:
            return self._refused(session, exc)
        refs, wanted = {}, []
        for key, generation in (("off", base), ("on", forecast)):
            twin = self.history.find_twin(request_settings(generation), generation.spectrum, self.manager.model_name)
            if twin is not None:
                refs[key] = {"item": twin.name}
            else:
                wanted.append((key, generation))
        try:
            queued = self.manager.submit_all([g for _, g in wanted], preview_method, owner=client_address(request))
        except UserError as exc:
            return self._refused(session, exc)
        refs.update({key: {"job": job.id} for (key, _), job in zip(wanted, queued)})
        reused = [k for k, ref in refs.items() if "item" in ref]
        note = f"Reusing the finished Spectrum-{' and '.join(reused)} image from history." if reused else ""
        return self._submitted({"jobs": [job.id for job in queued], "ab": refs, "last_seed": base.seed}, note)

    async def follow(self, session, fresh, request: gr.Request = None):
        if not fresh:
            yield gr.skip()  # every output unchanged
            return
        async for update in self.watch(session, request):
            yield update

    async def watch(self, session, request: gr.Request = None):
        """Updates to the live view, status line, A/B slider and text, and gallery, as an async generator: between
        updates it awaits the job manager's next change on the event loop, so a hundred watching phones hold no
        thread. Abandoning it (disconnect, Stop, reload) leaves the jobs running; a new page calls it again with the
        same session.
        Another device following these jobs (a phone given the session) is a spectator: one update every
        SPECTATOR_WATCH_EVERY seconds at most, and no history gallery at the end. The gallery is most of a watcher's
        cost (48 files through Gradio's postprocessing), and a hundred phones sharing one session would otherwise
        each get it at the end of every job."""
        ui = self.ui
        viewer = client_address(request)
        session, readable = read_session(session)
        if not readable:
            yield {ui.status: UNREADABLE}
            return
        ids = session["jobs"]
        if not ids and not session["ab"]:
            yield {ui.status: "Type a prompt and press **Generate**."}
            return
        followed = [self.manager.get(i) for i in ids]
        gone = next((i for i, job in zip(ids, followed) if job is None), None)
        if gone is not None:
            yield {ui.status: self._gone(gone), ui.gallery: await asyncio.to_thread(self.gallery)}
            return
        labels = job_labels(session)
        mine = not followed or any(job.owner in (None, viewer) for job in followed)
        every = 0.0 if mine else SPECTATOR_WATCH_EVERY
        loop = asyncio.get_running_loop()
        shown_status, shown_preview, version, sent = None, None, -1, 0.0
        while True:
            await asyncio.sleep(max(0.0, sent + every - loop.time()))
            current = next((j for j in followed if j.state not in FINISHED), None)
            if current is None:
                yield await asyncio.to_thread(self._final, session, followed, labels, mine)  # reads images from disk
                return
            update = {}
            status = job_status(self.manager, current, labels.get(current.id, ""))
            if status != shown_status:
                shown_status = update[ui.status] = status
            if current.preview_path is not None and current.preview_path != shown_preview:
                shown_preview = current.preview_path
                update[ui.view] = str(shown_preview)
            if update:  # nothing new, nothing sent
                yield update
                sent = loop.time()
            version = await self.manager.changed(version, timeout=WATCH_TICK)

    def _gone(self, job_id: str) -> str:
        if self.manager.expired(job_id):
            return (f"⌛ **Job expired:** the server keeps the last {jobs.KEEP_FINISHED_JOBS} finished jobs and this "
                    "one is older. If it finished, its image is in **History**.")
        return "The job this page followed is gone (the server restarted). Finished images are in **History**."

    def _final(self, session, jobs, labels, with_gallery: bool = True) -> dict:
        ui = self.ui
        last = jobs[-1] if jobs else None
        lines = [job_status(self.manager, j, labels.get(j.id, "")) for j in jobs]
        update = {ui.gallery: self.gallery()} if with_gallery else {}
        if last is not None and last.item is not None:
            update[ui.view] = str(last.item.png_path)
        elif last is not None and last.preview_path is not None:
            update[ui.view] = str(last.preview_path)
        if session.get("ab"):
            pair, update[ui.ab_text] = ab_comparison(session, self.manager, self.history)
            if pair is not None:
                update[ui.ab_slider], update[ui.view] = pair, pair[1]
            if not jobs:
                lines = ["✅ **A/B** both images were already in history"]
        update[ui.status] = "\n\n".join(lines)
        return update

    def cancel(self, session):
        session, _ = read_session(session)
        cancelled = [job for job in map(self.manager.get, session["jobs"]) if job is not None
                     and job.state not in FINISHED and self.manager.cancel(job.id) is not None]
        if not cancelled:
            return "Nothing to stop."
        return "Stopping… a running job stops at the next branch boundary."

    # -- handlers: form, history, presets ---------------------------------------------------------------------------
    def gallery(self):
        return [(str(item.png_path), item.caption) for item in self.history.items()[:GALLERY_SIZE]]

    def _form_values(self, settings: dict, note: str) -> dict:
        ui = self.ui
        spectrum = settings.get("spectrum_params") or {}
        update = {ui.prompt: settings["prompt"], ui.negative: settings["negative"], ui.seed: str(settings["seed"]),
                  ui.cfg: settings["cfg"], ui.steps: settings["steps"],
                  ui.spectrum: spectrum.get("setting", "on") if settings["spectrum"] else "off"}
        if settings["spectrum"]:
            update[ui.forecaster] = spectrum.get("forecaster", DEFAULT_FORECASTER)
        size = f"{settings['width']}x{settings['height']}"
        if self.strict_sizes and size not in self.sizes:
            note += f" ⚠️ {size} has no graphs on this backend; choose another size."
        else:
            update[ui.size] = size
        return update | {ui.message: note}

    def restore_selected(self, evt: gr.SelectData):
        """Gallery click: the served file keeps the history item's name."""
        value = evt.value or {}
        path = (value.get("image") or {}).get("path") if isinstance(value, dict) else None
        item = self.history.get(Path(path).stem) if path else None
        if item is None:
            return {self.ui.message: "⚠️ That image is no longer in history."}
        return self._form_values(item.settings, f"Restored the settings of {item.png_path.name}.")

    def restore_png(self, path):
        """The upload is read once and deleted (Gradio would keep it a day), and the drop box cleared."""
        if not path:
            return {self.ui.message: ""}
        try:
            settings = settings_from_png(path)
        except UserError as exc:
            return {self.ui.message: f"⚠️ {plain(exc)}", self.ui.drop: None}
        finally:
            if Path(path).resolve().is_relative_to(Path(self.demo.GRADIO_CACHE).resolve()):  # Gradio's uploads only
                Path(path).unlink(missing_ok=True)
        return self._form_values(settings, f"Restored the settings of {plain(Path(path).name)}.") | {self.ui.drop: None}

    def restore_session_form(self, session):
        """On page load: the form shows the settings of the job this browser follows (a reloaded phone sees what
        is running, not an empty prompt)."""
        ids = read_session(session)[0]["jobs"]
        job = self.manager.get(ids[-1]) if ids else None
        if job is None:
            return {self.ui.message: ""}
        return self._form_values(request_settings(job.request), "")

    def reuse_seed(self, session):
        seed = read_session(session)[0]["last_seed"]
        return str(seed) if seed is not None else gr.skip()

    def apply_preset(self, name):
        ui = self.ui
        try:
            values = form.load_preset(self.config.presets_dir, self.user_presets_dir, name)
        except UserError as exc:
            return {ui.message: f"⚠️ {plain(exc)}"}
        fields = {key: getattr(ui, key) for key in form.PRESET_KEYS}
        return ({fields[key]: value for key, value in values.items()}
                | {ui.message: f"Preset **{plain(name)}** applied."})

    def preset_choices(self):
        return gr.update(choices=form.list_presets(self.config.presets_dir, self.user_presets_dir))

    def save_preset(self, name, prompt, negative, cfg, steps, size, spectrum, forecaster):
        try:
            stem = form.save_preset(self.config.presets_dir, self.user_presets_dir, name, {
                "prompt": prompt, "negative": negative, "cfg": cfg, "steps": steps, "size": size, "spectrum": spectrum,
                "forecaster": forecaster})
        except UserError as exc:
            return {self.ui.message: f"⚠️ {plain(exc)}"}
        return {self.ui.preset: self.preset_choices() | {"value": stem}, self.ui.message: f"Saved preset **{stem}**."}

    def download_models(self):
        """Fetch the missing official files, then prepare them for the backend (export, RKNN conversion). Its button
        shows only while the model is missing, but any client can call it: it refuses then, and while another call
        runs."""
        if not self.missing:
            yield "⚠️ The model files are already in place: there is nothing to download."
            return
        if not self._downloading.acquire(blocking=False):
            yield "⚠️ A download is already running; its progress shows on the page that started it."
            return
        try:
            yield from self._download_and_prepare()
        finally:
            self._downloading.release()

    def _download_and_prepare(self):
        plan = download.download_plan(self.config.models_dir)
        lines = []
        try:
            for line in download.download(plan, self.config.models_dir):
                lines = (lines + [line])[-8:]
                yield "\n".join(lines)
            self.missing = missing_message(self.config.models_dir)
            if self.missing:
                yield "\n".join(lines + [f"⚠️ still missing: {self.missing}"])
                return
            for line in download.prepare(self.config.models_dir, self.config.backend):
                lines = (lines + [line])[-8:]
                yield "\n".join(lines)
        except UserError as exc:
            yield "\n".join(lines + [f"⚠️ {exc}"])
            return
        yield "\n".join(lines + ["✅ All files are in place; the first generation loads the model."])

    def status_panel(self):
        return system.status_markdown(self.manager, self.config.backend, self.config.models_dir)

    def big_screen(self, tick: int):
        """The running job's live preview, else the recent results one after another."""
        ui = self.ui
        running = self.manager.running()
        if running is not None and running.preview_path is not None:
            return {ui.big_view: str(running.preview_path), ui.big_caption: job_status(self.manager, running)}
        items = self.history.items()[:12]
        if not items:
            return {ui.big_caption: "Waiting for the first picture…"}
        item = items[tick % len(items)]
        return {ui.big_view: str(item.png_path), ui.big_caption: f"{plain(item.settings['prompt'][:120])} · {item.caption}",
                ui.tick: tick + 1}

    # -- layout -----------------------------------------------------------------------------------------------------
    def _build(self) -> gr.Blocks:
        config = self.config
        url = system.public_url(config.host, config.port)
        with gr.Blocks(title="Anima on the NPU", fill_width=True, delete_cache=(3600, 86400)) as demo:
            session = gr.BrowserState(None, storage_key=SESSION_KEY, secret=SESSION_SECRET)
            fresh = gr.State(False)
            gr.Markdown("## Anima on the NPU")
            if config.demo:
                gr.Markdown("🧪 **Demo mode:** a random-weight tiny model; pictures are noise by design.",
                            elem_id="demo-banner")
            with gr.Group(visible=bool(self.missing), elem_id="missing"):
                plan = download.download_plan(config.models_dir)
                then = ("; then the button exports and converts the graphs for the NPU, as `anima-ui prepare` does "
                        "(resumable: press it again after an interruption)" if config.backend == "rknn" else "")
                gr.Markdown(f"⚠️ **The model is not ready:** {self.missing}\n\n"
                            f"Download the official files ({len(plan)} files) into `{config.models_dir}`{then}:\n\n"
                            + "\n".join(f"- `{d.dest}` ← {d.url}" for d in plan))
                fetch = gr.Button("Download the official files", elem_id="download")
                fetch_log = gr.Markdown(elem_id="download-log")

            prompt = gr.Textbox(label="Prompt", lines=3, elem_id="prompt", placeholder="a lighthouse at dusk, oil painting")
            with gr.Row():
                go = gr.Button("Generate", variant="primary", scale=3, min_width=0, elem_id="go")
                stop = gr.Button("Stop", variant="stop", scale=1, min_width=0, elem_id="stop")
                ab_button = gr.Button("A/B Spectrum", scale=2, min_width=0, elem_id="ab")
            # The picture right under the buttons, its status line under it: on a phone both fit one screen.
            view = gr.Image(label="Live view", type="filepath", format="png", interactive=False, elem_id="view",
                            height=360, buttons=["download", "fullscreen"])
            # No formula rendering where user text can appear (its $$ would become KaTeX).
            status = gr.Markdown("Type a prompt and press **Generate**.", elem_id="status", latex_delimiters=[])
            message = gr.Markdown(elem_id="message", latex_delimiters=[])

            with gr.Accordion("Settings", open=False, elem_id="settings"):
                negative = gr.Textbox(label="Negative prompt", lines=2, elem_id="negative")
                with gr.Row():
                    seed = gr.Textbox(label="Seed (-1 = random)", value="-1", scale=3, min_width=0, elem_id="seed")
                    dice = gr.Button("🎲", scale=1, min_width=0, elem_id="dice")
                    recycle = gr.Button("♻️", scale=1, min_width=0, elem_id="recycle")
                with gr.Row():
                    # No minimum/maximum: Gradio would answer out-of-range values with a toast; build_request says it inline.
                    cfg = gr.Number(label="CFG", value=4.0, step=0.5, min_width=0, elem_id="cfg")
                    # the demo's tiny model runs 20 steps in seconds, and 20 steps let Spectrum forecast 9 of them
                    steps = gr.Number(label="Steps", value=20 if config.demo else 30, min_width=0, elem_id="steps")
                size = gr.Dropdown(self.sizes, value=self.sizes[0] if self.sizes else None, label="Size (width x height)",
                                   allow_custom_value=not self.strict_sizes, elem_id="size")
                with gr.Row():
                    spectrum = gr.Radio(list(form.SPECTRUM_CHOICES), value="off", scale=2, min_width=0,
                                        label="Spectrum: forecast steps (on: about half the model evaluations; "
                                              "fast: half again, larger error, best at 28+ steps)",
                                        elem_id="spectrum")
                    forecaster = gr.Dropdown(list(FORECASTERS), value=DEFAULT_FORECASTER, scale=1, min_width=0,
                                             label=f"Forecaster ({DEFAULT_FORECASTER}: closest to the full run)",
                                             elem_id="spectrum-forecaster")
                preview_method = gr.Radio(["projection", "taew2_1"] if self.has_taesd else ["projection"],
                                          value="projection", label="Preview", elem_id="preview-method")
                # Custom values pass: a preset saved after this page was built is not among the choices the server
                # checks (load_preset refuses unknown names itself); the list itself is refreshed on every page load.
                preset = gr.Dropdown(form.list_presets(config.presets_dir, self.user_presets_dir), value=None,
                                     label="Preset", elem_id="preset", allow_custom_value=True)
                with gr.Row():
                    preset_name = gr.Textbox(label="Save current settings as preset", scale=3, min_width=0,
                                             elem_id="preset-name")
                    save_preset = gr.Button("Save", scale=1, min_width=0, elem_id="save-preset")

            with gr.Accordion("A/B: Spectrum off vs your setting", open=True, elem_id="ab-panel"):
                ab_slider = gr.ImageSlider(label="Spectrum off | on", type="filepath", format="png", interactive=False,
                                           elem_id="ab-slider")
                ab_text = gr.Markdown(elem_id="ab-text")

            with gr.Accordion("History", open=True, elem_id="history"):
                gallery = gr.Gallery(value=self.gallery, columns=3, height=420, format="png", allow_preview=True,
                                     label="Finished images (tap one to reuse its settings)", elem_id="gallery")
                drop = gr.File(label="Drop a PNG made here (or by A1111) to restore its settings", file_types=[".png"],
                               type="filepath", elem_id="drop")

            with gr.Accordion("Meetup", open=False, elem_id="meetup"):
                gr.HTML(system.qr_html(url))
                gr.Markdown(f"Scan to join. Big screen: [{url}big]({url}big)")

            with gr.Accordion("Status", open=False, elem_id="status-panel"):
                status_box = gr.Markdown(elem_id="system-status")
                gr.Timer(5.0).tick(self.status_panel, None, status_box, show_progress="hidden",
                                   api_visibility="private")
            resume = gr.Button("resume", visible="hidden", elem_id="resume")

            form_inputs = [prompt, negative, seed, cfg, steps, size, spectrum, forecaster, preview_method]
            watch_outputs = [view, status, ab_slider, ab_text, gallery]
            light = {"concurrency_limit": None, "show_progress": "hidden"}
            after_go = go.click(self.generate, [session, *form_inputs], [session, message, fresh], api_name="generate",
                                **light).then(self.follow, [session, fresh], watch_outputs, api_visibility="private", **light)
            after_ab = ab_button.click(self.ab, [session, *form_inputs], [session, message, fresh], api_name="ab",
                                       **light).then(self.follow, [session, fresh], watch_outputs,
                                                     api_visibility="private", **light)
            on_load = demo.load(self.watch, session, watch_outputs, api_name="reattach", api_visibility="private", **light)
            watchers = [after_go, after_ab, on_load]
            on_resume = resume.click(self.watch, session, watch_outputs, api_name="watch", cancels=watchers, **light)
            watchers.append(on_resume)
            # Only one watcher per page writes the status line: a new one cancels the others.
            for button in (go, ab_button):
                button.click(None, cancels=watchers[2:], api_visibility="private")
            stop.click(self.cancel, session, message, api_name="cancel", **light)

            dice.click(lambda: "-1", None, seed, api_visibility="private", **light)
            recycle.click(self.reuse_seed, session, seed, api_visibility="private", **light)
            form_fields = [prompt, negative, seed, cfg, steps, size, spectrum, forecaster, message]
            gallery.select(self.restore_selected, None, form_fields, api_visibility="private", **light)
            drop.upload(self.restore_png, drop, [drop, *form_fields], api_name="restore_png", **light)
            preset.input(self.apply_preset, preset, [prompt, negative, cfg, steps, size, spectrum, forecaster, message],
                         api_name="apply_preset", **light)
            save_preset.click(self.save_preset, [preset_name, prompt, negative, cfg, steps, size, spectrum, forecaster],
                              [preset, message], api_name="save_preset", **light)
            fetch.click(self.download_models, None, fetch_log, api_visibility="private", **light)
            demo.load(self.status_panel, None, status_box, api_name="status", **light)
            demo.load(self.restore_session_form, session, form_fields, api_visibility="private", **light)
            demo.load(self.preset_choices, None, preset, api_visibility="private", **light)

        with demo.route("Big screen", "/big"):
            gr.Markdown("## Anima on the NPU — live")
            big_view = gr.Image(type="filepath", format="png", interactive=False, show_label=False, elem_id="big-view",
                                height="78vh", buttons=["fullscreen"])
            big_caption = gr.Markdown(elem_id="big-caption", latex_delimiters=[])
            tick = gr.State(0)
            gr.HTML(system.qr_html(url))
            gr.Timer(3.0).tick(self.big_screen, tick, [big_view, big_caption, tick], show_progress="hidden",
                               api_visibility="private")
        # The components the handlers return updates for, by name.
        self.ui = SimpleNamespace(
            session=session, fresh=fresh, message=message, view=view, status=status, ab_slider=ab_slider,
            ab_text=ab_text, gallery=gallery, prompt=prompt, negative=negative, seed=seed, cfg=cfg, steps=steps,
            size=size, spectrum=spectrum, forecaster=forecaster, preset=preset, big_view=big_view,
            big_caption=big_caption, tick=tick, drop=drop,
        )
        return demo

    # -- launching --------------------------------------------------------------------------------------------------
    def _guards(self) -> list[Middleware]:
        guards = []
        if self.config.calls_per_second:
            guards.append(Middleware(CallRateLimit, per_second=self.config.calls_per_second))
        if self.config.password:
            guards.append(Middleware(LoginBackoff))
        return guards

    def launch(self, **overrides):
        self.demo.queue(max_size=64, default_concurrency_limit=None, api_open=False)
        kwargs = dict(
            server_name=self.config.host,
            server_port=self.config.port,
            auth=_auth(self.config.password),
            auth_message="The password is on the whiteboard.",
            app_kwargs={"middleware": self._guards()},
            max_file_size=self.config.max_upload_mb * 2**20 if self.config.max_upload_mb else None,
            allowed_paths=[str(Path(self.config.outputs_dir).resolve())],
            footer_links=[],
            run_history=False,
            enable_monitoring=False,
            max_threads=64,
            theme=gr.themes.Soft(),
            css=CSS,
            head=HEAD,
        )
        kwargs.update(overrides)
        return self.demo.launch(**kwargs)

    def close(self):
        self.demo.close()
        self.manager.close()


def _auth(password: str | None):
    if not password:
        return None
    # Any user name: the meetup shares one password.
    return lambda _user, given: given == password
