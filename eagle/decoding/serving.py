"""Continuous batching with draft trees: ``ServingEngine``.

Requests join (``add``) and leave (finished or ``cancel``) between rounds. Each ``step`` is one
round for every running sequence: each proposes its own draft tree (``ar``: the root alone),
ONE target forward verifies all trees (``eagle.runtime.segments.segment_forward``: each
sequence's rows attend to its own cache and its own tree's ancestors), then acceptance, cache
compaction and the proposer's update run per sequence, exactly as ``decode_loop`` does for one
(``accept_round``, ``commit_round``). So greedy output is the request's own greedy decoding and
sampled output keeps the target's distribution, whatever else is in the batch.

The prompts admitted in one step are prefilled by one target forward (packed, each attending to
itself only); a drafter is prefilled only when its sequence first drafts, and what root-only
rounds accepted is fed to it then (``EagleDrafter`` defers both), so a sequence the load keeps at
the root costs what a batched ``ar`` sequence costs.

Tree sizes come from the load (``load_sizing``): rows are handed out across the batch by
``batch_tree_sizes`` from the measured cost of a target forward at the batch's row count
(``cost_curve``) and each method's acceptance per draft rank (``RankRates``).

Not thread-safe: call ``add``, ``cancel``, ``close`` and ``step`` from one thread (or under one lock)."""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict, defaultdict
from typing import Any, Hashable, Sequence

import torch

from eagle.config import SamplingConfig, check_bool, check_int
from eagle.decoding.batch_trees import draft_together, grows_together
from eagle.decoding.draft_steps import run_together
from eagle.decoding.loop import GenerationResult, accept_round, check_request, commit_round
from eagle.decoding.proposers import Proposal, Proposer
from eagle.decoding.sampling import make_generator
from eagle.decoding.tree import DraftTree
from eagle.decoding.tree_mask import TreeAttention, tree_attention
from eagle.runtime.masks import attention_bias
from eagle.decoding.tree_sizing import AVERAGING, RankRates, batch_tree_sizes, cost_curve
from eagle.errors import EagleError
from eagle.inputs import METHODS
from eagle.runtime import kv_cache
from eagle.runtime.kernels import STREAM_MAX_ROWS
from eagle.runtime.pooled import DrafterGraphs, PooledGraphs
from eagle.runtime.segments import runs_segments, segment_forward

# the most prompt tokens one step prefills (a longer prompt goes alone): the requests it admits are
# prefilled by one forward; the running sequences get a round between such steps, and the first
# of many requests arriving together start while the others wait (on a CPU about 2 s a step here)
PREFILL_ROWS = 512
MAX_TREE = 16  # the most tree nodes (root included) a sequence verifies when total_tokens is "auto"
# a method's drafting time, as ``load_sizing`` believes it, shrinks by this factor for each round in which
# its sequences draft nothing, so one slow measurement (a first call, a busy machine) cannot stop drafting
# for good. Per round, not per sequence: faded per sequence, a batch of 64 lost three quarters of the
# estimate each round and went back to drafting every few rounds, for rows that did not pay
DRAFT_FADE = 0.98


@dataclasses.dataclass(frozen=True)
class RequestOptions:
    """How one request is decoded: ``method`` (one of ``eagle.inputs.METHODS``), ``max_new_tokens``,
    ``temperature`` (0: greedy), ``top_p``, ``top_k``, ``seed`` (None: a random one), ``stop``
    (strings that end the generation once the decoded text contains one), ``total_tokens`` (the most
    tokens an ``eagle-tree`` or ``pld`` round verifies, root included, as ``EagleModel.with_round_size``
    takes it; None: the model's own)."""

    method: str = "ar"
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    total_tokens: int | str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.method, str) or self.method not in METHODS:
            raise EagleError(f"unknown method {self.method!r}; choose from {', '.join(METHODS)}")
        check_int("max_new_tokens", self.max_new_tokens, 1)
        if self.total_tokens is not None and self.total_tokens != "auto":
            check_int("total_tokens", self.total_tokens, 1)
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise EagleError(f"stop must be non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)
        self.sampling  # checks temperature, top_p, top_k, seed

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed)


@dataclasses.dataclass
class RequestStats:
    """A request's counters so far: ``accept_lengths`` (tokens per round, bonus included),
    ``tree_size`` (nodes its last round verified, root included), ``first_token_s`` (seconds from
    ``add`` to its first token; None before), ``elapsed_s`` (from ``add``)."""

    method: str
    prompt_tokens: int
    generated: int = 0
    target_forwards: int = 0
    accept_lengths: list[int] = dataclasses.field(default_factory=list)
    tree_size: int = 0
    first_token_s: float | None = None
    elapsed_s: float = 0.0

    @property
    def mean_accept_length(self) -> float:
        return sum(self.accept_lengths) / max(1, len(self.accept_lengths))


@dataclasses.dataclass
class StepEvent:
    """What one ``step`` did for one request: ``new_token_ids`` (this round's accepted tokens, in
    order); ``finished`` with ``stop_reason`` ("eos", "length", "context" or "stop"; "" while it
    runs); ``result`` once finished: the whole ``GenerationResult`` (its ``text`` cut before a stop
    string)."""

    request_id: Hashable
    new_token_ids: list[int]
    finished: bool
    stats: RequestStats
    stop_reason: str = ""
    result: GenerationResult | None = None


@dataclasses.dataclass
class _Sequence:
    """A request's decoding state: ``ids`` prompt + new tokens (the last one is the next tree's
    root, not yet in ``cache``)."""

    request_id: Hashable
    options: RequestOptions
    sampling: SamplingConfig
    generator: torch.Generator
    model: Any  # the engine's model, or its view with the request's ``total_tokens``
    proposer: Proposer
    ids: list[int]
    stats: RequestStats
    added: float
    cache: Any = None
    new: list[int] = dataclasses.field(default_factory=list)
    text_checked: int = 0  # decoded characters already searched for stop strings
    text_cut: int = -1  # where a stop string begins in the decoded text

    def room(self, max_context: int) -> int:
        """Tokens still allowed, by ``max_new_tokens`` and by the context."""
        return min(self.options.max_new_tokens - len(self.new), max_context - len(self.ids))


@dataclasses.dataclass
class _Round:
    """One sequence's part of a round: its proposal, the same tree on the host (``host``: what
    acceptance and compaction read, without a wait on the device for each sequence) and its tree
    attention (host tensors), where its rows sit in the batched forward (``start``,
    ``proposal.tree.size`` rows) and how many tokens its cache held."""

    seq: _Sequence
    proposal: Proposal
    host: DraftTree
    attn: TreeAttention
    past: int
    start: int


def on_host(trees: list[DraftTree]) -> list[DraftTree]:
    """``trees`` with their tensors on the host: those on a device moved in one copy for all (a copy per
    tree would wait on the device once per tree)."""
    moved = [i for i, t in enumerate(trees) if t.tokens.device.type != "cpu"]
    if not moved:
        return trees
    sizes = [trees[i].size for i in moved]
    ids = torch.cat([torch.cat([trees[i].tokens, trees[i].parents]) for i in moved]).cpu()
    scores = torch.cat([trees[i].scores.float() for i in moved]).cpu()
    out = list(trees)
    for i, both, score in zip(moved, ids.split([2 * n for n in sizes]), scores.split(sizes)):
        out[i] = DraftTree(*both.split(trees[i].size), score)
    return out


class ServingEngine:
    """Decode many requests together, one round per ``step``, with the methods of ``model``
    (an ``eagle.engine.EagleModel``).

    ``max_batch``: sequences decoded at once (the others wait in the queue, first come first
    served); ``load_sizing``: tree sizes from the load (``batch_tree_sizes``), else each method's
    configured tree; ``max_tree``: the most nodes (root included) one tree may have where the
    model's ``total_tokens`` is "auto" (an int ``total_tokens`` is used as it is); ``row_seconds``: a
    target forward's seconds for 1 .. S rows, for ``load_sizing`` (default: ``cost_curve``, measured
    once per machine and cached); ``cache_pool``: the running sequences' caches as slots of one
    ``CachePool`` (``kv_cache``), so that a round's forward attends for all of them in one call per layer
    (``pooled.pooled_forward``; off by default, a GPU layout checked with the CPU stand-in for CUDA capture
    only: on CUDA per-sequence attention launches a few kernels per sequence and layer, which it saves);
    on static shapes replayed as CUDA graphs (``pooled.PooledGraphs``) where the target's forward is
    (``cuda_graphs``; on a CPU with ``EAGLE_FAKE_CAPTURE=1``, the stand-in capture: a rehearsal). With
    pooled caches the drafters' caches are pooled too (a pool per drafter), so that each drafter call of
    a round runs once for all sequences (``draft_steps``)."""

    def __init__(self, model: Any, max_batch: int = 8, load_sizing: bool = True, max_tree: int = MAX_TREE,
                 row_seconds: Sequence[float] | None = None, cache_pool: bool = False) -> None:
        check_int("max_batch", max_batch, 1)
        check_int("max_tree", max_tree, 1)
        self.model, self.target = model, model.target
        lean, graphs = self.target.lean, self.target.graphs
        check_bool("cache_pool", cache_pool)
        if cache_pool and not runs_segments(lean, pooled=True):
            raise EagleError(f"{self.target.name} has no lean forward to run pooled caches")
        self._pool = kv_cache.CachePool(len(lean.layers), max_batch, lean.num_kv_heads, lean.head_dim,
                                        self.target.dtype, self.target.device) if cache_pool else None
        if self._pool is not None and graphs is not None:  # static shapes, captured where the target's are
            self._pool.graphs = PooledGraphs(lean, self._pool, capture=graphs.capture)
        self.max_batch, self.load_sizing, self.max_tree = max_batch, load_sizing, max_tree
        self._queue: OrderedDict[Hashable, _Sequence] = OrderedDict()
        self._active: OrderedDict[Hashable, _Sequence] = OrderedDict()
        self._rates: dict[str, RankRates] = defaultdict(RankRates)
        self._draft_seconds: dict[str, float] = {}
        self._phase_seconds: dict[str, float] = {}  # a method's trees grown together: once a round (``batch_trees``)
        self._seconds: list[float] = list(row_seconds or [])
        self._fixed_seconds = row_seconds is not None
        self._draft_pools: dict[int, tuple[Any, kv_cache.CachePool]] = {}  # id(drafter) -> (it, its caches' pool)

    @property
    def active(self) -> int:
        """Sequences decoding now."""
        return len(self._active)

    @property
    def queued(self) -> int:
        """Requests waiting for a place in the batch."""
        return len(self._queue)

    @property
    def request_ids(self) -> list[Hashable]:
        """The requests in the engine: the running ones (in the order they joined the batch), then
        the queued ones (in the order they will join)."""
        return [*self._active, *self._queue]

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._active or request_id in self._queue

    def add(self, request_id: Hashable, prompt: Any, options: RequestOptions | None = None) -> None:
        """Queue a request; it joins the batch at a coming ``step``. ``prompt``: token ids (or a
        string / chat messages, as ``EagleModel.generate`` takes them). Refuses with an
        ``EagleError`` at once what cannot run: a request id in use, a bad option, a prompt that
        fills the context, a method the model lacks (``sd`` without a draft model, ...)."""
        options = options or RequestOptions()
        if request_id in self:
            raise EagleError(f"request id {request_id!r} is already in use")
        ids = self.target.encode_prompt(prompt)
        check_request(self.target, ids, options.max_new_tokens)
        sampling = options.sampling
        generator = make_generator(options.seed)
        model = self.model.with_round_size(options.method, options.total_tokens)
        proposer = model._proposer(options.method, sampling, generator, fixed_total=self.max_tree, host_trees=True,
                                   draft_caches=self._draft_cache)
        seq = _Sequence(request_id, options, sampling, generator, model, proposer, list(ids),
                        RequestStats(options.method, len(ids)), time.perf_counter())
        self._queue[request_id] = seq

    def cancel(self, request_id: Hashable) -> bool:
        """Drop a queued or running request (its cache is freed; no more events come for it).
        Returns whether it was there."""
        if self._queue.pop(request_id, None) is not None:
            return True
        seq = self._active.pop(request_id, None)
        if seq is not None:
            self._free(seq)
        return seq is not None

    def close(self) -> None:
        """Drop every request, queued or running, as ``cancel`` does each (no more events come for
        them). What the engine learned (acceptance per rank, drafting times, the cost curve) stays:
        it can take new requests afterwards."""
        self._queue.clear()
        for seq in self._active.values():
            self._free(seq)
        self._active.clear()

    def _free(self, seq: _Sequence) -> None:
        """Give a leaving sequence's pool slots back (its target cache's and its drafter cache's)."""
        if self._pool is not None:
            self._pool.release(seq.cache)
        seq.proposer.close()

    def _draft_cache(self, drafter: Any) -> kv_cache.StaticCache:
        """A drafter cache for a sequence joining the batch: in a pooled batch a slot of that drafter's pool
        (made at its first sequence), so that a drafter call attends for all sequences at once
        (``pooled.pooled_drafter_forward``; on static shapes, ``pooled.DrafterGraphs``, where the target's pooled
        forward runs on them); else a cache of its own (never a drafter's shared static one:
        a graphed drafter's ``new_cache`` is one cache for one sequence at a time)."""
        if self._pool is None:
            return kv_cache.StaticCache(drafter.config.num_layers)
        if id(drafter) not in self._draft_pools:
            cfg = drafter.config
            pool = kv_cache.CachePool(cfg.num_layers, self.max_batch, cfg.num_key_value_heads, cfg.head_dim,
                                      drafter.dtype, drafter.device)
            if self._pool.graphs is not None:  # static shapes where the target's pooled forward has them
                pool.graphs = DrafterGraphs(drafter, pool, capture=self._pool.graphs.capture)
            self._draft_pools[id(drafter)] = drafter, pool
        return self._draft_pools[id(drafter)][1].cache()

    @torch.inference_mode()
    def step(self) -> list[StepEvent]:
        """Admit queued requests into free places, in order, as long as their prompts hold at most
        ``PREFILL_ROWS`` tokens in all (one at least), prefilled together (``_prefill``), then run
        one round for every running sequence. Returns one event per running sequence (none
        when nothing runs)."""
        admitted, rows = [], 0
        while self._queue and len(self._active) + len(admitted) < self.max_batch:
            seq = next(iter(self._queue.values()))
            rows += len(seq.ids) - 1
            if admitted and rows > PREFILL_ROWS:
                break
            admitted.append(self._queue.popitem(last=False)[1])
        if admitted:
            self._prefill(admitted)
            self._active.update((seq.request_id, seq) for seq in admitted)
        if not self._active:
            return []
        live = list(self._active.values())
        rounds = self._propose(live, self._tree_sizes(live))
        features = self._verify(rounds)
        return [self._finish_round(r, features[r.start:r.start + r.proposal.tree.size], choices)
                for r, choices in zip(rounds, self._greedy_choices(rounds, features))]

    # -- one round, in order ---------------------------------------------------------------------------

    def _prefill(self, seqs: list[_Sequence]) -> None:
        """Each sequence's cache filled with its prompt but the last token (the first tree's root). The
        prompts go through the target together, packed into one forward (``segment_forward``: each
        prompt at positions from 0, attending to itself only), where the lean forward runs; else
        one forward each. A drafter only keeps the prompt's features (``Proposer.start``): it is
        prefilled when its sequence first drafts."""
        target = self.target
        for seq in seqs:
            seq.cache = (self._pool.cache() if self._pool is not None else target.lean.new_cache()
                         if target.lean is not None else kv_cache.new_cache(target.model))
        features: dict[int, torch.Tensor] = {}
        todo = [i for i, seq in enumerate(seqs) if len(seq.ids) > 1]
        if len(todo) > 1 and runs_segments(target.lean, self._pool is not None):
            aux = next((seqs[i].proposer.aux_layers for i in todo if seqs[i].proposer.aux_layers), ())
            sizes = [len(seqs[i].ids) - 1 for i in todo]
            tokens = torch.tensor([t for i in todo for t in seqs[i].ids[:-1]], device=target.device)
            positions = torch.cat([torch.arange(n, device=target.device) for n in sizes])
            out = segment_forward(target.lean, tokens, positions, [seqs[i].cache for i in todo], sizes,
                                  [None] * len(todo), aux)
            features.update(zip(todo, out.split(sizes)))
        else:
            for i in todo:
                ids = seqs[i].ids
                features[i] = target.forward(torch.tensor([ids[:-1]], device=target.device),
                                             torch.arange(len(ids) - 1, device=target.device)[None], seqs[i].cache,
                                             logits_from=len(ids) - 1,
                                             aux_layers=seqs[i].proposer.aux_layers).features[0]
        for i, seq in enumerate(seqs):
            seq.proposer.start(seq.ids, features.get(i) if seq.proposer.needs_features else None)

    def _tree_sizes(self, live: list[_Sequence]) -> list[int]:
        """Each sequence's most tree nodes this round (``batch_tree_sizes``; without ``load_sizing``
        as many as its method allows). A seeded sampled sequence always gets its method's whole tree
        (``fixed`` for ``batch_tree_sizes``, so the others' rows are sized around it): its draws
        then do not depend on the load, so it repeats what it gives alone."""
        if not self.load_sizing:
            return [self.target.max_context] * len(live)
        max_context = self.target.max_context
        gains = [self._rates[s.options.method].gains(self._most_nodes(s) - 1)
                 if s.room(max_context) > 1 else [] for s in live]  # room for one token: no draft
        fixed = [(self._most_nodes(s) if s.room(max_context) > 1 else 1)
                 if s.options.seed is not None and s.options.temperature > 0 else None for s in live]
        rows = len(live) + sum(len(g) for g in gains)
        if len(self._seconds) < rows and not self._fixed_seconds:
            curve = cost_curve(self.target, greedy=True)
            self._seconds = [curve.at(n) for n in range(1, max(rows, 2 * len(self._seconds)) + 1)]
        groups = [s.options.method if grows_together(s.proposer) else None for s in live]  # trees grown together
        return batch_tree_sizes(self._seconds, gains,
                                [self._draft_seconds.get(s.options.method, 0.0) for s in live], fixed, groups,
                                self._phase_seconds)

    def _most_nodes(self, seq: _Sequence) -> int:
        """The largest tree (root included) the sequence's method proposes."""
        method, model = seq.options.method, seq.model
        if method == "ar":
            return 1
        if method == "pld":
            return model.prompt_lookup.num_draft_tokens + 1
        if method == "sd":
            return seq.proposer.gamma + 1
        total = model._method_tree(method).total_tokens
        return total if isinstance(total, int) else self.max_tree

    def _propose(self, live: list[_Sequence], sizes: list[int]) -> list[_Round]:
        """Each sequence's draft tree (at most ``sizes`` nodes, no deeper than its room), all drafted
        together (``draft_steps.run_together``: a drafter call's rows of every sequence at once); before
        that, drafters that draft for the first time are prefilled together (not a round's drafting time).
        Each method's drafting time is updated from its sequences that drafted (each one's own work and
        its share of the calls it joined), or fades once (``DRAFT_FADE``) when none did."""
        max_context = self.target.max_context
        pasts = [len(seq.ids) - 1 for seq in live]
        rooms = [seq.room(max_context) for seq in live]
        nodes = [min(size, max_context - past) for size, past in zip(sizes, pasts)]
        run_together([seq.proposer.preparing() for seq, size, room in zip(live, sizes, rooms) if size > 1 and room > 1])
        # greedy trees of pooled drafters grow together on the device (``batch_trees``); the rest one by one
        grouped = defaultdict(list)
        for i, (seq, n, room) in enumerate(zip(live, nodes, rooms)):
            if n > 1 and room > 1 and grows_together(seq.proposer):
                grouped[(id(seq.proposer.drafter), seq.proposer.cfg)].append(i)
        together = {i for group in grouped.values() for i in group}
        proposals, seconds = run_together([
            seq.proposer.catching_up() if i in together else
            seq.proposer.drafting(seq.ids, max_depth=room - 1, max_nodes=n)
            for i, (seq, n, room) in enumerate(zip(live, nodes, rooms))])
        phased = set()
        for group in grouped.values():
            made = draft_together([live[i].proposer for i in group], [live[i].ids for i in group],
                                  [rooms[i] - 1 for i in group], [nodes[i] for i in group])
            for i, proposal in zip(group, made.proposals):
                proposals[i] = proposal
                seconds[i] += made.host_seconds  # its own share; the phase is the group's, paid once a round
            if made.phase_seconds:
                method = live[group[0]].options.method
                before = self._phase_seconds.get(method)
                self._phase_seconds[method] = (made.phase_seconds if before is None else
                                               before + AVERAGING * (made.phase_seconds - before))
                phased.add(method)
        for method in set(self._phase_seconds) - phased:  # fades as a sequence's drafting time does
            self._phase_seconds[method] *= DRAFT_FADE
        rounds, start, drafted = [], 0, set()
        for seq, proposal, spent, past in zip(live, proposals, seconds, pasts):
            method = seq.options.method
            if proposal.tree.size > 1:  # what drafting costs this method, for sizing the next rounds
                before = self._draft_seconds.get(method)
                self._draft_seconds[method] = spent if before is None else before + AVERAGING * (spent - before)
                drafted.add(method)
            rounds.append(_Round(seq, proposal, proposal.tree, None, past, start))
            start += proposal.tree.size
        for method in {seq.options.method for seq in live} - drafted:  # the estimate fades: a slow spell is retried
            if method in self._draft_seconds:
                self._draft_seconds[method] *= DRAFT_FADE
        for r, host in zip(rounds, on_host([r.proposal.tree for r in rounds])):
            r.host, r.attn = host, tree_attention(host.parents)
        return rounds

    def _verify(self, rounds: list[_Round]) -> torch.Tensor:
        """ONE target forward over every tree -> the features at every node [R, (1 + n) H], the
        trees one after another (``segment_forward``). One sequence takes the target's own forward
        (on a CPU one compiled call for the whole stack), as does each sequence of a target whose lean
        forward cannot run several (``runs_segments``)."""
        target = self.target
        aux = next((r.seq.proposer.aux_layers for r in rounds if r.seq.proposer.aux_layers), ())
        together = len(rounds) > 1 and runs_segments(target.lean, self._pool is not None) and all(
            isinstance(r.seq.cache, kv_cache.StaticCache) for r in rounds)
        # a pooled forward reads each tree's own ancestors alone (each sequence sees its whole cache): its bool
        # mask on the host (all trees' copied at once); else the whole additive mask, on the device
        short = together and self._pool is not None
        masks = [None if r.proposal.tree.size < 2 else r.attn.mask if short
                 else attention_bias(r.attn.mask, r.past, target.dtype).to(target.device) for r in rounds]
        for r in rounds:
            r.seq.stats.tree_size = r.proposal.tree.size
            r.seq.stats.target_forwards += 1
        if together:
            tokens = torch.cat([r.host.tokens for r in rounds]).to(target.device)
            positions = torch.cat([r.past + r.attn.depths for r in rounds]).to(target.device)
            return segment_forward(target.lean, tokens, positions, [r.seq.cache for r in rounds],
                                   [r.proposal.tree.size for r in rounds], masks, aux)
        device = target.device
        outs = [target.forward(r.host.tokens[None].to(device), (r.past + r.attn.depths)[None].to(device),
                               r.seq.cache, None if mask is None else mask.to(device),
                               logits_from=r.proposal.tree.size, aux_layers=aux).features[0]
                for r, mask in zip(rounds, masks)]
        return torch.cat(outs)

    def _greedy_choices(self, rounds: list[_Round], features: torch.Tensor) -> list[torch.Tensor | None]:
        """The target's argmax at every node of each greedy sequence's tree (None for sampled ones),
        the head run over their rows together, at most ``STREAM_MAX_ROWS`` at a time (rows the
        streamed kernel computes get the bits one sequence decoded alone gets)."""
        greedy = [r for r in rounds if r.seq.sampling.greedy]
        if not greedy:
            return [None] * len(rounds)
        hidden = features[:, :self.target.hidden_size]
        rows = torch.cat([hidden[r.start:r.start + r.proposal.tree.size] for r in greedy])
        argmax = torch.cat([self.target.greedy_tokens(part) for part in rows.split(STREAM_MAX_ROWS)]).cpu()
        parts = iter(argmax.split([r.proposal.tree.size for r in greedy]))
        return [next(parts) if r.seq.sampling.greedy else None for r in rounds]

    def _finish_round(self, r: _Round, features: torch.Tensor, choices: torch.Tensor | None) -> StepEvent:
        """Acceptance, cache compaction and the proposer's update for one sequence -> its event."""
        seq, target = r.seq, self.target
        if choices is None:  # sampled: the target's distributions on the device, the proposal's tree with them
            logits, proposal = target.lm_head(features[:, :target.hidden_size]).float(), r.proposal
        else:  # greedy: the host's tree and argmaxes
            logits, proposal = None, dataclasses.replace(r.proposal, tree=r.host)
        tree = proposal.tree
        acc = accept_round(proposal, r.attn.paths, logits, choices, seq.sampling, seq.generator,
                           self.model.speculative.lenience)
        if tree.size > 1:
            drafts = set(acc.nodes[1:].tolist())
            self._rates[seq.options.method].record(tree.scores[1:].tolist(),
                                                   [i in drafts for i in range(1, tree.size)])
        chunk, stop = commit_round(target, seq.proposer, seq.cache, r.past, tree, acc,
                                   features if seq.proposer.needs_features else None, seq.ids,
                                   seq.room(target.max_context),
                                   len(seq.new), seq.options.max_new_tokens)
        seq.new.extend(chunk)
        if not stop and seq.options.stop and self._stopped(seq):
            stop = "stop"
        stats, now = seq.stats, time.perf_counter()
        stats.generated, stats.elapsed_s = len(seq.new), now - seq.added
        stats.accept_lengths.append(len(chunk))
        if stats.first_token_s is None:
            stats.first_token_s = now - seq.added
        event = StepEvent(seq.request_id, chunk, bool(stop), stats, stop)
        if stop:
            del self._active[seq.request_id]
            seq.proposer.finish(seq.ids)
            self._free(seq)
            text = target.tokenizer.decode(seq.new, skip_special_tokens=True)
            event.result = GenerationResult(
                text=text[:seq.text_cut] if seq.text_cut >= 0 else text, token_ids=list(seq.new),
                accept_lengths=list(stats.accept_lengths), target_forwards=stats.target_forwards,
                elapsed_s=stats.elapsed_s, method=seq.options.method, prompt_tokens=stats.prompt_tokens,
                stop_reason=stop, accepted_by_source=seq.proposer.accepted_by_source())
        return event

    def _stopped(self, seq: _Sequence) -> bool:
        """Whether the decoded text now holds one of the request's stop strings (``text_cut``: where)."""
        text = self.target.tokenizer.decode(seq.new, skip_special_tokens=True)
        start = max(0, seq.text_checked - max(len(s) for s in seq.options.stop) + 1)
        found = [i for i in (text.find(s, start) for s in seq.options.stop) if i >= 0]
        seq.text_checked = len(text)
        if found:
            seq.text_cut = min(found)
        return bool(found)


def generate_together(engine: ServingEngine, prompts: Sequence[Any],
                      options: RequestOptions | Sequence[RequestOptions] | None = None) -> list[GenerationResult]:
    """Decode ``prompts`` through ``engine`` until all are done -> their results, in order
    (``options``: one for all or one per prompt)."""
    each = list(options) if isinstance(options, Sequence) else [options] * len(prompts)
    for i, (prompt, opts) in enumerate(zip(prompts, each)):
        engine.add(("generate_together", i), prompt, opts)
    results: dict[Hashable, GenerationResult] = {}
    while engine.active or engine.queued:
        for event in engine.step():
            if event.finished:
                results[event.request_id] = event.result
    return [results[("generate_together", i)] for i in range(len(prompts))]
