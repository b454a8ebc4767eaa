"""KV-cache bookkeeping shared by every method: roll back and compact.

Works on any transformers ``Cache`` whose layers hold ``keys``/``values`` [B, heads, T, d]
(``DynamicCache``), and on the drafter's own ``DrafterCache``."""

from __future__ import annotations

from typing import Any

import torch

from eagle.errors import EagleError


def new_cache(model: Any, role: str = "target") -> Any:
    """An empty ``DynamicCache`` for ``model``. Sliding-window layers are refused: they keep
    fewer keys than the tree masks cover and cannot be rolled back."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    if any(getattr(layer, "is_sliding", False) for layer in cache.layers):
        raise EagleError(f"the {role} uses sliding-window attention, which eagle does not support yet")
    return cache


def _layers(cache: Any) -> list:
    return list(cache.layers)


def cache_length(cache: Any) -> int:
    return int(cache.get_seq_length())


def roll_back(cache: Any, length: int) -> None:
    """Drop everything after the first ``length`` positions."""
    for layer in _layers(cache):
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            layer.keys = layer.keys[..., :length, :]
            layer.values = layer.values[..., :length, :]


@torch.inference_mode()
def compact(cache: Any, start: int, keep: torch.Tensor) -> None:
    """Move the entries at absolute positions ``keep`` [m] (all >= start, increasing) to
    ``start .. start + m - 1`` and drop the rest: the accepted tree path becomes contiguous."""
    m = keep.shape[0]
    contiguous = bool(torch.equal(keep.cpu(), torch.arange(start, start + m)))
    for layer in _layers(cache):
        if getattr(layer, "keys", None) is None or not layer.keys.numel():
            continue
        if not contiguous:
            idx = keep.to(layer.keys.device)
            layer.keys[..., start:start + m, :] = layer.keys.index_select(-2, idx)
            layer.values[..., start:start + m, :] = layer.values.index_select(-2, idx)
        layer.keys = layer.keys[..., : start + m, :]
        layer.values = layer.values[..., : start + m, :]
