"""User-facing errors: one clear line, no traceback, at the command line."""

from __future__ import annotations

import functools
import sys
from typing import Callable


class EagleError(Exception):
    """A problem with the user's input or environment, explained in one line."""


def command(prog: str) -> Callable[[Callable[[list[str] | None], None]], Callable[[list[str] | None], int]]:
    """Decorator for a console script's ``main(argv)``: exit code 0 when it returns; an
    ``EagleError`` becomes one line ``PROG: error: ...`` on stderr and exit code 2; Ctrl-C 130."""

    def wrap(body: Callable[[list[str] | None], None]) -> Callable[[list[str] | None], int]:
        @functools.wraps(body)
        def main(argv: list[str] | None = None) -> int:
            try:
                body(argv)
            except EagleError as exc:
                print(f"{prog}: error: {exc}", file=sys.stderr)
                return 2
            except KeyboardInterrupt:
                print(file=sys.stderr)
                return 130
            return 0

        return main

    return wrap
