"""eagle: EAGLE-style speculative decoding with a feature-level drafter and dynamic draft trees.

The names below are imported on first use, so that ``import eagle.config`` (say, for a command
line's checks) does not load torch."""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "PromptLookupConfig": "eagle.config", "SamplingConfig": "eagle.config", "SpeculativeConfig": "eagle.config",
    "TreeConfig": "eagle.config", "Drafter": "eagle.drafting.drafter", "DrafterConfig": "eagle.drafting.drafter",
    "EagleError": "eagle.errors", "GenerationResult": "eagle.decoding.loop", "METHODS": "eagle.inputs",
    "EagleModel": "eagle.engine", "DEFAULT_TARGET": "eagle.inputs", "Target": "eagle.runtime.target",
    "load_target": "eagle.runtime.target",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'eagle' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
