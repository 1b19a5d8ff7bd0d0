"""Prompts read from text files (`anima-ui generate --prompt-file`)."""

from pathlib import Path

from anima_ui.errors import UserError


def read_prompt_file(path) -> str:
    """The file's text, UTF-8 (a byte-order mark is allowed), without surrounding whitespace: the final
    newline an editor adds must not become prompt tokens."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise UserError(f"prompt file {path} does not exist; check the path") from None
    except IsADirectoryError:
        raise UserError(f"prompt file {path} is a directory; give the path of a text file") from None
    except OSError as exc:
        raise UserError(f"cannot read prompt file {path}: {exc.strerror}; check its permissions") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise UserError(f"prompt file {path} is not UTF-8 text (bad byte at offset {exc.start}); save it as UTF-8") from None
    return text.strip()
