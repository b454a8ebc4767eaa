"""Draft trees (pure functions): EAGLE-2 dynamic expansion and reranking, EAGLE-1 static
trees from a list of choices, and the chain as the one-branch case.

A ``DraftTree`` holds the root (the last accepted token, not yet in the target's cache) at
index 0 followed by draft nodes in topological order."""

from __future__ import annotations

import dataclasses
from typing import Callable, Generator, Sequence

import torch

from eagle.runtime.masks import host_tensor
from eagle.runtime.shapes import capture_installed

RANKED_SORT_MAX = 256  # ``ranked`` sorts rows this long or shorter whole


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


def ranked(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The indices [..., k] of the k best of ``scores`` [..., N] along the last dimension, best first, the
    lower index first on ties (a stable sort; ``torch.topk`` leaves ties' order unspecified): the one tie
    order of every tree path, the host's ``best_frontier`` included. On a CPU a long last dimension takes
    ``torch.topk`` for the k-th best value, then sorts only the k scores at or above it (a sort of a drafter's
    12k-token vocabulary costs ~0.4 ms a row there, this ~50 us); a tie at the k-th value or a NaN falls back
    to the whole sort, as does a capturable call (the check reads a value back to the host)."""
    n = scores.shape[-1]
    if (scores.device.type == "cpu" and RANKED_SORT_MAX < n and k < n and scores.numel() > 0
            and not capture_installed()):
        keep = scores >= torch.topk(scores, k, dim=-1).values[..., -1:]
        if bool((keep.sum(-1) == k).all()):  # else a tie at the k-th value, or NaN: the whole sort
            best = keep.nonzero()[:, -1].view(*scores.shape[:-1], k)  # each row's k best, lower index first
            return best.gather(-1, torch.sort(scores.gather(-1, best), dim=-1, descending=True, stable=True).indices)
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def topk_children(parent_scores: torch.Tensor, logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each of F parents gets its k most likely children (``ranked``).
    ``parent_scores`` [..., F], ``logprobs`` [..., F, V] -> (tokens [..., F, k], cumulative scores [..., F, k])."""
    child_tokens = ranked(logprobs, k)
    return child_tokens, parent_scores[..., None] + logprobs.gather(-1, child_tokens)


def drawn_children(parent_scores: torch.Tensor, logprobs: torch.Tensor, k: int, temperature: float | torch.Tensor,
                   support: int, uniform: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each of F parents gets k children drawn without replacement from softmax(logprobs / temperature)
    among its ``support`` most likely tokens (all V when ``support`` >= V), by Gumbel-top-k on the uniforms
    given (the k largest of logprobs / temperature + Gumbel noise come out in the order sequential draws
    without replacement would give). Their scores are the parent's plus the k largest log-probabilities,
    best first: they rank the j-th drawn child as the j-th most likely one, so siblings score
    non-increasing in draw order (a kept set of them is a prefix of the draws) and no score depends on
    which tokens were drawn. ``parent_scores`` [F], ``logprobs`` [F, V], ``temperature`` (a float or a 0-dim
    tensor), ``uniform`` [F, S] (S = min(support, V)) -> (tokens [F, k] in draw order, scores [F, k], the
    support [F, S], its log-probs [F, S])."""
    if support < logprobs.shape[-1]:
        among = ranked(logprobs, support)
        among_lp = logprobs.gather(-1, among)
    else:
        among_lp, among = logprobs, torch.arange(logprobs.shape[-1], device=logprobs.device).expand_as(logprobs)
    gumbel = -torch.log(-torch.log(uniform.clamp(min=1e-20)))
    drawn = ranked(among_lp / temperature + gumbel, k)
    best = among_lp.gather(-1, ranked(among_lp, k))
    return among.gather(-1, drawn), parent_scores[:, None] + best, among, among_lp


def best_frontier(scores: Sequence[float], k: int) -> list[int]:
    """Indices of the k best of the candidate scores [M], best first (the first on ties: ``ranked``'s order,
    on a host list)."""
    return sorted(range(len(scores)), key=scores.__getitem__, reverse=True)[:k]  # stable: the first on ties


def kept_pool(scores: torch.Tensor, total: int) -> torch.Tensor:
    """The node keeping of every tree path: the pool indices [..., total] of the root and the ``total - 1``
    best nodes of ``scores`` [..., M] (each pool of a batch along the last dimension; index 0 the root,
    parents[i] < i, no child scoring above its parent), increasing. Ties go to the lower index (``ranked``),
    so a kept node's parent, which scores at least as high and comes first, is kept too: a subtree."""
    best = ranked(scores[..., 1:], total - 1) + 1
    root = torch.zeros(best.shape[:-1] + (1,), dtype=torch.long, device=scores.device)
    return torch.cat([root, torch.sort(best, dim=-1).values], dim=-1)


def kept_indices(scores: Sequence[float], total_tokens: int) -> list[int]:
    """``kept_pool`` of a host pool's scores [M] (Python floats, compared in float64 as they are)."""
    return kept_pool(torch.tensor(scores, dtype=torch.float64), min(total_tokens, len(scores))).tolist()


def kept_parents(parents: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """The parents [..., n] of a pool's nodes ``kept`` [..., n] (``kept_pool``'s: increasing, root first,
    closed under parents), as indices among the kept (root -1); ``parents`` [..., M] the pool's."""
    index = torch.arange(kept.shape[-1], device=kept.device).expand(kept.shape)
    new_index = torch.full(parents.shape, -1, dtype=torch.long, device=parents.device).scatter(-1, kept, index)
    pool_parents = parents.gather(-1, kept)
    return torch.where(pool_parents >= 0, new_index.gather(-1, pool_parents.clamp(min=0)), pool_parents)


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


Children = Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
Step = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Select = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclasses.dataclass
class Expansion:
    """One expansion of ``growing``'s pools, to be answered with the nodes' children: ``d`` (0: the root,
    whose prediction is given, no drafter rows; d >= 1: drafter call d), ``nodes`` [B, F] their pool
    indices, ``rows`` [B, F] the row of the previous expansion's outputs (for d = 1, the root's prediction)
    that is each one's parent's prediction, ``tokens`` [B, F] target ids, ``scores`` [B, F], ``earlier``
    [B, F, W] which rows written before this call (in order, ``written`` of them) are each one's
    ancestors (W >= ``written``: read the first ``written``), ``row`` the draw row of the first node (the
    root 0, then every expanded node in order: 1 + ``written``)."""

    d: int
    nodes: torch.Tensor
    rows: torch.Tensor
    tokens: torch.Tensor
    scores: torch.Tensor
    earlier: torch.Tensor
    written: int

    @property
    def row(self) -> int:
        return 0 if self.d == 0 else 1 + self.written


def growing(roots: torch.Tensor, k: int, calls: int, select: Select | None = None,
            ) -> Generator[Expansion, tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]:
    """The one EAGLE-2 grower, as a generator: the pools of B sequences below ``roots`` [B] (target ids).
    It yields each ``Expansion`` (the root, then up to ``calls`` drafter calls) and is sent the expanded
    nodes' children (target ids [B, F, k], cumulative scores [B, F, k], parent by parent: ranked,
    ``topk_children``, or drawn, ``drawn_children``). After each expansion but the last the next one's
    nodes are ``select(d, scores [B, F k] of its children, pool scores [B, M] so far) -> [B, F']``
    indices among those children (default: the k best, ``ranked``: the first on ties; a narrower choice,
    or none to stop, on a host pool of B = 1). Returns (tokens [B, M] target ids, parents [B, M] (root -1,
    parents < index), scores [B, M], root 0)."""
    b, dev = roots.shape[0], roots.device
    nodes = torch.zeros(b, 1, dtype=torch.long, device=dev)
    rows, node_scores = nodes, torch.zeros(b, 1, device=dev)
    node_tokens = roots.reshape(b, 1)
    earlier = torch.zeros(b, 1, max(calls, 1) * k, dtype=torch.bool, device=dev)
    tokens, parents, scores = [node_tokens], [torch.full((b, 1), -1, dtype=torch.long, device=dev)], [node_scores]
    size = written = 0
    for d in range(calls + 1):
        child_tokens, child_scores = yield Expansion(d, nodes, rows, node_tokens, node_scores, earlier, written)
        f = nodes.shape[1]
        size, written = size + (d == 0), written + (f if d else 0)
        flat_scores, flat_tokens = child_scores.reshape(b, f * k), child_tokens.reshape(b, f * k)
        tokens.append(flat_tokens.to(node_tokens.dtype))
        parents.append(nodes.repeat_interleave(k, dim=1))
        scores.append(flat_scores)
        if d == calls:
            break
        best = ranked(flat_scores, k) if select is None else select(d, flat_scores, torch.cat(scores, 1))
        if best.shape[1] == 0:
            break
        parent_rows = torch.div(best, k, rounding_mode="floor")  # [B, F']: the row of this expansion each parent is
        nodes, rows = size + best, parent_rows
        node_scores, node_tokens = flat_scores.gather(1, best), flat_tokens.gather(1, best)
        # each new node's parent joins its ancestors (a drafter call's rows only); a scatter of a constant, not
        # ``x[i] = True`` (whose host scalar a CUDA capture cannot copy)
        earlier = earlier.gather(1, parent_rows[:, :, None].expand(-1, -1, earlier.shape[2]))
        if d:
            earlier = earlier.scatter(2, (written - f + parent_rows)[:, :, None], True)
        size += f * k
    return torch.cat(tokens, 1), torch.cat(parents, 1), torch.cat(scores, 1)


def grow_pools(hidden: torch.Tensor, roots: torch.Tensor, k: int, calls: int,
               logprobs: Callable[[torch.Tensor], torch.Tensor], children: Children, step: Step,
               draft_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """``growing`` on fixed shapes, each pool's k best newest nodes expanded by every call (device operations
    only: the whole phase can be one static function), from the roots' predictions ``hidden`` [B, H].
    ``logprobs(rows [N, H]) -> [N, V]`` the drafter's; ``children(parent_scores [B, F], logprobs [B, F, V],
    row) -> (draft indices [B, F, k], scores [B, F, k])`` (``topk_children`` or ``drawn_children``; ``row``:
    ``Expansion.row``); ``step(d, inputs [B, k, H], tokens [B, k], earlier [B, k, calls k]) -> [B, k, H]``
    call d's predictions (``Expansion``'s fields, ``inputs`` the parents' predictions); ``draft_ids`` [V] a
    draft index's target id. -> ``growing``'s pools [B, M], M = 1 + k + calls k^2, and each call's nodes."""
    b = hidden.shape[0]
    run, out, expanded = growing(roots, k, calls), hidden[:, None], []
    node = next(run)
    while True:
        if node.d:
            inputs = out.gather(1, node.rows[:, :, None].expand(-1, -1, out.shape[2]))
            out = step(node.d, inputs, node.tokens, node.earlier)  # [B, k, H]
            expanded.append(node.nodes)
        picks, child_scores = children(node.scores, logprobs(out.reshape(-1, out.shape[2])).view(b, out.shape[1], -1),
                                       node.row)
        try:
            node = run.send((draft_ids[picks], child_scores))
        except StopIteration as stop:
            return stop.value + (expanded,)


def pool_depths(k: int, calls: int) -> list[int]:
    """The depth of each node of a pool grown by ``grow_pools`` (``calls`` expansions of k nodes with k
    children each): the root, its k children, then k^2 nodes per call [1 + k + calls k^2]."""
    return [0] + [1] * k + [d + 1 for d in range(1, calls + 1) for _ in range(k * k)]


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
