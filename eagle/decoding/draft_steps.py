"""Drafter calls of many sequences at once, in lockstep.

A tree proposer drafts as a generator (``Proposer.drafting``): it yields one ``DraftStep`` per
drafter call (its rows through the drafter, then the head's children of their outputs) and is sent
back that step's ``StepResult``; it returns its ``Proposal``. ``run_together`` drives the generators of
all sequences drafting in a round together: each turn it answers every waiting step at once
(``run_steps``): the drafter's rows of every sequence (each attends to its own cache: one call each, or
ONE call for all where the drafter caches are slots of one pool, ``pooled.pooled_drafter_forward``), then
ONE head and log-softmax over all their rows, ONE top-k for all children chosen by rank and ONE copy of
them to the host. A sequence alone runs the same functions with a batch of one, so in a batch it drafts the tree
it drafts alone wherever a product gives a row the same values whatever rows are beside it (the
compiled CPU kernels do). On a GPU this turns a round's per-sequence launches and host reads of the
head and the children into one set per tree depth."""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from typing import Any, Generator, Sequence

import torch

from eagle.decoding.tree import topk_children
from eagle.runtime.masks import attention_bias
from eagle.runtime import kv_cache
from eagle.runtime.kv_cache import SlotCache
from eagle.runtime.pooled import pooled_drafter_forward


@dataclasses.dataclass
class DraftStep:
    """One sequence's share of a drafter call. The drafter's F input rows: ``rows`` [F, H] on the device (or a
    list of tensors, their rows one after another), or rows ``pick`` [F] of ``rows`` (a previous step's
    outputs); with ``tokens`` [F] (target ids) at ``positions`` [F], appended to ``cache``; ``seen`` (bool
    [F, S], S >= F): which of the step's last S keys each row attends to (the round's nodes cached before it,
    then its own rows), every earlier key being seen; None: causal. ``rows`` None: no drafter rows, the head
    reads ``hidden`` [F, H]. ``head``: run the head over the F outputs (log-probs over the draft
    vocabulary); ``k`` > 0: and give each output its k most likely children after ``parent_scores`` [F]
    (``tree.topk_children``). ``tokens``, ``positions``, ``parent_scores`` (host lists) and ``seen`` (a host
    tensor) are moved to the device by ``run_steps``, each kind in one copy for all sequences (``seen`` one
    per sequence where the caches are not pooled), and all sequences' rows are gathered by one index.
    ``drafter``/``target``: whose forward, head and embeddings."""

    drafter: Any
    target: Any
    cache: Any = None
    rows: torch.Tensor | list[torch.Tensor] | None = None
    pick: Sequence[int] | None = None
    tokens: Sequence[int] | None = None
    positions: Sequence[int] | None = None
    seen: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    head: bool = True
    k: int = 0
    parent_scores: Sequence[float] | None = None


@dataclasses.dataclass
class StepResult:
    """A step's answer: ``hidden`` [F, H] (the drafter's outputs, or the step's ``hidden``),
    ``logprobs`` [F, V_draft] (None without the head), and for ``k`` > 0 the children on the host:
    ``child_tokens`` (target ids) and ``child_scores``, F * k each, parent by parent, best first."""

    hidden: torch.Tensor
    logprobs: torch.Tensor | None = None
    child_tokens: list[int] | None = None
    child_scores: list[float] | None = None


def run_steps(steps: Sequence[DraftStep]) -> list[StepResult]:
    """Answer the steps of one drafter and target, as described in the module's docstring."""
    drafter, target = steps[0].drafter, steps[0].target
    hidden = [s.hidden for s in steps]
    fed = [i for i, s in enumerate(steps) if s.rows is not None]
    if fed:
        sizes = [len(steps[i].tokens) for i in fed]
        # tokens and positions of all sequences in one copy to the device
        both = torch.tensor([t for i in fed for t in steps[i].tokens] + [p for i in fed for p in steps[i].positions])
        inputs = drafter_inputs([steps[i] for i in fed], drafter.dtype)
        device = inputs.device
        tokens, positions = both.to(device).split(len(both) // 2)
        embeds = target.embed(tokens[None]).to(drafter.dtype)[0]
        if isinstance(steps[fed[0]].cache, SlotCache):  # caches of one pool: one call for all
            out = pooled_drafter_forward(drafter, inputs, embeds, positions, [steps[i].cache for i in fed], sizes,
                                         [steps[i].seen for i in fed])
            hidden_fed = out.split(sizes)
        else:
            hidden_fed = [drafter(x[None], embed[None], pos[None], steps[i].cache,
                                  step_bias(steps[i], drafter.dtype, device))[0]
                          for i, x, embed, pos in zip(fed, inputs.split(sizes), embeds.split(sizes),
                                                      positions.split(sizes))]
        for i, h in zip(fed, hidden_fed):
            hidden[i] = h
    results = [StepResult(h) for h in hidden]
    heads = [i for i, s in enumerate(steps) if s.head]
    if not heads:
        return results
    rows = torch.cat([hidden[i] for i in heads]) if len(heads) > 1 else hidden[heads[0]]
    logits = drafter.draft_logits(rows, lambda h: target.lm_head(h.to(target.dtype)))
    for i, lp in zip(heads, torch.log_softmax(logits.float(), dim=-1).split([hidden[i].shape[0] for i in heads])):
        results[i].logprobs = lp
    by_k = defaultdict(list)
    for i in heads:
        if steps[i].k:
            by_k[steps[i].k].append(i)
    for k, group in by_k.items():
        parents = torch.tensor([score for i in group for score in steps[i].parent_scores],
                               device=results[group[0]].logprobs.device)
        child_tokens, child_scores = topk_children(parents, torch.cat([results[i].logprobs for i in group]), k)
        ids, child_scores = drafter.to_target_ids(child_tokens).reshape(-1), child_scores.reshape(-1)
        if ids.device.type == "cpu":
            ids, child_scores = ids.tolist(), child_scores.tolist()
        else:  # one copy from the device for the group: ids and float32 scores are exact in float64
            both = torch.cat([ids.double(), child_scores.double()]).tolist()
            ids, child_scores = [int(t) for t in both[:len(both) // 2]], both[len(both) // 2:]
        start = 0
        for i in group:
            f = hidden[i].shape[0] * k
            results[i].child_tokens, results[i].child_scores = ids[start:start + f], child_scores[start:start + f]
            start += f
    return results


def drafter_inputs(steps: Sequence[DraftStep], dtype: torch.dtype) -> torch.Tensor:
    """The drafter's input rows of ``steps`` in ``dtype``, one after another [R, H]: each step's ``rows``, or its
    rows ``pick``; one concatenation and at most one gather (one index) for all steps."""
    parts, index, start, gather = [], [], 0, False
    for s in steps:
        pieces = s.rows if isinstance(s.rows, list) else [s.rows]
        n = sum(piece.shape[0] for piece in pieces)
        parts.extend(pieces)
        if s.pick is None:
            index.extend(range(start, start + n))
        else:
            index.extend(start + j for j in s.pick)
            gather = True
        start += n
    source = (parts[0] if len(parts) == 1 else torch.cat(parts)).to(dtype)
    return source[torch.tensor(index).to(source.device)] if gather else source


def step_bias(step: DraftStep, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """A step's additive mask [1, 1, F, cached + F] on ``device`` for its own cache (None: causal)."""
    if step.seen is None:
        return None
    return attention_bias(step.seen, kv_cache.cache_length(step.cache), dtype).to(device)


@torch.inference_mode()
def run_together(runs: Sequence[Generator[DraftStep, StepResult, Any]]) -> tuple[list[Any], list[float]]:
    """Drive step generators until each returns -> (their return values, the seconds each took: its own
    work plus an equal share of each ``run_steps`` call it took part in). Steps of one drafter and
    target are answered together (``run_steps``), one call per turn. The generators run in inference
    mode (only inside this call: a generator must not enter a mode it would hold across its yields)."""
    values: list[Any] = [None] * len(runs)
    seconds = [0.0] * len(runs)
    waiting: dict[int, DraftStep] = {}

    def advance(i: int, answer: StepResult | None) -> None:
        began = time.perf_counter()
        try:
            waiting[i] = runs[i].send(answer)
        except StopIteration as stop:
            values[i] = stop.value
        seconds[i] += time.perf_counter() - began

    for i in range(len(runs)):
        advance(i, None)
    while waiting:
        groups = defaultdict(list)
        for i, step in waiting.items():
            groups[(id(step.drafter), id(step.target))].append(i)
        turn, waiting = waiting, {}
        for members in groups.values():
            began = time.perf_counter()
            answers = run_steps([turn[i] for i in members])
            share = (time.perf_counter() - began) / len(members)
            for i, answer in zip(members, answers):
                seconds[i] += share
                advance(i, answer)
    return values, seconds


def run_alone(run: Generator[DraftStep, StepResult, Any]) -> Any:
    """One step generator driven to its return value."""
    return run_together([run])[0][0]
