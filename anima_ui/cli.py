"""The `anima-ui` command. Each subcommand lives in `anima_ui/commands/<name>.py` and exposes
`add_arguments(parser)` and `run(args) -> int`; modules are imported only when their command runs,
so light commands (spectrum-plan) start without torch."""

import argparse
import importlib
import sys

from anima_ui.errors import UserError

# command name -> (module under anima_ui.commands, one-line help)
COMMANDS = {
    "random-model": ("random_model", "write a random-weight model folder in the official layout"),
    "generate": ("generate", "text -> image, end to end"),
    "prepare": ("prepare", "download, export and convert for the board in one resumable command (PC or board)"),
    "export": ("export", "export the 84 DiT branch graphs to ONNX for one resolution"),
    "convert-rknn": ("convert_rknn", "convert exported ONNX graphs to RKNN (needs .venv-rknn)"),
    "verify": ("verify", "compare the split runtime with the reference forward"),
    "tune": ("tune", "measure the fastest correct way to run the branch graphs here; write the profile generate/serve use"),
    "calibrate": ("calibrate", "record every block's FFN inputs from real generations (for the W8A8 + low-rank FFNs)"),
    "quantize-ffn": ("quantize_ffn", "W8A8 + FP16 low-rank FFN graphs from a calibration, gated per block and end to end"),
    "bench": ("bench", "benchmarks that print tables: runtime, spectrum, vae"),
    "spectrum-plan": ("spectrum_plan", "print which steps Spectrum computes and which it forecasts"),
    "serve": ("serve", "start the Gradio app"),
    "doctor": ("doctor", "check the board: NPU driver and device, librknnrt.so, memory, model files, one graph on the NPU"),
}


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse prints the whole usage block on a bad flag; a one-line error that names the flag reads better."""

    def error(self, message):
        self.exit(2, f"error: {message} (see `{self.prog} --help`)\n")


def build_parser(chosen: str | None) -> argparse.ArgumentParser:
    """All subcommands are listed; only the chosen one's module is imported (some pull in torch)."""
    parser = OneLineErrorParser(prog="anima-ui", description="Anima on the RK3588 NPU: model tools, generation and the app.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineErrorParser)
    for name, (module, help_text) in COMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text)
        sub_parser.set_defaults(_module=module)
        if name == chosen:
            importlib.import_module(f"anima_ui.commands.{module}").add_arguments(sub_parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(chosen).parse_args(argv)
    module = importlib.import_module(f"anima_ui.commands.{args._module}")
    try:
        return module.run(args) or 0
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
