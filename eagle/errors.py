"""User-facing errors: one clear line, no traceback, at the command line."""

from __future__ import annotations

import gzip

import functools
import sys
from pathlib import Path
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


def read_text(path: str | Path) -> str:
    """A UTF-8 text file's content, gunzipped when its name ends in ``.gz``; a file that is missing,
    unreadable or not UTF-8 is an ``EagleError`` naming it (and for bad bytes, ``file:line``, the byte
    and its column)."""
    path = Path(path)
    try:
        data = path.read_bytes()
        if path.suffix == ".gz":
            data = gzip.decompress(data)
    except (OSError, EOFError) as exc:
        raise EagleError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise EagleError(f"{path}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x} at column {column})") from None


def check_writable(path: str | Path, flag: str) -> None:
    """Refuse an output file that could not be written later (checked before a long run): its
    folder is made and the file opened for appending, and removed again if it was not there."""
    path = Path(path)
    if path.is_dir():
        raise EagleError(f"{flag} {path} is a folder, not a file")
    existed = path.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a"):
            pass
    except OSError as exc:
        raise EagleError(f"{flag} {path}: cannot write it ({exc.strerror or exc})") from None
    if not existed:
        path.unlink()
