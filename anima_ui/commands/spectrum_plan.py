"""`anima-ui spectrum-plan`: which steps Spectrum computes and which it forecasts, as one JSON object.

Needs no model and no torch: the plan depends only on the step count and the parameters.
"""

import json

from anima_ui.sampling.spectrum import DEFAULTS, plan

FLAGS = {  # name -> (type, meaning)
    "w": (float, "blend weight of the Chebyshev forecast (Taylor gets 1 - w)"),
    "m": (int, "Chebyshev degree"),
    "lam": (float, "ridge strength of the fit"),
    "window": (int, "initial skip window"),
    "flex": (float, "window growth after every computed step"),
    "warmup": (int, "first steps always computed"),
    "stop": (float, "fraction of steps after which every step is computed"),
}


def add_arguments(parser):
    parser.add_argument("--steps", type=int, required=True, help="number of sampler steps")
    for name, (kind, meaning) in FLAGS.items():
        parser.add_argument(f"--{name}", type=kind, default=DEFAULTS[name], help=f"{meaning} (default {DEFAULTS[name]})")


def run(args) -> int:
    computed, forecast = plan(args.steps, **{name: getattr(args, name) for name in FLAGS})
    print(json.dumps({"computed": computed, "forecast": forecast}))
    return 0
