"""`anima-ui spectrum-plan`: which steps Spectrum computes and which it forecasts, as one JSON object.

Needs no model and no torch: the plan depends only on the step count and the parameters.
"""

import json

from anima_ui.sampling.spectrum import DEFAULTS, plan

FLAG_TYPES = {"w": float, "m": int, "lam": float, "window": int, "flex": float, "warmup": int, "stop": float}


def add_arguments(parser):
    parser.add_argument("--steps", type=int, required=True, help="number of sampler steps")
    for name, kind in FLAG_TYPES.items():
        parser.add_argument(f"--{name}", type=kind, default=DEFAULTS[name], help=f"Spectrum {name} (default {DEFAULTS[name]})")


def run(args) -> int:
    computed, forecast = plan(args.steps, **{name: getattr(args, name) for name in FLAG_TYPES})
    print(json.dumps({"computed": computed, "forecast": forecast}))
    return 0
