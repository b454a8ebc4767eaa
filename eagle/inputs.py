"""Checks of user input that need neither a model nor torch, so that a command line refuses bad
input at once: the names options are checked against, model specs and prompt text."""

from __future__ import annotations

import os
from pathlib import Path

from eagle.errors import EagleError
from eagle.named_targets import NAMED_TARGETS, named_target

DEFAULT_TARGET = "smollm2-135m-instruct"
METHODS = ("ar", "pld", "sd", "eagle-chain", "eagle-tree", "suffix")
FORMATS = {"q8_0": 8, "q4_1": 4}  # the drafter's block formats by their GGUF names -> bits
DRAFT_LM_MARKER = "draft_lm.json"  # the file that makes a folder a draft LM (``eagle.drafting.draft_lm``)

INT8 = "+int8"  # a method's suffix: run on the target loaded with int8 activations (compared in one process)
SUFFIX = "+suffix"  # a method's suffix: suffix drafts grafted onto its trees (eagle.decoding.proposers.SuffixDrafts)
MODIFIERS = (INT8, SUFFIX)


def modifiers(name: str) -> tuple[str, set[str]]:
    """``"eagle-tree+suffix+int8"`` -> ("eagle-tree", {"+suffix", "+int8"}): the method and its suffixes."""
    found: set[str] = set()
    while any(name.endswith(m) and m not in found for m in MODIFIERS):
        m = next(m for m in MODIFIERS if name.endswith(m))
        found.add(m)
        name = name.removesuffix(m)
    return name, found


def split_method(name: str) -> tuple[str, str | None]:
    """``"eagle-tree@DIR"`` -> ("eagle-tree", "DIR"): an EAGLE method with another drafter folder than
    ``--drafter`` (to compare drafters in one process; ``@eagle3``: the EAGLE-3 drafter shipped for the
    target); a plain name -> (name, None). ``+int8`` and ``+suffix`` suffixes are not part of either."""
    method, at, drafter = modifiers(name)[0].partition("@")
    return method, (drafter if at else None)


def check_spec(spec: str) -> str:
    """What a model spec names, checked without loading anything: ``"default"``, ``"named"`` (a target
    assembled from PyPI parts, ``eagle.named_targets``), ``"gguf"`` (a file that starts like a GGUF file),
    ``"folder"`` (with a config.json) or ``"hub"`` (an id ``owner/name`` that is not a local path);
    anything else is an ``EagleError`` saying why."""
    if not isinstance(spec, str) or not spec.strip():
        raise EagleError(f"a model spec must be a non-empty string, got {spec!r}")
    if spec.lower() == DEFAULT_TARGET:
        return "default"
    if named_target(spec) is not None:
        return "named"
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise EagleError(f"GGUF file not found: {spec}")
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise EagleError(f"{spec} is not a GGUF file (it does not start with the bytes 'GGUF')")
        return "gguf"
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise EagleError(f"{spec} is a folder but holds no config.json: not a Hugging Face model folder")
        return "folder"
    if path.exists():
        raise EagleError(f"{spec} is a file, not a model folder or a .gguf file")
    if spec.count("/") == 1 and not spec.startswith((".", "/", "~")) and not spec.endswith("/"):
        return "hub"
    if "/" in spec or os.sep in spec:
        raise EagleError(f"model folder not found: {spec}")
    raise EagleError(f"unknown model spec {spec!r}: no such folder or file; give a model folder, a .gguf file, "
                     f"a hub id (owner/name) in the local cache, or a named target: "
                     f"{', '.join([DEFAULT_TARGET, *NAMED_TARGETS])}")


def is_draft_lm(path: str | Path) -> bool:
    return (Path(path) / DRAFT_LM_MARKER).is_file()


def check_prompt_text(text: str) -> None:
    """Refuse an empty prompt and one that is not text: a command-line argument with bytes that
    are not UTF-8 arrives as lone surrogates (Python's surrogateescape)."""
    if not text.strip():
        raise EagleError("empty prompt")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start]
        byte = f"byte 0x{ord(bad) - 0xDC00:02x}" if 0xDC80 <= ord(bad) <= 0xDCFF else f"character {bad!r}"
        raise EagleError(f"the prompt is not valid UTF-8 text ({byte} at character {exc.start})") from None
