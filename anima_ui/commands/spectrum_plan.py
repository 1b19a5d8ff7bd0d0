"""`anima-ui spectrum-plan`: which steps Spectrum computes and which it forecasts, as one JSON object.

Needs no model and no torch: the plan depends only on the step count and the schedule.
"""

import json

from anima_ui.commands.spectrum_flags import add_spectrum_arguments, spectrum_config
from anima_ui.sampling.spectrum import SCHEDULE_KEYS, SETTINGS, plan


def add_arguments(parser):
    parser.add_argument("--steps", type=int, required=True, help="number of sampler steps")
    parser.add_argument("--setting", choices=list(SETTINGS), default="on", help="the named schedule (default on)")
    add_spectrum_arguments(parser, prefix="", names=SCHEDULE_KEYS, forecaster=False)


def run(args) -> int:
    computed, forecast = plan(args.steps, **spectrum_config(args, args.setting, prefix=""))
    print(json.dumps({"computed": computed, "forecast": forecast}))
    return 0
