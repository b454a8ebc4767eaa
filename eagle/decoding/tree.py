"""Draft trees (pure functions): EAGLE-2 dynamic expansion and reranking, EAGLE-1 static
trees from a list of choices, and the chain as the one-branch case.

A ``DraftTree`` holds the root (the last accepted token, not yet in the target's cache) at
index 0 followed by draft nodes in topological order."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from eagle.runtime.masks import host_tensor


@dataclasses.dataclass
class DraftTree:
    """``tokens`` [N] long; ``parents`` [N] long (root -1); ``scores`` [N] float, the cumulative
    draft log-probability of the path to each node (root 0)."""

    tokens: torch.Tensor
    parents: torch.Tensor
    scores: torch.Tensor

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])


def root_only(root_token: int, device: torch.device | str = "cpu") -> DraftTree:
    """The root alone (``chain_tree`` of no drafts)."""
    return DraftTree(tokens=torch.tensor([root_token], device=device), parents=torch.full((1,), -1, device=device),
                     scores=torch.zeros(1, device=device))


def chain_tree(root_token: int, draft_tokens: torch.Tensor, scores: torch.Tensor | None = None) -> DraftTree:
    """Root followed by a chain of ``draft_tokens`` [K]; node i's parent is i - 1."""
    k = draft_tokens.shape[0]
    device = draft_tokens.device
    tokens = torch.cat([torch.tensor([root_token], dtype=torch.long, device=device), draft_tokens.long()])
    parents = torch.arange(-1, k, dtype=torch.long, device=device)
    if scores is None:
        scores = torch.zeros(k, device=device)
    return DraftTree(tokens=tokens, parents=parents, scores=torch.cat([torch.zeros(1, device=device), scores.float()]))


def topk_children(parent_scores: torch.Tensor, logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each of F parents gets its k most likely children.
    ``parent_scores`` [F], ``logprobs`` [F, V] -> (tokens [F, k], cumulative scores [F, k])."""
    child_lp, child_tokens = torch.topk(logprobs, k, dim=-1)
    return child_tokens, parent_scores[:, None] + child_lp


def sampled_children(parent_scores: torch.Tensor, logprobs: torch.Tensor, k: int, temperature: float,
                     generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Each of F parents gets k children drawn without replacement from softmax(logprobs /
    temperature) (Gumbel-top-k: the k largest of logprobs / temperature + Gumbel noise come out
    in the order sequential draws without replacement would give). Their scores are the parent's
    plus the k largest log-probabilities, best first: they rank the j-th drawn child as the j-th
    most likely one, so siblings score non-increasing in draw order (a kept set of them is a
    prefix of the draws) and no score depends on which tokens were drawn.
    ``parent_scores`` [F], ``logprobs`` [F, V] -> (tokens [F, k] in draw order, scores [F, k])."""
    uniform = torch.rand(logprobs.shape, generator=generator, device=generator.device).to(logprobs.device)
    gumbel = -torch.log(-torch.log(uniform.clamp(min=1e-20)))
    tokens = torch.topk(logprobs / temperature + gumbel, k, dim=-1).indices
    return tokens, parent_scores[:, None] + torch.topk(logprobs, k, dim=-1).values


def best_frontier(scores: Sequence[float], k: int) -> list[int]:
    """Indices of the k best of the candidate scores [M], best first (the first on ties)."""
    return sorted(range(len(scores)), key=scores.__getitem__, reverse=True)[:k]  # stable: the first on ties


def kept_indices(scores: Sequence[float], total_tokens: int) -> list[int]:
    """The root and the best ``total_tokens - 1`` nodes of a pool, in pool order.

    Pool: ``scores`` [M], index 0 the root, parents[i] < i. A child never scores above its parent
    and ties go to the lower (shallower) index, so the kept set always contains each kept node's
    parent: it is a subtree."""
    return [0] + sorted(i + 1 for i in best_frontier(scores[1:], total_tokens - 1))


@dataclasses.dataclass
class Pool:
    """A candidate pool or draft tree on the host, as ``DraftTree``'s fields in plain lists: the form a
    tree is grown, grafted and cut in (a round's pool has a few dozen nodes, where each tensor operation
    costs more than the Python it replaces)."""

    tokens: list[int]
    parents: list[int]
    scores: list[float]

    @property
    def size(self) -> int:
        return len(self.tokens)

    def subtree(self, kept: Sequence[int]) -> "Pool":
        """The nodes ``kept`` (increasing, root first, closed under parents: ``kept_indices``), re-indexed."""
        new_index = {node: i for i, node in enumerate(kept)}
        return Pool([self.tokens[n] for n in kept],
                    [-1 if self.parents[n] < 0 else new_index[self.parents[n]] for n in kept],
                    [self.scores[n] for n in kept])

    def tree(self, device: torch.device | str = "cpu") -> DraftTree:
        if torch.device(device).type == "cpu":
            return DraftTree(tokens=host_tensor(self.tokens), parents=host_tensor(self.parents),
                             scores=host_tensor(self.scores, torch.float32))
        return DraftTree(tokens=torch.tensor(self.tokens, dtype=torch.long, device=device),
                         parents=torch.tensor(self.parents, dtype=torch.long, device=device),
                         scores=torch.tensor(self.scores, dtype=torch.float32, device=device))


def graft_chains(pool: Pool, chains: Sequence[tuple[Sequence[int], Sequence[float], int]],
                 share: bool = True) -> Pool:
    """Hang chains of draft tokens from nodes of a candidate pool (prompt-lookup drafts onto the
    drafter's tree), one after another, sharing the nodes they agree on.

    ``pool``: as ``kept_indices`` takes it (index 0 the root, parents[i] < i, children score no
    higher than parents); each chain ``(tokens [C], offsets [C], at)``: its token j is scored node
    ``at``'s score (as the chains before left it) plus ``offsets[j]``, offsets non-increasing and
    <= 0 (cumulative log-probabilities below ``at``). Walking down from ``at``, a chain token that
    is already a child of the current node reuses it (its score becomes the higher of the two),
    the rest are appended in order. The result is a pool of the same form holding every path of
    ``pool`` plus the path to each ``at`` followed by every prefix of its chain, with no two
    siblings sharing a token. With ``share=False`` every chain is appended as new nodes (no existing
    node's score changes; a chain token may repeat a sibling's: for drawn siblings, whose scores
    must not depend on which tokens were drawn). One pass for all chains; ``pool`` is not changed."""
    tokens, parents, scores = list(pool.tokens), list(pool.parents), list(pool.scores)
    children: dict[tuple[int, int], int] = (
        {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens)) if p >= 0} if share else {})
    for chain, offsets, at in chains:
        node, base = at, scores[at]
        for token, offset in zip(chain, offsets):
            child = children.get((node, token))  # none without share: children stays empty
            if child is None:
                child = len(tokens)
                if share:
                    children[(node, token)] = child
                tokens.append(token)
                parents.append(node)
                scores.append(base + offset)
            else:
                scores[child] = max(scores[child], base + offset)
            node = child
    return Pool(tokens, parents, scores)


@dataclasses.dataclass
class StaticLayout:
    """An EAGLE-1 static tree. Node 0 is the root; node i > 0 is the ``ranks[i]``-th most likely
    child of ``parents[i]``; ``depths`` [N]."""

    parents: torch.Tensor
    ranks: torch.Tensor
    depths: torch.Tensor


def static_layout(choices: Sequence[Sequence[int]]) -> StaticLayout:
    """EAGLE-1 tree choices, e.g. ``[[0], [1], [0, 0], [0, 1]]`` (a path of child ranks per node;
    every prefix of a choice must be a choice too) -> the layout in breadth-first order."""
    paths = sorted({tuple(c) for c in choices}, key=lambda c: (len(c), c))
    index = {(): 0}
    parents, ranks, depths = [-1], [0], [0]
    for path in paths:
        if not path or path[:-1] not in index:
            raise ValueError(f"static tree choice {list(path)} lacks its parent {list(path[:-1])}")
        index[path] = len(parents)
        parents.append(index[path[:-1]])
        ranks.append(path[-1])
        depths.append(len(path))
    return StaticLayout(parents=torch.tensor(parents), ranks=torch.tensor(ranks), depths=torch.tensor(depths))


def graft_tree(pool: Pool, at: int, tokens: Sequence[int], parents: Sequence[int], offsets: Sequence[float],
               share_from: int = 0) -> tuple[Pool, list[int]]:
    """Hang a tree of draft tokens below node ``at`` of a candidate pool (suffix drafts onto the
    drafter's tree): node j has token ``tokens[j]``, parent ``parents[j]`` (-1: ``at``; parents
    come first) and score ``at``'s plus ``offsets[j]`` (<= 0, no higher than its parent's). A node
    whose token is already a child of its parent's place reuses that child if its index is at least
    ``share_from`` (its score becomes the higher of the two), as ``graft_chains`` does; else it is
    new (``share_from=pool.size``: no node is merged with a drawn one, whose score must not depend
    on which token was drawn).
    Returns the pool (``pool`` is not changed) and the pool index of each grafted node [len(tokens)]."""
    out = Pool(list(pool.tokens), list(pool.parents), list(pool.scores))
    children = {(p, t): i for i, (p, t) in enumerate(zip(out.parents, out.tokens)) if p >= 0 and i >= share_from}
    base, places = out.scores[at], []
    for token, parent, offset in zip(tokens, parents, offsets):
        above = at if parent < 0 else places[parent]
        node = children.get((above, token))
        if node is None:
            node = len(out.tokens)
            children[(above, token)] = node
            out.tokens.append(token)
            out.parents.append(above)
            out.scores.append(base + offset)
        else:
            out.scores[node] = max(out.scores[node], base + offset)
        places.append(node)
    return out, places
