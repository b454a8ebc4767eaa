"""EAGLE-2 trees of many sequences grown together on the device: the batched engine's greedy drafting
where the drafters' caches are slots of one pool (``kv_cache.CachePool``).

``EagleDrafter.drafting`` grows one sequence's tree on the host: each depth's children come back to
the host and Python decides, sequence by sequence, which nodes to expand. In a batch of 64 that is
most of a round's host time. ``draft_together`` grows the trees of all sequences of one drafter at
once, in ``device_rounds.DeviceTreeDrafter``'s shapes: the root's top_k children, then ``calls`` times
each sequence's top_k best newest nodes expanded by ONE pooled drafter call for all sequences (each row
attends to its sequence's cache and to its ancestors among the round's rows), their top_k children each;
then each sequence's best nodes are kept on the device and read to the host in one copy. Where the
drafter's pool runs on static shapes (``pooled.DrafterGraphs``) the whole phase is one static function,
replayed as one CUDA graph (``grown_trees``).

The pool is EAGLE-2's (at each depth the best top_k children expanded). The host path expands only the
nodes of it that can still be kept, in the same order, so both keep the same best nodes: a sequence
gets the tree it drafts alone. Prompt-lookup chains are grafted on the host afterwards, as alone
(``EagleDrafter.graft_lookup``)."""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import torch

from eagle.decoding.proposers import EagleDrafter, Proposal
from eagle.decoding.tree import (Pool, grow_pools, kept_indices, kept_parents, kept_pool, pool_depths, root_only,
                                 topk_children)
from eagle.runtime import cuda_graphs, kv_cache
from eagle.runtime.kv_cache import SlotCache
from eagle.runtime.shapes import ROW_BUCKETS, SEGMENT_BUCKETS, SPAN_BUCKETS, StaticShape, keys_for
from eagle.runtime.pooled import (DrafterGraphs, extended,
                                  pooled_drafter_forward)


def grows_together(proposer: object) -> bool:
    """Whether ``draft_together`` takes ``proposer``: an ``EagleDrafter`` with a dynamic tree of a fixed
    size (not sized by its own timing), children by rank (not drawn), its cache a slot of a pool."""
    return (isinstance(proposer, EagleDrafter) and not proposer.draw_temperature and not proposer.cfg.choices
            and proposer.sizing is None and isinstance(proposer.cfg.total_tokens, int)
            and isinstance(proposer.cache, SlotCache))


def grow(first: EagleDrafter, hidden: torch.Tensor, roots: torch.Tensor, committed: torch.Tensor, calls: int,
         call: Callable[..., torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The EAGLE-2 candidate pools of B sequences of ``first``'s drafter and tree: below ``roots`` [B] (target
    ids), from the root's predictions ``hidden`` [B, H], ``committed`` [B] positions cached, with ``calls``
    drafter calls after the root's children, each ``call(features [B k, W], embeds [B k, H], positions [B k],
    starts [B], seen [B, k, d k]) -> [B k, H]`` (sequence b's k rows written at ``starts[b]`` on, seeing every
    key before its last d k and of those what ``seen`` allows) -> (tokens [B, M] target ids, parents [B, M]
    (root -1, parents < index), scores [B, M] cumulative draft log-probabilities, root 0), M = 1 + k + calls
    k^2. Device operations only: the whole phase can be one static function."""
    drafter, target, k = first.drafter, first.target, first.cfg.top_k
    b, dev = hidden.shape[0], hidden.device
    itself = torch.eye(k, dtype=torch.bool, device=dev).expand(b, k, k)

    def logprobs(rows: torch.Tensor) -> torch.Tensor:
        logits = drafter.draft_logits(rows, lambda h: target.lm_head(h.to(target.dtype)))
        return torch.log_softmax(logits.float(), dim=-1)

    def step(d: int, inputs: torch.Tensor, tokens: torch.Tensor, earlier: torch.Tensor) -> torch.Tensor:
        seen = torch.cat([earlier[:, :, :(d - 1) * k], itself], dim=2)  # [B, k, d k]: the round's rows it sees
        embeds = target.embed(tokens.reshape(1, -1)).to(drafter.dtype)[0]
        out = call(inputs.reshape(b * k, -1).to(drafter.dtype), embeds, (committed + d - 1).repeat_interleave(k),
                   committed + (d - 1) * k, seen)
        return out.view(b, k, -1)

    return grow_pools(hidden, roots, k, calls, logprobs, lambda scores, lp, row: topk_children(scores, lp, k), step,
                      first.draft_ids)[:3]


def best_nodes(tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor, keep: int,
               levels: torch.Tensor, depths: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each pool's root and its ``keep`` best nodes no deeper than its ``levels`` [B], in pool order,
    re-indexed (``tree.kept_pool`` and ``tree.kept_parents`` per pool): (tokens, parents, scores)
    [B, 1 + keep] (a node deeper than its sequence's levels scores -inf, and so do its descendants: read up
    to the first -inf). Ties go to the lower index, as ``tree.kept_indices``: a kept node's parent is kept."""
    scores = scores.masked_fill(depths[None, :] > levels[:, None], -torch.inf)
    kept = kept_pool(scores, keep + 1)
    return tokens.gather(1, kept), kept_parents(parents, kept), scores.gather(1, kept)


def grown_trees(members: Sequence[EagleDrafter], roots: Sequence[int], levels: Sequence[int], calls: int,
                keep: int) -> tuple[torch.Tensor, ...]:
    """``grow`` then ``best_nodes`` for B sequences of one drafter (their ``last_hidden`` and pooled caches,
    left as they were) -> (tokens, parents, scores) [B, 1 + keep] on the device. On the pool's
    ``DrafterGraphs`` where it has them: the whole phase one static function of (the batch bucket, top_k,
    ``calls``, ``keep``, the keys read, the span of the masks), replayed as one CUDA graph, the sequences'
    inputs filled by one copy from the host and one on the device; else each drafter call pooled eagerly."""
    first = members[0]
    k, device, b = first.cfg.top_k, first.device, len(members)
    caches = [p.cache for p in members]
    committed = [kv_cache.cache_length(c) for c in caches]
    graphs = caches[0].pool.graphs
    if isinstance(graphs, DrafterGraphs) and calls * k <= SPAN_BUCKETS[-1] and k <= SEGMENT_BUCKETS[-1]:
        pool, _ = extended(caches, [calls * k] * b)  # the rows the phase writes counted, deferred moves applied
        rows = cuda_graphs.bucket_for(b, ROW_BUCKETS)
        span = cuda_graphs.bucket_for(calls * k, SPAN_BUCKETS)
        keys_len = keys_for(max(committed) + calls * k, pool.capacity)
        width = first.last_hidden.shape[0]

        def make() -> StaticShape:
            inputs = dict(hidden=torch.zeros(rows, width, dtype=first.last_hidden.dtype, device=device),
                          ints=torch.zeros(4, rows, dtype=torch.long, device=device))  # roots, committed, levels, slots
            depths = torch.tensor(pool_depths(k, calls), device=device)

            def run() -> tuple[torch.Tensor, ...]:
                roots_, committed_, levels_, slots = inputs["ints"]

                def call(features, embeds, positions, starts, seen):  # noqa: ANN001, ANN202 - grow's call
                    return graphs.step_rows(features, embeds, positions, slots, starts, seen, span, keys_len)

                pools = grow(first, inputs["hidden"], roots_, committed_, calls, call)
                return best_nodes(*pools, keep, levels_, depths)

            return StaticShape(inputs, run)

        def fill(shape: StaticShape) -> None:
            pad = rows - b
            shape.inputs["hidden"][:b] = torch.stack([p.last_hidden for p in members])
            shape.inputs["hidden"][b:] = 0
            shape.inputs["ints"].copy_(torch.tensor([list(roots) + [0] * pad, committed + [0] * pad,
                                                     list(levels) + [0] * pad,
                                                     [c.slot for c in caches] + [pool.scratch] * pad]))

        kept = graphs.run(("trees", rows, k, calls, keep, keys_len, span, width), make, fill)
        kept = tuple(t[:b] for t in kept)
    else:
        def call(features, embeds, positions, starts, seen):  # noqa: ANN001, ANN202 - grow's call
            return pooled_drafter_forward(first.drafter, features, embeds, positions, caches, [k] * b, seen)

        hidden = torch.stack([p.last_hidden for p in members])
        pools = grow(first, hidden, torch.tensor(list(roots), device=device), torch.tensor(committed, device=device),
                     calls, call)
        kept = best_nodes(*pools, keep, torch.tensor(list(levels), device=device),
                          torch.tensor(pool_depths(k, calls), device=device))
    for cache, length in zip(caches, committed):
        kv_cache.roll_back(cache, length)
    return kept


@dataclasses.dataclass
class Together:
    """``draft_together``'s result: each sequence's ``proposals``; ``phase_seconds``, what the trees grown
    together took (the phase and its read, paid once however many sequences join); ``host_seconds``, what
    each sequence's grafts and cut took after it (each one's share)."""

    proposals: list[Proposal]
    phase_seconds: float = 0.0
    host_seconds: float = 0.0


@torch.inference_mode()
def draft_together(proposers: Sequence[EagleDrafter], ids: Sequence[list[int]], max_depths: Sequence[int],
                   max_nodes: Sequence[int]) -> Together:
    """``EagleDrafter.drafting``'s proposals for sequences of one drafter and tree configuration whose
    proposers ``grows_together`` takes (``ids``: each one's tokens, the last one the root; ``max_depths``,
    ``max_nodes``: as ``drafting`` takes them), after each one's catch-up (``EagleDrafter.catching_up``):
    the trees grown together (``grow``), each one's best nodes read in one copy for all, then grafted and
    cut on the host as alone."""
    cfg = proposers[0].cfg
    totals = [min(cfg.total_tokens, n) for n in max_nodes]
    levels = [min(cfg.levels, depth) for depth in max_depths]
    proposals: list[Proposal | None] = [None] * len(proposers)
    phase_seconds = host_seconds = 0.0
    grown = []
    for i, p in enumerate(proposers):
        p.last_matches, p.drawn_from = [], {}
        if p.last_hidden is None or levels[i] < 1 or totals[i] < 2:
            proposals[i] = Proposal(root_only(ids[i][-1], p.tree_device))
        else:
            grown.append(i)
    if grown:
        members = [proposers[i] for i in grown]
        calls = max(levels[i] for i in grown) - 1
        pool_size = 1 + cfg.top_k + calls * cfg.top_k ** 2
        # the best nodes read back: the most any sequence keeps, rounded up to a bucket (one static shape for
        # the sizes the load hands out; the host keeps each sequence's own number of them)
        needed = max(totals[i] for i in grown) - 1
        keep = min(cuda_graphs.bucket_for(needed, cuda_graphs.BUCKETS) or needed, pool_size - 1)
        began = time.perf_counter()
        kept = grown_trees(members, [ids[i][-1] for i in grown], [levels[i] for i in grown], calls, keep)
        both = torch.cat([kept[0], kept[1], kept[2].double()], 1).tolist()  # one copy: ids and float32 scores exact
        read = time.perf_counter()
        phase_seconds = read - began
        width = keep + 1
        for i, p, row in zip(grown, members, both):
            scores = row[2 * width:]
            n = next((j for j, s in enumerate(scores) if s == -float("inf")), width)
            pool = Pool([int(t) for t in row[:n]], [int(q) for q in row[width:width + n]], scores[:n])
            pool = p.graft_lookup(ids[i], pool, max_depths[i])
            tree = pool.subtree(kept_indices(pool.scores, totals[i])).tree(p.tree_device)
            proposals[i] = Proposal(tree)
        host_seconds = (time.perf_counter() - read) / len(grown)
    now = time.perf_counter()
    for p, proposal in zip(proposers, proposals):
        p.proposed = (proposal.tree, now)
    return Together(proposals, phase_seconds, host_seconds)
