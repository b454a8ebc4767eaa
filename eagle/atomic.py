"""Crash-safe writes: after a kill at any instant a file or folder written here is either the old
one or the new one, never a mix or nothing.

A file is written beside its destination, fsynced, then ``os.replace``d over it. A folder is
filled beside it (``NAME.tmp``), its files and itself fsynced, then swapped with the old folder in
one ``renameat2(RENAME_EXCHANGE)`` call (Linux); the old contents, now at ``NAME.tmp``, are then
deleted, and a leftover ``NAME.tmp`` of a killed write is deleted by the next one. Where the
kernel or filesystem cannot exchange two folders, the old folder is renamed to ``NAME.old``
before the new one takes its name; a kill between those two renames leaves it there, and the next
write (or ``recover_directory``) moves it back."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
from pathlib import Path
from typing import Iterator

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def fsync_path(path: str | Path) -> None:
    """Flush a file's or a folder's contents (a folder: its list of names) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | Path) -> None:
    """fsync every file under ``root``, then every folder, deepest first, ``root`` last."""
    for folder, _, files in os.walk(root, topdown=False):
        for name in files:
            fsync_path(os.path.join(folder, name))
        fsync_path(folder)


def write_file(path: str | Path, data: str | bytes) -> None:
    """Write ``data`` to ``path`` atomically: a temporary file beside it, fsynced, renamed over it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as fh:
        fh.write(data.encode() if isinstance(data, str) else data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one step; False where the system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"cannot exchange {a} and {b}: {os.strerror(err)}")


def recover_directory(directory: str | Path) -> None:
    """Put back ``NAME.old`` where a kill between the two renames of the fallback left no ``NAME``."""
    directory = Path(directory)
    old = directory.with_name(directory.name + ".old")
    if old.is_dir() and not directory.exists():
        old.rename(directory)
        fsync_path(directory.parent)
    shutil.rmtree(old, ignore_errors=True)


def replace_directory(new: str | Path, directory: str | Path) -> None:
    """Make the (fsynced) folder ``new`` take ``directory``'s name in one step, and delete the old one."""
    new, directory = Path(new), Path(directory)
    if not directory.exists():
        new.rename(directory)
    elif _exchange(new, directory):
        shutil.rmtree(new)  # now the old contents
    else:
        old = directory.with_name(directory.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        directory.rename(old)
        new.rename(directory)
        fsync_path(directory.parent)
        shutil.rmtree(old)
    fsync_path(directory.parent)


def _keep(name: Path, into: Path) -> None:
    """Hard-link (else copy) file or folder ``name`` into folder ``into``."""
    dest = into / name.name
    if name.is_dir() and not name.is_symlink():
        shutil.copytree(name, dest, symlinks=True, copy_function=_link_or_copy)
    else:
        _link_or_copy(name, dest)


def _link_or_copy(src: str | Path, dst: str | Path) -> None:
    if os.path.islink(src):
        os.symlink(os.readlink(src), dst)
        return
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


@contextlib.contextmanager
def atomic_directory(directory: str | Path, keep_other_files: bool = False) -> Iterator[Path]:
    """Fill the yielded empty folder (``NAME.tmp``, beside ``directory``); on leaving the block
    without an exception it replaces ``directory`` in one step (see the module docstring). With
    ``keep_other_files`` the files of the old folder that the block did not write are carried
    over (hard links), as writing into the folder in place would have kept them. A symbolic
    link is followed: the folder it points to is replaced and the link kept."""
    directory = Path(os.path.realpath(directory))
    directory.parent.mkdir(parents=True, exist_ok=True)
    recover_directory(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if keep_other_files and directory.is_dir():
            for name in directory.iterdir():
                if not (tmp / name.name).exists() and not (tmp / name.name).is_symlink():
                    _keep(name, tmp)
        fsync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_directory(tmp, directory)
