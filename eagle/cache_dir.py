"""Where eagle keeps what it builds or measures once per machine."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """Where converted targets and measured cost curves live (``$EAGLE_CACHE`` overrides)."""
    return Path(os.environ.get("EAGLE_CACHE", Path.home() / ".cache" / "eagle"))
