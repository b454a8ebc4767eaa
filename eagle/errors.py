"""User-facing errors: one clear line, no traceback, at the command line."""

from __future__ import annotations

import argparse
import gzip

import functools
import sys
from pathlib import Path
from typing import Any, Callable, Collection, Iterable, NoReturn, Sequence


class EagleError(Exception):
    """A problem with the user's input or environment, explained in one line."""


class _StoreOnce(argparse.Action):
    """``store``, except that an option given again with another value is an error naming both."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        given = parser.__dict__.setdefault("given_values", {})
        if self.dest in given and given[self.dest][1] != values:
            parser.error(f"{option_string} is given twice, with different values: {given[self.dest][1]!r} and "
                         f"{values!r}")
        given[self.dest] = (option_string, values)
        setattr(namespace, self.dest, values)


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are ``EagleError`` (one line, exit 2 under ``command``); an
    option given twice with different values is one too (not the last one silently winning)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.register("action", None, _StoreOnce)
        self.register("action", "store", _StoreOnce)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self.given_values = {}
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        raise EagleError(message)


def given_flags(parser: argparse.ArgumentParser, args: argparse.Namespace, flags: Iterable[str]) -> set[str]:
    """The ``flags`` (long options) whose value differs from the parser's default: those the user gave."""
    dests = {flag: flag[2:].replace("-", "_") for flag in flags}
    return {flag for flag, dest in dests.items() if getattr(args, dest) != parser.get_default(dest)}


def note_ignored(prog: str, given: Collection[str], rules: Iterable[tuple[Sequence[str], bool, str]]) -> list[str]:
    """Name on stderr the options the user gave (``given``) that this mode does not read: per rule
    ``(options, applies, why)`` that applies, one line ``PROG: warning: --a, --b are ignored <why>``
    (rules with the same ``why`` share it; an option is named once). Returns the lines."""
    named: dict[str, list[str]] = {}
    seen: set[str] = set()
    for options, applies, why in rules:
        for option in options:
            if applies and option in given and option not in seen:
                seen.add(option)
                named.setdefault(why, []).append(option)
    lines = [f"{prog}: warning: {', '.join(names)} {'is' if len(names) == 1 else 'are'} ignored {why}"
             for why, names in named.items()]
    for line in lines:
        print(line, file=sys.stderr, flush=True)
    return lines


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
