"""Tree attention: ancestor mask, position ids by depth, root-to-leaf paths (pure functions).

A tree of N nodes is given by ``parents`` [N] (long): ``parents[0] == -1`` is the root and
every other node's parent has a smaller index (topological order)."""

from __future__ import annotations

import dataclasses

import torch

from eagle.decoding.tree import host_tensor


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


def bool_rows(columns: list[list[int]], width: int) -> torch.Tensor:
    """Row i True at ``columns[i]``, False elsewhere: [len(columns), width] bool on the host, made from bytes
    (converting nested lists or indexing with them costs more than the rest of a small mask's making)."""
    data = bytearray(len(columns) * width)
    for i, cols in enumerate(columns):
        for j in cols:
            data[i * width + j] = 1
    return torch.frombuffer(data, dtype=torch.bool).view(len(columns), width) if data else torch.zeros(
        len(columns), width, dtype=torch.bool)


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
