"""`python app.py [options]` is `anima-ui serve [options]`: the Gradio app on the board's LAN address."""

import sys

from anima_ui.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["serve", *sys.argv[1:]]))
