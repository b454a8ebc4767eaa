"""Acceptance rules (pure functions): which draft tokens the target keeps, and the next token.

Every rule returns an ``Acceptance``: the tree nodes kept (root first) and the token that
follows them, drawn from the target (the bonus token, or the correction after a rejection)."""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from eagle.decoding.sampling import sample
from eagle.runtime.masks import host_tensor


@dataclasses.dataclass
class Acceptance:
    """``nodes``: indices of the accepted tree nodes, root (0) first, [m + 1] long;
    ``next_token``: the token drawn from the target after the last accepted node."""

    nodes: torch.Tensor
    next_token: int


class DrawSupport(Protocol):
    """What drawn children came from, sparse: ``support(node)`` -> (the tokens q puts mass on [M] long,
    their probabilities [M]) for a node with drawn children (``eagle.decoding.proposers.DrawDistributions``)."""

    def support(self, node: int) -> tuple[torch.Tensor, torch.Tensor]: ...


def greedy_tree(tokens: torch.Tensor, parents: torch.Tensor, paths: torch.Tensor,
                target_argmax: torch.Tensor) -> Acceptance:
    """The longest root-to-leaf prefix whose tokens equal the target's argmax, plus the bonus
    (the first such path of ``paths`` on a tie).

    ``tokens``/``parents``/``target_argmax`` [N]; ``paths`` [L, D + 1] (-1 padded)."""
    token, parent, argmax = tokens.tolist(), parents.tolist(), target_argmax.tolist()
    best = [0]
    for path in paths.tolist():
        nodes = [0]
        for node in path[1:]:
            if node < 0 or token[node] != argmax[parent[node]]:
                break
            nodes.append(node)
        if len(nodes) > len(best):
            best = nodes
    nodes = host_tensor(best) if tokens.device.type == "cpu" else torch.tensor(best, device=tokens.device)
    return Acceptance(nodes=nodes, next_token=argmax[best[-1]])


def children_of(parents: torch.Tensor) -> list[list[int]]:
    """[N] parents -> the children of each node, in index order."""
    kids: list[list[int]] = [[] for _ in range(parents.shape[0])]
    for child, parent in enumerate(parents.tolist()):
        if parent >= 0:
            kids[parent].append(child)
    return kids


def recursive_rejection_tree(tokens: torch.Tensor, parents: torch.Tensor, target_probs: torch.Tensor,
                             generator: torch.Generator, child_probs: torch.Tensor | DrawSupport | None = None,
                             drawn: torch.Tensor | None = None) -> Acceptance:
    """Lossless sampling for a draft tree: recursive speculative decoding over each node's
    children (SpecInfer / EAGLE-2 for deterministic drafts; Jeon et al. 2024 for drafts drawn
    without replacement).

    At the current node, its children are tried in index order against r, what the target still
    owes (the node's p at first). Each try is one step of speculative sampling towards r with the
    distribution that child came from:
    - a drawn child (``drawn[c]``) is the next draw without replacement from q = ``child_probs``
      of its parent: with q_i = q without the earlier draws, renormalized, it is accepted with
      probability min(1, r(x) / q_i(x)), and on rejection r becomes normalize(max(0, r - q_i));
    - any other child is a point mass (a top-k or prompt-lookup draft): accepted with
      probability r(x); on rejection r loses x and is renormalized.
    If every child is rejected (or there are none), the next token is drawn from r. So the token
    that comes out is distributed exactly as p, provided each child's draft and its place in the
    tree depend only on the children tried before it (and on no target output): the proposers
    put deterministic drafts after the drawn siblings, and a drawn node's inclusion never depends
    on its own token.
    ``tokens``/``parents`` [N]; ``target_probs`` [N, V], the warped target distribution at each
    node; ``child_probs``: [N, V] (rows of nodes without drawn children are not read), or a
    ``DrawSupport`` (then a rejected draw changes only the entries of r at q's M tokens);
    ``drawn`` [N] bool; both None for a tree of deterministic drafts. r is kept unnormalized with
    its mass (r / mass is the distribution), in float64 (it keeps the ratios of tiny
    probabilities: a token far down q can be the second draw)."""
    kids = children_of(parents)
    token_list = tokens.tolist()
    drawn_list = drawn.tolist() if drawn is not None else [False] * len(token_list)
    node, accepted = 0, [0]
    while True:
        r = target_probs[node].double().cpu()  # a copy: changed in place below
        mass = float(r.sum())
        position = None  # token -> its index in ids, once q_i (what the next drawn child came from) is read
        for child in kids[node]:
            x = token_list[child]
            u = torch.rand(1, generator=generator).item()
            if drawn_list[child]:
                if position is None:
                    ids, q = _support(child_probs, node)  # q_i over the tokens ids, normalized
                    position = {t: j for j, t in enumerate(ids.tolist())}
                j = position.get(x)
                qx = float(q[j]) if j is not None else 0.0
                if qx <= 0:  # not drawable (its probability underflowed): as if never drawn
                    continue
                if u * qx * mass < r[x].item():
                    break
                owed = r[ids]  # r <- max(0, r - mass * q_i): the residual, still scaled by the mass
                r[ids] = (owed - q * mass).clamp(min=0)
                left = float(r.sum())
                if left > 0:
                    mass = left
                else:  # r == q_i: the residual is r itself
                    r[ids] = owed
                q[j] = 0.0
                left = float(q.sum())  # by its sum, not 1 - q(x): q(x) may round to 1 with tokens still drawable
                if left > 0:
                    q /= left
            else:
                rx = r[x].item()
                if u * mass < rx:
                    break
                if mass - rx > 0:  # else all mass rejected: only by rounding
                    r[x] = 0.0
                    mass = float(r.sum())
        else:
            return Acceptance(nodes=torch.tensor(accepted, dtype=torch.long, device=tokens.device),
                              next_token=int(sample(r, generator)))
        node = child
        accepted.append(child)


def _support(child_probs: torch.Tensor | DrawSupport, node: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``node``'s drawn children came from: (tokens [M] long, probabilities [M] float64 summing
    to 1), on the CPU; from a dense [N, V] row, its non-zero entries."""
    if isinstance(child_probs, torch.Tensor):
        row = child_probs[node].double().cpu()
        ids = row.nonzero()[:, 0]
        q = row[ids]
    else:
        ids, q = child_probs.support(node)
        ids, q = ids.cpu(), q.double().cpu()
    return ids, q / q.sum()


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(0, p - q)) over the last dim; where p == q everywhere, p itself."""
    diff = (p - q).clamp(min=0)
    total = diff.sum(-1, keepdim=True)
    return torch.where(total > 0, diff / total.clamp(min=1e-30), p)


def speculative_chain(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                      generator: torch.Generator, lenience: float = 1.0) -> Acceptance:
    """Classic speculative sampling (Leviathan et al. / Chen et al.) for a chain of K drafts.

    ``draft_tokens`` [K]; ``draft_probs`` [K, V] (q, the distributions they were drawn from);
    ``target_probs`` [K + 1, V] (p at the root and after each draft). Accept draft i with
    probability min(1, p(x) / (q(x) * lenience)); on the first rejection draw from
    normalize(max(0, p - q)) and stop; if all are accepted, draw the bonus token from p[K].
    lenience = 1 is exact; lenience < 1 accepts more and is lossy. Node indices count the root
    as 0, so ``nodes`` = [0, 1, ..., m]."""
    p_all, q_all = target_probs.float().cpu(), draft_probs.float().cpu()
    xs = draft_tokens.tolist()
    for i, x in enumerate(xs):
        ratio = p_all[i, x] / (q_all[i, x] * lenience)
        if torch.rand(1, generator=generator).item() >= min(1.0, ratio.item()):
            next_token = int(sample(residual_distribution(p_all[i], q_all[i]), generator))
            return Acceptance(nodes=torch.arange(i + 1, device=draft_tokens.device), next_token=next_token)
    next_token = int(sample(p_all[len(xs)], generator))
    return Acceptance(nodes=torch.arange(len(xs) + 1, device=draft_tokens.device), next_token=next_token)
