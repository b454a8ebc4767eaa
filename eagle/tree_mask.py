"""Tree attention: ancestor mask, position ids by depth, root-to-leaf paths (pure functions).

A tree of N nodes is given by ``parents`` [N] (long): ``parents[0] == -1`` is the root and
every other node's parent has a smaller index (topological order)."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class TreeAttention:
    """``mask`` [N, N] bool, mask[i, j] = j is i or an ancestor of i; ``depths`` [N] long (root 0);
    ``paths`` [L, D + 1] long, one row per leaf listing its root-to-leaf nodes, padded with -1."""

    mask: torch.Tensor
    depths: torch.Tensor
    paths: torch.Tensor


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """[N] parents -> [N, N] bool ancestor-or-self mask."""
    n = parents.shape[0]
    mask = torch.eye(n, dtype=torch.bool, device=parents.device)
    has_parent = (parents >= 0)[:, None]
    up = parents.clamp(min=0)
    while True:  # each pass adds one more generation of ancestors; stops when nothing changes
        grown = mask | (mask[up] & has_parent)
        if torch.equal(grown, mask):
            return mask
        mask = grown


def root_to_leaf_paths(mask: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
    """[N, N] ancestor mask and [N] depths -> [L, D + 1] paths of the L leaves, -1 padded."""
    n = mask.shape[0]
    is_parent = (mask.sum(0) - 1) > 0  # some other node has it as an ancestor
    leaves = torch.nonzero(~is_parent).flatten()
    width = int(depths.max()) + 1 if n else 1
    paths = torch.full((leaves.shape[0], width), -1, dtype=torch.long, device=mask.device)
    node_ids = torch.arange(n, device=mask.device)
    for row, leaf in enumerate(leaves.tolist()):
        members = node_ids[mask[leaf]]
        paths[row, : members.shape[0]] = members[torch.argsort(depths[members])]
    return paths


def tree_attention(parents: torch.Tensor) -> TreeAttention:
    mask = ancestor_mask(parents)
    depths = mask.sum(1) - 1
    return TreeAttention(mask=mask, depths=depths, paths=root_to_leaf_paths(mask, depths))


def attention_bias(tree_mask: torch.Tensor, past_len: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive 4D mask [1, 1, N, past_len + N] for a forward over the tree after ``past_len``
    cached tokens: 0 where attention is allowed (the whole prefix, ancestors, self), else the
    dtype's most negative value."""
    n = tree_mask.shape[0]
    allowed = torch.ones(n, past_len + n, dtype=torch.bool, device=tree_mask.device)
    allowed[:, past_len:] = tree_mask
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
