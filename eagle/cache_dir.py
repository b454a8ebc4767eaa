"""Where eagle keeps what it builds or measures once per machine."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def cache_root() -> Path:
    """Where converted targets and measured cost curves live (``$EAGLE_CACHE`` overrides)."""
    return Path(os.environ.get("EAGLE_CACHE", Path.home() / ".cache" / "eagle"))


def measurement_path(kind: str, key: str) -> Path:
    """The JSON file that keeps a measurement of ``kind`` ("cost", "screen") made under the conditions ``key``."""
    return cache_root() / kind / (hashlib.sha256(key.encode()).hexdigest()[:16] + ".json")


def keep_measurement(path: Path, record: dict) -> None:
    """Write ``record`` to ``path`` (a ``measurement_path``) atomically, its folder made if missing."""
    from eagle.atomic import write_file

    path.parent.mkdir(parents=True, exist_ok=True)
    write_file(path, json.dumps(record))
