"""Errors a user can fix. The CLI prints them as one line and exits non-zero, no traceback."""


class UserError(Exception):
    """Bad input: a missing file, a malformed config, an option out of range."""


class PassError(Exception):
    """A pass failed; the message names it and the passes that ran before it."""
