"""User-facing errors: one clear line, no traceback, at the command line."""


class EagleError(Exception):
    """A problem with the user's input or environment, explained in one line."""
