"""Tree attention: ancestor mask, position ids by depth, root-to-leaf paths (pure functions).

A tree of N nodes is given by ``parents`` [N] (long): ``parents[0] == -1`` is the root and
every other node's parent has a smaller index (topological order)."""

from __future__ import annotations

import dataclasses

import torch

from eagle.runtime.masks import bool_rows, host_tensor


@dataclasses.dataclass
class TreeAttention:
    """``mask`` [N, N] bool, mask[i, j] = j is i or an ancestor of i; ``depths`` [N] long (root 0);
    ``paths`` [L, D + 1] long, one row per leaf listing its root-to-leaf nodes, padded with -1."""

    mask: torch.Tensor
    depths: torch.Tensor
    paths: torch.Tensor


def chains(parents: list[int]) -> list[list[int]]:
    """[N] parents -> each node's root-to-node chain (its ancestors, root first, then itself).
    Plain lists: the trees verified on a CPU have a few nodes, where a dozen small tensor
    operations cost more than the walk."""
    out: list[list[int]] = []
    for i, parent in enumerate(parents):
        out.append([i] if parent < 0 else out[parent] + [i])
    return out


def tree_attention(parents: torch.Tensor) -> TreeAttention:
    parent_list = parents.tolist()
    node_chains = chains(parent_list)
    has_children = set(parent_list)
    leaves = [chain for i, chain in enumerate(node_chains) if i not in has_children]  # in index order
    width = max(len(chain) for chain in node_chains)
    device = parents.device
    depths = host_tensor([len(chain) - 1 for chain in node_chains])
    paths = host_tensor([n for chain in leaves for n in chain + [-1] * (width - len(chain))]).view(len(leaves), width)
    return TreeAttention(mask=bool_rows(node_chains, len(node_chains)).to(device),  # ancestors and self
                         depths=depths.to(device), paths=paths.to(device))