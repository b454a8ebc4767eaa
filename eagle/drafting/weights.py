"""Reading weight files and checking state dicts, with one clear error for a damaged or mismatched file."""

from __future__ import annotations

from pathlib import Path

import torch

from eagle.errors import EagleError


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file; a damaged or truncated file is an ``EagleError`` naming it."""
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own SafetensorError, OSError, ...
        raise EagleError(f"cannot read {path} (damaged or truncated?): {exc}") from None


def check_state(reference: dict[str, torch.Tensor], state: dict[str, torch.Tensor], what: str) -> None:
    """Refuse a state dict whose keys or shapes differ from ``reference`` (a module's state dict),
    naming the first difference."""
    expected = {k: tuple(v.shape) for k, v in reference.items()}
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise EagleError(f"{what} do not match the config: missing {missing[:3] or 'none'}, "
                         f"unexpected {unexpected[:3] or 'none'}")
    for key, shape in expected.items():
        if tuple(state[key].shape) != shape:
            raise EagleError(f"{what} do not match the config: {key} has shape {list(state[key].shape)}, "
                             f"the config implies {list(shape)}")
