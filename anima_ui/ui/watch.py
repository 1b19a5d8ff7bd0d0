"""Following a browser's jobs: the status line and what the page shows while and after they run.

A browser's `session` (kept in gr.BrowserState, so it survives reloads) is {"jobs": [job ids], "ab": {"off": ref,
"on": ref} or None, "last_seed": int}, where a ref is {"job": id} or {"item": history name}. The browser sends it
with every call and any client can send anything: `read_session` is the one place that checks its shape.

Anything a user wrote (a prompt, a file or preset name, an error message that quotes a value) goes into the page's
Markdown through `plain`, so it shows as the text it is: no HTML, links, emphasis or formulas."""

import html
import re

import numpy as np
from PIL import Image

from anima_ui.infotext import decoder_label, format_seconds
from anima_ui.metrics import psnr, ssim
from anima_ui.sampling.spectrum import canonical, first_forecasting_steps

MAX_SESSION_JOBS = 2  # what the page itself keeps: one job, or the two of an A/B
UNREADABLE = "⚠️ This page's saved session is unreadable; press **Generate** to start again."
# ASCII punctuation but & and ; (which now only spell the HTML entities): a backslash makes each one literal text
MARKDOWN_PUNCTUATION = re.compile(r"([!-%'-/:<-@\[-`{-~])")

PHASES = {"export": "exporting the branch graphs for this size (once; minutes at full size)", "text": "encoding the prompt",
          "decode": "decoding the image", None: "starting"}


def plain(text) -> str:
    """`text` as Markdown that renders as exactly that text: HTML-escaped, every ASCII punctuation mark
    backslash-escaped (no emphasis, links, autolinks, headings or $$ formulas), newlines as spaces."""
    escaped = html.escape(" ".join(str(text).split("\n")), quote=False)
    return MARKDOWN_PUNCTUATION.sub(r"\\\1", escaped)


def read_session(value) -> tuple[dict, bool]:
    """(the session, whether `value` was one). None (a new browser) is an empty session; anything not shaped as
    the page writes it reads as an empty session too, and False."""
    empty = {"jobs": [], "ab": None, "last_seed": None}
    if value is None:
        return empty, True
    if not isinstance(value, dict):
        return empty, False
    jobs, ab, seed = value.get("jobs", []), value.get("ab"), value.get("last_seed")
    readable = (isinstance(jobs, list) and len(jobs) <= MAX_SESSION_JOBS and all(isinstance(i, str) for i in jobs)
                and (ab is None or _is_ab(ab))
                and (seed is None or (isinstance(seed, int) and not isinstance(seed, bool))))
    return ({"jobs": jobs, "ab": ab, "last_seed": seed}, True) if readable else (empty, False)


def _is_ab(ab) -> bool:
    return (isinstance(ab, dict) and set(ab) == {"off", "on"}
            and all(isinstance(ref, dict) and len(ref) == 1 and isinstance(ref.get("job", ref.get("item")), str)
                    for ref in ab.values()))


def job_status(manager, job, label: str = "") -> str:
    prefix = f"{label} · " if label else ""
    if job.state == "queued":
        ahead = manager.position(job)
        eta = manager.eta_seconds(job)
        when = f"done in about {format_seconds(eta)}" if eta is not None else "time estimate after the first step"
        if manager.pipeline is None and manager.load_error is None:
            when = "the model is still loading"
        waiting = f"{ahead} job{'s' if ahead != 1 else ''} ahead" if ahead else "next"
        return f"{prefix}⏳ **Queued: {waiting}** · {when}"
    if job.state == "running":
        if job.phase == "denoise" and job.step:
            kind = "computed" if job.computed else "forecast"
            what = f"step {job.step}/{job.total}** ({kind})"
        elif job.phase == "denoise":
            what = f"step 0/{job.total}**"
        else:
            what = f"{PHASES.get(job.phase, job.phase)}**"
        eta = manager.eta_seconds(job)
        left = f" · about {format_seconds(eta)} left" if eta is not None else ""
        return f"{prefix}▶️ **{what} · {format_seconds(job.elapsed)} elapsed{left}"
    if job.state == "done":
        warning = job.item.summary.get("warning")
        note = f"\n\n⚠️ {plain(warning)}" if warning else ""
        decoder = decoder_label(job.item.summary)
        vae = f" · VAE {decoder}" if decoder else ""
        return f"{prefix}✅ **Done** in {format_seconds(job.elapsed)} · seed {job.request.seed}{vae} · {job.item.png_path.name}{note}"
    if job.state == "cancelled":
        return f"{prefix}⏹️ **Cancelled** at step {job.step}/{job.total} · seed {job.request.seed}"
    return f"{prefix}❌ **Failed:** {plain(job.error)}"


def job_labels(session: dict) -> dict[str, str]:
    ab = session.get("ab") or {}
    return {ref["job"]: f"A/B Spectrum {key}" for key, ref in ab.items() if "job" in ref}


def resolve(ref: dict, manager, history):
    """A ref -> its HistoryItem, or None when the job did not finish with an image."""
    if "item" in ref:
        return history.get(ref["item"])
    job = manager.get(ref.get("job"))
    return job.item if job is not None else None


def ab_comparison(session: dict, manager, history) -> tuple[tuple | None, str]:
    """(slider value (off png, on png), the comparison text), or (None, why not).

    A speed-up is shown only when the two runs' model evaluations differ; at equal counts the text says why Spectrum
    forecast nothing. The text lists the steps that were forecast."""
    off, on = (resolve(session["ab"][k], manager, history) for k in ("off", "on"))
    if off is None or on is None:
        return None, "A/B incomplete: one of the two runs did not finish (see the status line)."
    pair = (str(off.png_path), str(on.png_path))
    config = canonical(on.settings.get("spectrum_params") or {})
    label = f"Spectrum {config['setting']} ({config['forecaster']})"
    steps = on.settings["steps"]
    evals_off, evals_on = off.summary.get("model_evals"), on.summary.get("model_evals")
    if evals_off == evals_on:
        needed = first_forecasting_steps(config)
        needs = f"it needs at least {needed}" if needed else "this schedule forecasts none at any step count up to 100"
        return pair, (f"At {steps} steps {label} forecasts no step; {needs}. Both runs computed all {steps} steps "
                      f"({evals_on} model evaluations each), so there is no speed-up to measure.")
    t_off, t_on = (item.summary.get("seconds", {}).get("denoise") for item in (off, on))
    timing = f"Spectrum off {format_seconds(t_off)} · {label} {format_seconds(t_on)}"
    if t_off and t_on:
        timing += f" · speed-up {t_off / t_on:.2f}×"
    evals = f" · model evaluations {evals_off} vs {evals_on}"
    forecast = [record["step"] for record in on.summary.get("per_step", []) if not record.get("computed", True)]
    steps_line = f"Forecast steps ({len(forecast)} of {steps}): {', '.join(map(str, forecast))}"
    a, b = (np.asarray(Image.open(item.png_path).convert("RGB")) for item in (off, on))
    quality = f"PSNR {psnr(a, b, peak=255.0):.2f} dB · SSIM {ssim(a, b):.4f}"
    return pair, f"{timing}{evals}\n\n{steps_line}\n\n{quality}"
