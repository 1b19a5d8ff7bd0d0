class UserError(Exception):
    """Bad input or a broken model folder: a one-line message that names the problem and what to do."""


class Cancelled(Exception):
    """A job was cancelled; raised at the next branch or step boundary."""
