"""Verified, crash-safe training checkpoints in ``<out_dir>/checkpoints``.

A checkpoint is a folder ``step<N>``: DeepSpeed writes it as ``step<N>.partial``; then every file
is hashed into ``manifest.json`` (sha256 and size per file, written last), fsynced, and the folder
renamed to ``step<N>`` in one step; then ``latest`` (DeepSpeed's pointer file) is rewritten
atomically to name it, and checkpoints beyond the newest ``keep_last`` are deleted. A kill at any
instant leaves every published checkpoint whole and ``latest`` naming one of them.

On resume the checkpoint ``latest`` names is verified against its manifest; if it (or ``latest``)
is missing, empty, garbled or corrupt, the newest intact checkpoint is used instead and one line
says what was skipped and why. A checkpoint without a manifest (written before checksums) is used,
unverified, only when no verified one exists."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

from eagle.atomic import fsync_path, fsync_tree, write_file

MANIFEST = "manifest.json"
LATEST = "latest"
PARTIAL = ".partial"
STEP = re.compile(r"step(\d+)")


def step_of(name: str) -> int | None:
    """``step<N>`` -> N; None for any other name."""
    m = STEP.fullmatch(name)
    return int(m.group(1)) if m else None


def checkpoints(ckpt_dir: str | Path) -> list[str]:
    """The published checkpoint folders (``step<N>``), newest (highest N) first."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    names = [p.name for p in ckpt_dir.iterdir() if p.is_dir() and step_of(p.name) is not None]
    return sorted(names, key=step_of, reverse=True)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(folder: str | Path) -> None:
    """Hash every file of ``folder`` into ``folder/manifest.json``."""
    folder = Path(folder)
    files = {name: {"sha256": file_sha256(folder / name), "bytes": (folder / name).stat().st_size}
             for name in _files(folder)}
    (folder / MANIFEST).write_text(json.dumps({"files": files}, indent=1))


def verify(folder: str | Path) -> str | None:
    """None when ``folder`` matches its manifest, else why not (a few words)."""
    folder = Path(folder)
    if not folder.is_dir():
        return "no such folder"
    try:
        files = json.loads((folder / MANIFEST).read_text())["files"]
        assert isinstance(files, dict) and files
    except FileNotFoundError:
        return f"no {MANIFEST}"
    except (OSError, ValueError, KeyError, TypeError, AssertionError):
        return f"unreadable {MANIFEST}"
    for name, entry in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} missing"
        if path.stat().st_size != entry.get("bytes"):
            return f"{name} has {path.stat().st_size} bytes, the manifest says {entry.get('bytes')}"
        if file_sha256(path) != entry.get("sha256"):
            return f"{name} does not match its sha256"
    extra = sorted(set(_files(folder)) - set(files))
    if extra:
        return f"{extra[0]} is not in the manifest"
    return None


def partial_tag(tag: str) -> str:
    """The folder name DeepSpeed writes checkpoint ``tag`` under before it is published."""
    return tag + PARTIAL


def place(partial: Path, dest: Path) -> None:
    """Rename the finished folder ``partial`` to ``dest`` (a stale ``dest`` is deleted first)."""
    if dest.exists():
        stale = dest.with_name(dest.name + ".stale")
        shutil.rmtree(stale, ignore_errors=True)
        dest.rename(stale)
        shutil.rmtree(stale)
    partial.rename(dest)
    fsync_path(dest.parent)


def publish(ckpt_dir: str | Path, tag: str, keep_last: int) -> list[str]:
    """Publish the checkpoint DeepSpeed wrote to ``ckpt_dir/<tag>.partial`` as ``ckpt_dir/<tag>``:
    manifest, fsync, one rename, ``latest`` rewritten atomically; then delete all but the newest
    ``keep_last`` checkpoints (0: keep all; the one ``latest`` names is always kept). Returns the
    names deleted."""
    ckpt_dir = Path(ckpt_dir)
    partial = ckpt_dir / partial_tag(tag)
    write_manifest(partial)
    fsync_tree(partial)
    place(partial, ckpt_dir / tag)
    write_file(ckpt_dir / LATEST, tag)
    return prune(ckpt_dir, keep_last)


def prune(ckpt_dir: str | Path, keep_last: int) -> list[str]:
    """Delete the checkpoints beyond the newest ``keep_last`` (0: none), never the one ``latest``
    names; each is first renamed (one step) so that no half-deleted ``step<N>`` is left."""
    if keep_last <= 0:
        return []
    ckpt_dir = Path(ckpt_dir)
    named = read_latest(ckpt_dir)
    gone = [name for name in checkpoints(ckpt_dir)[keep_last:] if name != named]
    for name in gone:
        doomed = ckpt_dir / (name + ".deleting")
        shutil.rmtree(doomed, ignore_errors=True)
        (ckpt_dir / name).rename(doomed)
        shutil.rmtree(doomed)
    return gone


def clean(ckpt_dir: str | Path) -> None:
    """Delete what killed saves and deletions left behind (``*.partial``, ``*.stale``, ``*.deleting``)."""
    ckpt_dir = Path(ckpt_dir)
    if ckpt_dir.is_dir():
        for path in ckpt_dir.iterdir():
            if path.is_dir() and path.name.endswith((PARTIAL, ".stale", ".deleting")):
                shutil.rmtree(path, ignore_errors=True)


def read_latest(ckpt_dir: str | Path) -> str | None:
    """The tag ``latest`` names, or None (no file, or not readable text)."""
    try:
        return (Path(ckpt_dir) / LATEST).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def choose(ckpt_dir: str | Path) -> tuple[str | None, bool, list[str]]:
    """The checkpoint to resume from (None: start afresh), whether it was verified against its
    manifest, and what was skipped on the way (a bad ``latest``; each skipped checkpoint with the
    reason)."""
    ckpt_dir = Path(ckpt_dir)
    found = checkpoints(ckpt_dir)
    skipped: list[str] = []
    latest = ckpt_dir / LATEST
    named = read_latest(ckpt_dir)
    if latest.exists():
        if named is None:
            skipped.append(f"{LATEST} is unreadable")
        elif not named:
            skipped.append(f"{LATEST} is empty")
        elif named not in found:
            shown = named if len(named) <= 40 else named[:40] + "..."
            skipped.append(f"{LATEST} names {shown!r}, which is no checkpoint folder")
    order = ([named] if named in found else []) + [name for name in found if name != named]
    unverified = None
    for name in order:
        reason = verify(ckpt_dir / name)
        if reason is None:
            return name, True, skipped
        if reason == f"no {MANIFEST}" and unverified is None and any((ckpt_dir / name).iterdir()):
            unverified = name
        skipped.append(f"{name} ({reason})")
    if unverified is not None:
        skipped.remove(f"{unverified} (no {MANIFEST})")
    return unverified, False, skipped


def resume_message(ckpt_dir: str | Path, tag: str | None, verified: bool, skipped: list[str]) -> str | None:
    """The one line said on resume when a checkpoint or ``latest`` was skipped or the one used is
    unverified (None otherwise)."""
    if not skipped and (tag is None or verified):
        return None
    if tag is None:
        head = f"no intact checkpoint in {ckpt_dir}: starting from step 0"
    else:
        head = f"resuming from {Path(ckpt_dir) / tag}" + ("" if verified else
                                                           f" unverified (it has no {MANIFEST}: written before checksums)")
    return f"eagle-train: {head}" + (f"; skipped: {'; '.join(skipped)}" if skipped else "")
