"""Attention masks and small host tensors for the lean forwards (pure functions): additive biases from boolean
"may attend" tables, the causal mask, and host tensors made from bytes. The tree-shaped masks built on them live in
``eagle.decoding.tree_mask``."""

from __future__ import annotations

from array import array
from typing import Sequence

import torch


def host_tensor(values: Sequence[int] | Sequence[float], dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``values`` as a host tensor [N] of ``dtype`` (long or float32) made from an array's bytes: a few times
    cheaper than ``torch.tensor`` of a list, which each sequence of a batched round pays for its tree."""
    if not values:
        return torch.zeros(0, dtype=dtype)
    return torch.frombuffer(array("q" if dtype == torch.long else "f", values), dtype=dtype)


def bool_rows(columns: list[list[int]], width: int) -> torch.Tensor:
    """Row i True at ``columns[i]``, False elsewhere: [len(columns), width] bool on the host, made from bytes
    (converting nested lists or indexing with them costs more than the rest of a small mask's making)."""
    data = bytearray(len(columns) * width)
    for i, cols in enumerate(columns):
        for j in cols:
            data[i * width + j] = 1
    return torch.frombuffer(data, dtype=torch.bool).view(len(columns), width) if data else torch.zeros(
        len(columns), width, dtype=torch.bool)


def attention_bias(tree_mask: torch.Tensor, past_len: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive 4D mask [1, 1, N, past_len + N] for a forward over the tree after ``past_len``
    cached tokens: 0 where attention is allowed (the whole prefix, ancestors, self), else the
    dtype's most negative value. ``tree_mask`` [N, S] (S >= N) gives the last S columns: a tree
    whose first S - N nodes are cached already, every key before them seen."""
    n, s = tree_mask.shape
    allowed = torch.ones(n, past_len + n, dtype=torch.bool, device=tree_mask.device)
    allowed[:, past_len + n - s:] = tree_mask
    return additive_bias(allowed, dtype)


def additive_bias(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[Q, K] or [B, Q, K] bool (True = may attend) -> [1, 1, Q, K] or [B, 1, Q, K] additive mask:
    0 or the dtype's most negative value."""
    bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    bias.masked_fill_(~allowed, torch.finfo(dtype).min)
    return bias.reshape(-1, 1, *allowed.shape[-2:])


def causal_bias(q_len: int, past_len: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive causal mask [1, 1, q_len, past_len + q_len] (a chain is a tree too)."""
    chain = torch.ones(q_len, q_len, dtype=torch.bool, device=device).tril()
    return attention_bias(chain, past_len, dtype)

