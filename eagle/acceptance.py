"""Acceptance rules (pure functions): which draft tokens the target keeps, and the next token.

Every rule returns an ``Acceptance``: the tree nodes kept (root first) and the token that
follows them, drawn from the target (the bonus token, or the correction after a rejection)."""

from __future__ import annotations

import dataclasses

import torch

from eagle.sampling import sample


@dataclasses.dataclass
class Acceptance:
    """``nodes``: indices of the accepted tree nodes, root (0) first, [m + 1] long;
    ``next_token``: the token drawn from the target after the last accepted node."""

    nodes: torch.Tensor
    next_token: int


def greedy_tree(tokens: torch.Tensor, parents: torch.Tensor, paths: torch.Tensor,
                target_argmax: torch.Tensor) -> Acceptance:
    """The longest root-to-leaf prefix whose tokens equal the target's argmax, plus the bonus.

    ``tokens``/``parents``/``target_argmax`` [N]; ``paths`` [L, D + 1] (-1 padded)."""
    agrees = tokens == target_argmax[parents.clamp(min=0)]
    agrees[0] = True
    on_path = agrees[paths.clamp(min=0)] & (paths >= 0)
    lengths = on_path.long().cumprod(dim=1).sum(dim=1)
    best = int(torch.argmax(lengths))
    nodes = paths[best, : int(lengths[best])]
    return Acceptance(nodes=nodes, next_token=int(target_argmax[nodes[-1]]))


def children_of(parents: torch.Tensor) -> list[list[int]]:
    """[N] parents -> the children of each node, in index order."""
    kids: list[list[int]] = [[] for _ in range(parents.shape[0])]
    for child, parent in enumerate(parents.tolist()):
        if parent >= 0:
            kids[parent].append(child)
    return kids


def recursive_rejection_tree(tokens: torch.Tensor, parents: torch.Tensor, target_probs: torch.Tensor,
                             generator: torch.Generator) -> Acceptance:
    """Lossless sampling for a tree of deterministic drafts (EAGLE-2 / SpecInfer style).

    At the current node, try its children in order: accept child token x with probability
    p(x); on rejection set p(x) = 0 and renormalize, then try the next child. If all are
    rejected (or there are none), draw the next token from what remains of p. The drafts
    act as a point mass (q = 1), so the result is distributed exactly as p. Renormalizing is
    kept implicit: with ``left`` the mass not yet rejected, x is accepted when u * left < p(x).
    ``tokens``/``parents`` [N]; ``target_probs`` [N, V], the warped target distribution at each node."""
    kids = children_of(parents)
    token_list = tokens.tolist()
    node, accepted = 0, [0]
    while True:
        p = target_probs[node].float().cpu()
        xs = [token_list[child] for child in kids[node]]
        mass = p[xs].tolist() if xs else []
        rejected: set[int] = set()
        left = float(p.sum())
        for child, x, px in zip(kids[node], xs, mass):
            u = torch.rand(1, generator=generator).item()
            if x in rejected:  # a token twice among the children: its mass is gone already
                continue
            if px > 0 and u * left < px:
                node = child
                accepted.append(child)
                break
            rejected.add(x)
            left -= px
        else:
            if rejected:
                rest = p.clone()
                rest[list(rejected)] = 0.0
                p = rest if float(rest.sum()) > 0 else p  # all mass rejected: only by rounding
            return Acceptance(nodes=torch.tensor(accepted, dtype=torch.long, device=tokens.device),
                              next_token=int(sample(p, generator)))


def recursive_rejection_sampled_tree(tokens: torch.Tensor, parents: torch.Tensor, target_probs: torch.Tensor,
                                     child_probs: torch.Tensor, generator: torch.Generator) -> Acceptance:
    """Lossless sampling for a tree whose children were drawn from the drafter (recursive
    speculative decoding, Jeon et al. 2024, drafts drawn without replacement).

    The children of a node are draws without replacement from q = ``child_probs[node]``, in
    index order. They are tried in turn against r, what the target still owes (p at first): the
    i-th draw x came from q_i, q without the earlier draws, renormalized; it is accepted with
    probability min(1, r(x) / q_i(x)), and on rejection r becomes normalize(max(0, r - q_i)).
    Each try is one step of speculative sampling towards r, so the token that comes out (an
    accepted child, or a draw from the last r) is distributed exactly as p.
    ``tokens``/``parents`` [N]; ``target_probs`` [N, V], the warped target distribution at each
    node; ``child_probs`` [N, V] (rows of nodes without children are not read; float64 keeps the
    ratios of tiny probabilities: a token far down q can be the second draw). Computed in float64."""
    kids = children_of(parents)
    token_list = tokens.tolist()
    node, accepted = 0, [0]
    while True:
        p = target_probs[node].double().cpu()
        r = p / p.sum()
        if kids[node]:
            q = child_probs[node].double().cpu()
            q = q / q.sum()  # q_i: what the next draw came from (normalized over tokens not drawn yet)
        for child in kids[node]:
            x = token_list[child]
            u = torch.rand(1, generator=generator).item()
            qx, rx = q[x].item(), r[x].item()
            if qx <= 0:  # not drawable (its probability underflowed): as if never drawn
                continue
            if u * qx < rx:
                node = child
                accepted.append(child)
                break
            r = residual_distribution(r, q)
            q[x] = 0.0
            left = q.sum()  # by its sum, not 1 - q(x): q(x) may round to 1 with tokens still drawable
            q = q / left if left > 0 else q
        else:
            return Acceptance(nodes=torch.tensor(accepted, dtype=torch.long, device=tokens.device),
                              next_token=int(sample(r, generator)))


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
