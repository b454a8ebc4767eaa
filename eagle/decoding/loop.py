"""The one decoding loop shared by every method: propose -> verify -> accept -> compact cache
-> record stats. Plain decoding (``ar``) is the same loop with an empty draft."""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from typing import Any, Iterator

import torch

from eagle.decoding import acceptance
from eagle.runtime import kv_cache
from eagle.config import SamplingConfig, SpeculativeConfig
from eagle.errors import EagleError
from eagle.decoding.proposers import Proposal, Proposer
from eagle.decoding.sampling import logits_to_probs, sample
from eagle.runtime.target import Target
from eagle.decoding.tree import DraftTree
from eagle.decoding.tree_mask import tree_attention
from eagle.runtime.masks import attention_bias

STEPS = ("draft", "verify", "accept", "cache", "other")


@dataclasses.dataclass
class GenerationResult:
    """``token_ids``: new tokens only (an EOS that ended generation included); ``accept_lengths``:
    tokens gained per target forward, bonus included; ``step_seconds``: time per loop step;
    ``accepted_by_source``: accepted drafts by where they came from, for a proposer with several
    sources (``Proposer.accepted_by_source``)."""

    text: str
    token_ids: list[int]
    accept_lengths: list[int]
    target_forwards: int
    elapsed_s: float
    method: str = ""
    prompt_tokens: int = 0
    stop_reason: str = ""
    prefill_s: float = 0.0
    step_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    accepted_by_source: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def mean_accept_length(self) -> float:
        return sum(self.accept_lengths) / max(1, len(self.accept_lengths))

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / self.elapsed_s if self.elapsed_s > 0 else 0.0


def truncate_at_stop(tokens: list[int], eos_ids: frozenset[int], room: int) -> tuple[list[int], str]:
    """Cut a chunk of newly accepted tokens at the first EOS (kept) or at ``room`` tokens.
    Returns (kept tokens, stop reason: "eos", "length" or "")."""
    for i, tok in enumerate(tokens[:room]):
        if tok in eos_ids:
            return tokens[: i + 1], "eos"
    if len(tokens) >= room:
        return tokens[:room], "length"
    return tokens, ""


class Clock:
    """Time per step. Wall time, synchronizing CUDA at each lap so the split is honest; with
    ``events`` on CUDA, events read once at the end instead (timing adds no synchronisation)."""

    def __init__(self, device: torch.device, events: bool = False) -> None:
        self.cuda, self.events = device.type == "cuda", events and device.type == "cuda"
        self.seconds: dict[str, float] = defaultdict(float)
        self.marks: list[tuple[str, Any]] = []
        if self.cuda:
            torch.cuda.synchronize()
        self.last: Any = time.perf_counter()
        if self.events:
            self.last = self._event()

    @staticmethod
    def _event() -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def lap(self, step: str) -> None:
        if self.events:
            self.marks.append((step, self._event()))
            return
        if self.cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.seconds[step] += now - self.last
        self.last = now

    def step_seconds(self) -> dict[str, float]:
        if self.marks:
            torch.cuda.synchronize()
            for step, mark in self.marks:
                self.seconds[step] += self.last.elapsed_time(mark) / 1000
                self.last = mark
            self.marks = []
        return dict(self.seconds)


def check_request(target: Target, prompt_ids: list[int], max_new_tokens: int) -> None:
    """Refuse what no decoding loop can serve: no new tokens, or a prompt that fills the context."""
    if max_new_tokens < 1:
        raise EagleError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if len(prompt_ids) >= target.max_context:
        raise EagleError(f"prompt has {len(prompt_ids)} tokens; the model's context is {target.max_context}")


def chunk_and_stop(tokens: list[int], target: Target, room: int, produced: int,
                   max_new_tokens: int) -> tuple[list[int], str]:
    """A round's new tokens cut at an EOS or at ``room`` (``truncate_at_stop``), with the stop reason
    "context" where the room ran out before ``max_new_tokens`` (``produced`` tokens so far)."""
    chunk, stop = truncate_at_stop(tokens, target.eos_token_ids, room)
    if stop == "length" and produced + len(chunk) < max_new_tokens:
        stop = "context"
    return chunk, stop


def finish(target: Target, clock: Clock, new: list[int], accept_lengths: list[int], forwards: int, start: float,
           prompt_tokens: int, stop: str, prefill_s: float, method: str,
           sources: dict[str, int] | None = None) -> GenerationResult:
    """The ``GenerationResult`` of a finished loop (the detokenizing timed too: a tiny model's whole
    decoding can cost less)."""
    text = target.tokenizer.decode(new, skip_special_tokens=True)
    clock.lap("other")
    return GenerationResult(text=text, token_ids=new, accept_lengths=accept_lengths, target_forwards=forwards,
                            elapsed_s=time.perf_counter() - start, method=method, prompt_tokens=prompt_tokens,
                            stop_reason=stop, prefill_s=prefill_s, step_seconds=clock.step_seconds(),
                            accepted_by_source=dict(sources or {}))


def accept_round(proposal: Proposal, paths: torch.Tensor, logits: torch.Tensor | None, choices: torch.Tensor | None,
                 sampling: SamplingConfig, generator: torch.Generator,
                 lenience: float = 1.0) -> acceptance.Acceptance:
    """Step 3 of a round: which nodes of ``proposal.tree`` [N] the target keeps, and its next token.
    ``paths`` [L, D + 1] (``tree_attention``); ``logits`` [N, V] the target's at each node (not read
    when greedy); ``choices`` [N] the target's argmax at each node when greedy, else None."""
    tree = proposal.tree
    if choices is not None:
        return acceptance.greedy_tree(tree.tokens, tree.parents, paths, choices)
    if proposal.draft_probs is not None:
        return acceptance.speculative_chain(tree.tokens[1:], proposal.draft_probs, logits_to_probs(logits, sampling),
                                            generator, lenience=lenience)
    if tree.size > 1:
        return acceptance.recursive_rejection_tree(tree.tokens, tree.parents, logits_to_probs(logits, sampling),
                                                   generator, proposal.child_probs, proposal.drawn)
    return acceptance.Acceptance(nodes=torch.zeros(1, dtype=torch.long, device=tree.tokens.device),
                                 next_token=int(sample(logits_to_probs(logits[0], sampling), generator)))


def commit_round(target: Target, proposer: Proposer, cache: Any, past: int, tree: DraftTree,
                 acc: acceptance.Acceptance, features: torch.Tensor | None, ids: list[int], room: int,
                 produced: int, max_new_tokens: int) -> tuple[list[int], str]:
    """Step 4 of a round: compact the sequence's cache (``past`` tokens before the tree) to the
    accepted path, cut the new tokens at a stop (``chunk_and_stop``), extend ``ids`` in place and
    tell the proposer what was kept. ``features`` [N, F]: the target's at each tree node (None
    when the proposer needs none). Returns (the round's new tokens, stop reason or "")."""
    kv_cache.compact(cache, past, past + acc.nodes)
    chunk = tree.tokens[acc.nodes[1:]].tolist() + [acc.next_token]
    chunk, stop = chunk_and_stop(chunk, target, room, produced, max_new_tokens)
    ids.extend(chunk)
    if not stop:
        proposer.commit(ids, acc.nodes[1:].tolist(), features[acc.nodes] if features is not None else None)
    return chunk, stop


@torch.inference_mode()
def decode_loop(target: Target, proposer: Proposer, prompt_ids: list[int], max_new_tokens: int,
                sampling: SamplingConfig, generator: torch.Generator,
                spec: SpeculativeConfig | None = None, method: str = "") -> Iterator[list[int] | GenerationResult]:
    """Yield each chunk of accepted new tokens, then the ``GenerationResult``."""
    check_request(target, prompt_ids, max_new_tokens)
    device, start = target.device, time.perf_counter()
    ids, new, accept_lengths, forwards, stop = list(prompt_ids), [], [], 0, ""
    cache = target.new_cache()
    features = None
    if len(ids) > 1:  # prefill everything but the last token, which becomes the first tree root
        prefix = torch.tensor([ids[:-1]], device=device)
        out = target.forward(prefix, torch.arange(len(ids) - 1, device=device)[None], cache, logits_from=len(ids) - 1,
                             aux_layers=proposer.aux_layers)
        features = out.features[0]
    proposer.start(ids, features if proposer.needs_features else None)
    clock = Clock(device)  # synchronizes CUDA before its first reading
    prefill_s = clock.last - start
    sizing = proposer.sizing  # "auto": its gate says whether a round drafts at all, from past rounds' rates
    if sizing is not None:
        sizing.gate.start()
    while not stop:
        past, began = len(ids) - 1, time.perf_counter()
        # tokens still allowed: by max_new_tokens and by the context (the sequence never outgrows it)
        room = min(max_new_tokens - len(new), target.max_context - len(ids))
        drafts = sizing is None or sizing.gate.drafts(sizing.costs[0])
        # 1. propose a draft tree rooted at the last token, no deeper than the tokens still allowed
        proposal = proposer.propose(ids, max_depth=room - 1, max_nodes=target.max_context - past if drafts else 1)
        tree = proposal.tree
        clock.lap("draft")
        # 2. verify the whole tree in one target forward (tree mask, positions by depth)
        attn = tree_attention(tree.parents)
        bias = attention_bias(attn.mask, past, target.dtype) if tree.size > 1 else None
        out = target.forward(tree.tokens[None], (past + attn.depths)[None], cache, bias,
                             logits_from=tree.size if sampling.greedy else 0, aux_layers=proposer.aux_layers)
        choices = target.greedy_tokens(out.hidden[0]) if sampling.greedy else None  # greedy: only the argmaxes
        forwards += 1
        clock.lap("verify")
        # 3. accept: the longest agreeing path (greedy) or lossless rejection sampling
        acc = accept_round(proposal, attn.paths, out.logits[0], choices, sampling, generator,
                           spec.lenience if spec else 1.0)
        clock.lap("accept")
        # 4. compact the target's cache to the accepted path; tell the proposer what was kept
        chunk, stop = commit_round(target, proposer, cache, past, tree, acc,
                                   out.features[0] if proposer.needs_features else None, ids, room, len(new),
                                   max_new_tokens)
        clock.lap("cache")
        # 5. record stats and hand the chunk out
        new.extend(chunk)
        accept_lengths.append(len(chunk))
        if sizing is not None and forwards > 1:  # (a first drafting round also feeds the drafter the prompt)
            seconds = time.perf_counter() - began - proposer.skipped_seconds  # less catching up on plain rounds
            sizing.gate.record(drafts, len(chunk), seconds, sizing.costs[0])
        yield chunk
        clock.lap("other")
    proposer.finish(ids)
    yield finish(target, clock, new, accept_lengths, forwards, start, len(prompt_ids), stop, prefill_s, method,
                 proposer.accepted_by_source())


@torch.inference_mode()
def static_greedy_loop(target: Target, prompt_ids: list[int], max_new_tokens: int,
                       method: str = "ar") -> Iterator[list[int] | GenerationResult]:
    """Plain greedy decoding (``ar``) on the static path (``target.graphs``): each token one
    static function (``TargetGraphs.greedy_step``, one CUDA graph replay) and one host read.
    ``decode_loop``'s contract and tokens."""
    check_request(target, prompt_ids, max_new_tokens)
    device, start = target.device, time.perf_counter()
    ids, new, stop = list(prompt_ids), [], ""
    cache = target.new_cache()
    prompt = torch.tensor(ids, device=device)
    if len(ids) > 1:  # prefill all but the last token, the first step's input
        target.forward(prompt[None, :-1], torch.arange(len(ids) - 1, device=device)[None], cache,
                       logits_from=len(ids) - 1)
    token = prompt[-1:]
    clock = Clock(device, events=True)  # synchronizes CUDA once: the prefill's own time
    prefill_s = time.perf_counter() - start
    while not stop:
        room = min(max_new_tokens - len(new), target.max_context - len(ids))
        token = target.graphs.greedy_step(token, len(ids) - 1)
        clock.lap("verify")
        chunk, stop = chunk_and_stop([int(token)], target, room, len(new), max_new_tokens)
        clock.lap("accept")
        ids.extend(chunk)
        new.extend(chunk)
        yield chunk
        clock.lap("other")
    yield finish(target, clock, new, [1] * len(new), len(new), start, len(prompt_ids), stop, prefill_s, method)
