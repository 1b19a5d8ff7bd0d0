"""`anima-ui random-model`: a complete model folder in the official release layout (models/README.md) with
random weights and locally trained tokenizers, for tests and for trying the app without the real files."""

import time


def add_arguments(parser):
    parser.add_argument("--config", choices=("tiny", "full"), default="tiny", help="tiny: test-sized (seconds); full: the real shapes (~5.6 GB)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--out", required=True, help="the model folder to create (must not exist)")


def run(args) -> int:
    from anima_ui.fixtures.model import write_random_model  # its VAE shape tables import torch (optional), `--help` not

    started = time.perf_counter()
    out = write_random_model(args.out, args.config, args.seed)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"wrote {out} ({args.config}, seed {args.seed}): {size / 1e6:.1f} MB in {time.perf_counter() - started:.1f} s")
    return 0
