"""Verified, crash-safe training checkpoints in ``<out_dir>/checkpoints``.

A checkpoint is a folder ``step<N>``: DeepSpeed writes it as ``step<N>.partial``; then every file
is hashed into ``manifest.json`` (sha256 and size per file, written last), fsynced, and the folder
renamed to ``step<N>`` in one step; then ``latest`` (DeepSpeed's pointer file) is rewritten
atomically to name it, and checkpoints beyond the newest ``keep_last`` are deleted. A kill at any
instant leaves every published checkpoint whole and ``latest`` naming one of them.

On resume the checkpoint ``latest`` names is verified against its manifest; if it (or ``latest``)
is missing, empty, garbled or corrupt, the newest intact checkpoint is used instead and one line
says what was skipped and why. A checkpoint without a manifest (written before checksums) is used,
unverified, only when no verified one exists.

A run folder records what its checkpoints belong to in ``run.json`` (``run_identity``: the
student's architecture, the target, the training data); a run into a folder whose checkpoints
belong to another is refused (``claim``) rather than resumed from or pruning them."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Iterable, Iterator

from eagle.atomic import fsync_path, fsync_tree, write_file

MANIFEST = "manifest.json"
RUN = "run.json"
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


def examples_digest(examples: Iterable[dict]) -> str:
    """sha256 over the token ids and loss masks of tokenized ``examples`` (lists or tensors), in order."""
    import torch

    digest = hashlib.sha256()
    for ex in examples:
        ids = torch.as_tensor(ex["input_ids"], dtype=torch.int64)
        digest.update(len(ids).to_bytes(8, "little") + ids.numpy().tobytes())
        digest.update(torch.as_tensor(ex["loss_mask"], dtype=torch.bool).numpy().tobytes())
    return digest.hexdigest()


def named_tensors(obj: Any, prefix: str = "", seen: set[int] | None = None) -> Iterator[tuple[str, Any]]:
    """(dotted name, tensor) for every tensor an object holds in its attributes, lists and dicts,
    recursively, each object once (a GGUF target's codes: ``eagle.runtime.gguf_weights.GGUFModel``)."""
    import torch

    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None))):
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
        return
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else \
        vars(obj).items() if hasattr(obj, "__dict__") else ()
    for key, value in items:
        yield from named_tensors(value, f"{prefix}.{key}" if prefix else str(key), seen)


def weights_digest(model: Any, samples: int = 256) -> str:
    """A short hash of a model's weights: per parameter (by name) its shape and up to ``samples``
    evenly spaced values rounded to bfloat16 (a float32 and a bfloat16 load of the same weights agree).
    A model without parameters (a GGUF target's codes): its tensors (``named_tensors``) alike."""
    import torch

    digest = hashlib.sha256()
    weights = model.named_parameters() if isinstance(model, torch.nn.Module) else \
        named_tensors({"model": model.model, "head": model.get_output_embeddings()})
    for name, param in sorted(weights, key=lambda item: item[0]):
        flat = param.detach().flatten()
        count = min(samples, flat.numel())
        picks = torch.arange(count, device=flat.device) * (flat.numel() - 1) // max(1, count - 1)
        digest.update(f"{name}{list(param.shape)}".encode())
        digest.update(flat[picks].to(torch.bfloat16).view(torch.int16).cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def run_identity(student: str, architecture: dict, target: dict, data: dict) -> dict:
    """What a run folder's checkpoints belong to: the student (``drafter`` or ``draft_lm``) and its
    architecture, the target (its name and what tells it apart: tokenizer, sizes, ``weights_digest``)
    and the training data (``source``, ``examples``, ``sha256``: ``examples_digest``)."""
    return {"student": student, "architecture": architecture, "target": target, "data": data}


def differences(old: dict, new: dict) -> list[str]:
    """What differs between two ``run_identity`` records, in words (empty: the same run). Names and
    paths alone do not count: a target or data moved elsewhere is the same."""
    out = []
    if old.get("student") != new["student"]:
        out.append(f"student {old.get('student')} vs {new['student']}")
    else:
        arch = [f"{k} {old['architecture'].get(k)!r} vs {new['architecture'].get(k)!r}"
                for k in sorted(set(old.get("architecture", {})) | set(new["architecture"]))
                if old["architecture"].get(k) != new["architecture"].get(k)]
        if arch:
            out.append(f"architecture: {', '.join(arch)}")
    before, after = old.get("target", {}), new["target"]
    if any(before.get(k) != v for k, v in after.items() if k != "name"):
        out.append(f"target: {before.get('name')!r} vs {after['name']!r}" +
                   (" (other weights or tokenizer)" if before.get("name") == after["name"] else ""))
    before, after = old.get("data", {}), new["data"]
    if before.get("sha256") != after["sha256"]:
        out.append(f"data: {before.get('source')} ({before.get('examples')} examples) vs {after['source']} "
                   f"({after['examples']} examples)" + (", other content" if before.get("examples") == after["examples"]
                                                          else ""))
    return out


def claim(out_dir: str | Path, identity: dict, start_over: bool = False) -> str | None:
    """Make ``out_dir`` the folder of the run ``identity`` describes (its ``run.json``). When it holds
    checkpoints of another run: the one-line refusal saying what differs (nothing is written), or
    with ``start_over`` those checkpoints (and the other run's ``run.json`` and ``summary.json``) are
    deleted first. Checkpoints with no ``run.json`` (written before runs were recorded) are taken as
    this run's, with one line saying so."""
    out_dir = Path(out_dir)
    ckpt_dir, record = out_dir / "checkpoints", out_dir / RUN
    if start_over:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
        for name in (RUN, "summary.json"):
            (out_dir / name).unlink(missing_ok=True)
    elif checkpoints(ckpt_dir):
        try:
            old = json.loads(record.read_text())
        except FileNotFoundError:
            old = None
            print(f"eagle-train: {ckpt_dir} has no {RUN} beside it (written before runs were recorded): "
                  f"its checkpoints are taken as this run's", file=sys.stderr, flush=True)
        except (OSError, ValueError):
            return f"{record} is unreadable: pass --start-over to delete the checkpoints in {ckpt_dir}"
        differ = differences(old, identity) if old is not None else []
        if differ:
            return (f"{out_dir} holds checkpoints of another run ({'; '.join(differ)}): choose another out_dir, "
                    f"or pass --start-over to delete them and start from step 0 there")
    out_dir.mkdir(parents=True, exist_ok=True)
    write_file(record, json.dumps(identity, indent=1))
    return None
