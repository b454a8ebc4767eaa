"""Draft proposers behind one interface: each proposes a ``DraftTree`` rooted at the last
context token and is told what the target accepted.

- ``NoDraft`` (``ar``): the root alone; plain decoding through the same loop.
- ``PromptLookup`` (``pld``): an n-gram match in the context proposes a chain.
- ``DraftModel`` (``sd``): a separate small LM samples a chain (with its distributions q).
- ``EagleDrafter`` (``eagle-tree``, ``eagle-chain``): the feature-level drafter grows an
  EAGLE-2 dynamic tree (a chain is the top_k = 1 case); with ``lookup_tokens`` prompt-lookup
  chains are grafted onto it, so text copied from the context is verified in the same forward;
  with ``suffix`` (``SuffixDrafts``) suffix drafts are grafted onto it too.
- ``SuffixLookup`` (``suffix``): continuations of the context's longest suffix in the request,
  earlier outputs and a corpus (``eagle.drafting.suffix``), as a tree scored by their frequencies."""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from array import array
from typing import Callable, Generator

import torch

from eagle.runtime import kv_cache
from eagle.decoding.tree_sizing import CostCurve, Sizing, choose_tree_size, expansion_floor
from eagle.config import PromptLookupConfig, SamplingConfig, SpeculativeConfig, TreeConfig
from eagle.drafting.drafter import LeanDrafter
from eagle.drafting.token_frequencies import DraftVocab
from eagle.drafting.suffix import SuffixIndex, SuffixStore, new_index
from eagle.errors import EagleError
from eagle.decoding.draft_steps import DraftStep, StepResult, run_alone
from eagle.decoding.sampling import logits_to_probs, sample
from eagle.runtime.target import Target
from eagle.decoding.tree import (DraftTree, Pool, best_frontier, chain_tree, drawn_children, graft_chains, graft_tree,
                                 growing, kept_indices, ranked, root_only, static_layout)


@dataclasses.dataclass
class DrawDistributions:
    """What each tree node's drawn children were drawn from, row by row when asked (a round's
    acceptance reads only the rows along its accepted path). ``logprobs``: tree node -> (the draft
    indices [M] its children were drawn among, the drafter's log-probabilities there [M]);
    ``draft_ids`` [V_draft] the target token id of each draft index. ``support(i)`` -> (target
    token ids [M], float64 softmax(logprobs / temperature) [M]); ``self[i]`` -> [vocab_size]
    float64, those probabilities at those tokens and zeros elsewhere (all zeros for a node with
    no drawn children), as a dense [N, V] tensor's row i would be."""

    logprobs: dict[int, tuple[torch.Tensor, torch.Tensor]]
    draft_ids: torch.Tensor
    vocab_size: int
    temperature: float

    def support(self, node: int) -> tuple[torch.Tensor, torch.Tensor]:
        indices, logprobs = self.logprobs[node]
        return self.draft_ids[indices], torch.softmax(logprobs.double() / self.temperature, dim=-1)

    def __getitem__(self, node: int) -> torch.Tensor:
        row = torch.zeros(self.vocab_size, dtype=torch.float64, device=self.draft_ids.device)
        if node in self.logprobs:
            ids, probs = self.support(node)
            row[ids] = probs
        return row


@dataclasses.dataclass
class Proposal:
    """A draft tree, plus ``draft_probs`` [K, V] for sampled chains (``sd``), or for a tree some
    of whose children were drawn without replacement: ``child_probs`` (row i: what node i's
    drawn children were drawn from; a [N, V] tensor or ``DrawDistributions``) and ``drawn`` [N]
    bool (which nodes were drawn; the others are deterministic drafts); None for drafts that are
    not samples."""

    tree: DraftTree
    draft_probs: torch.Tensor | None = None
    child_probs: torch.Tensor | DrawDistributions | None = None
    drawn: torch.Tensor | None = None


def catch_up_share(fed: int, last_round: int) -> float:
    """The share of a drafter call feeding ``fed`` tokens that fed the prompt and rounds that did not draft
    (all but the last round's ``last_round`` tokens): a cost of resuming drafting, not of this round
    (``DraftGate`` judges rounds without it)."""
    return 1 - min(last_round, fed) / fed


class Proposer:
    """Interface. ``start`` after the prefill, ``propose`` each round, ``commit`` after acceptance.

    ``ids``: the whole context (prompt + generated); its last token is the tree root, not yet
    in the target's cache. ``features``: the target's last hidden states [n, H] for the
    tokens the target just processed (the prefix on ``start``, the accepted path on ``commit``),
    followed by the outputs of the target layers ``aux_layers`` ([n, (1 + len(aux_layers)) H])."""

    needs_features = False
    aux_layers: tuple[int, ...] = ()
    sizing: Sizing | None = None  # what sizing by cost learns ("auto"), whose ``gate`` says whether a round drafts
    skipped_seconds = 0.0  # what the last ``propose`` spent catching up on rounds it did not draft (the gate's)

    def start(self, ids: list[int], features: torch.Tensor | None) -> None:
        """Called once the target has prefilled ``ids[:-1]``."""

    def prepare(self) -> None:
        """Do now the one-time work ``start`` deferred (a drafter's prefill of the prompt), so that the
        next ``propose`` takes only what that round costs. Optional: ``propose`` does it when needed."""

    def propose(self, ids: list[int], max_depth: int, max_nodes: int) -> Proposal:
        raise NotImplementedError

    def preparing(self) -> Generator[DraftStep, StepResult, None]:
        """``prepare`` as a generator of drafter steps, so that many sequences' prefills run together
        (``draft_steps.run_together``); a proposer without a feature drafter yields none."""
        self.prepare()
        return
        yield  # unreachable: makes this a generator

    def drafting(self, ids: list[int], max_depth: int, max_nodes: int) -> Generator[DraftStep, StepResult, Proposal]:
        """``propose`` as a generator of drafter steps returning the proposal, so that many sequences
        draft together (``draft_steps.run_together``); a proposer without a feature drafter yields none."""
        return self.propose(ids, max_depth, max_nodes)
        yield  # unreachable: makes this a generator

    def close(self) -> None:
        """Give back what the proposer holds beyond itself (a pooled cache's slot); ``start`` begins anew."""

    def commit(self, ids: list[int], path: list[int], features: torch.Tensor | None) -> None:
        """``ids`` now ends with the accepted drafts and the new root; ``path``: the accepted drafts'
        nodes in the proposed tree, from the root's child down (so ``len(path)`` drafts were kept)."""

    def finish(self, ids: list[int]) -> None:
        """The generation ended with ``ids`` (prompt and output): suffix drafts keep the output."""

    def accepted_by_source(self) -> dict[str, int]:
        """Accepted draft tokens so far by where they were drafted from (a tree node proposed by two
        sources counts for the one that scored it higher); empty for a proposer with one source."""
        return {}


class NoDraft(Proposer):
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def propose(self, ids: list[int], max_depth: int, max_nodes: int) -> Proposal:
        return Proposal(root_only(ids[-1], self.device))


@dataclasses.dataclass
class LookupMatch:
    """``tokens``: the proposed continuation (empty when nothing matched); ``ngram``: the length
    of the matched suffix (0 when nothing matched)."""

    tokens: list[int]
    ngram: int


def prompt_lookup(ids: list[int], cfg: PromptLookupConfig, limit: int) -> LookupMatch:
    """The tokens that followed the most recent earlier occurrence of the context's last n-gram
    (longest n first), at most ``limit`` of them (none when ``limit`` < 1)."""
    return lookup_words(array("i", ids).tobytes(), cfg, limit)


def lookup_words(data: bytes, cfg: PromptLookupConfig, limit: int) -> LookupMatch:
    """``prompt_lookup`` of the ids in ``data``, 4-byte words (``array("i", ids).tobytes()``; a
    tree round looks up several paths below one context, whose words it converts once), searched
    with ``bytes.rfind`` (a hit counts only at a word boundary): a Python scan took about 80 us a
    call."""
    length = len(data) // 4
    if limit < 1:
        return LookupMatch([], 0)
    for n in range(cfg.max_ngram, cfg.min_ngram - 1, -1):
        if length <= n:
            continue
        tail, end = data[-4 * n:], 4 * (length - 1)  # a match ends before the last token
        while (at := data.rfind(tail, 0, end)) >= 0:
            if at % 4 == 0:
                first = at + 4 * n
                return LookupMatch(array("i", data[first:first + 4 * limit]).tolist(), n)
            end = at + 4 * n - 1  # misaligned: search again for a match starting before it
    return LookupMatch([], 0)


class LookupRates:
    """How often the target agrees with prompt-lookup drafts, counted on what it really produced
    (so the estimate depends on past output only, which keeps decoding lossless): the first draft
    token after an n-gram match, per n, and each later token once the one before it agreed.
    Beta(1, 1) priors."""

    def __init__(self, max_ngram: int) -> None:
        self.first = [[1.0, 2.0] for _ in range(max_ngram + 1)]  # per n: [agreed + 1, tried + 2]
        self.later = [1.0, 2.0]

    def scores(self, match: LookupMatch) -> list[float]:
        """Cumulative log-probabilities [len(match.tokens)] for the tree's scoring."""
        hits, tries = self.first[match.ngram]
        first, later = math.log(hits / tries), math.log(self.later[0] / self.later[1])
        return [first + later * i for i in range(len(match.tokens))]

    def update(self, match: LookupMatch, produced: list[int]) -> None:
        """``produced``: the tokens the target emitted after the root this round (accepted drafts
        and the next token); draft i is judged only if drafts before it agreed."""
        for i, (draft, token) in enumerate(zip(match.tokens, produced)):
            count = self.first[match.ngram] if i == 0 else self.later
            count[0] += draft == token
            count[1] += 1
            if draft != token:
                return


class PromptLookup(Proposer):
    """Prompt lookup decoding: the tokens that followed the most recent earlier occurrence of the context's
    last n-gram. With ``sizing`` (``PromptLookupConfig.auto_length``), only as many of them as pay for the
    rows they add: the chain length with the most expected tokens per second (``choose_tree_size``), each
    draft as likely as the target's agreement with such drafts so far (``LookupRates``: past output only,
    so decoding stays lossless) and each length as dear as a round of it has cost (``Sizing``)."""

    def __init__(self, cfg: PromptLookupConfig, device: torch.device, sizing: Sizing | None = None) -> None:
        self.cfg, self.device, self.sizing = cfg, device, sizing
        self.rates = LookupRates(cfg.max_ngram)
        self.match: LookupMatch | None = None
        self.proposed: tuple[int, float] | None = None  # (chain size, when proposed), for ``sizing``

    def propose(self, ids: list[int], max_depth: int, max_nodes: int) -> Proposal:
        limit = min(self.cfg.num_draft_tokens, max_depth, max_nodes - 1)
        self.match = prompt_lookup(ids, self.cfg, limit)
        draft = self.match.tokens
        if self.sizing is not None and draft:
            draft = draft[:choose_tree_size(self.rates.scores(self.match), self.sizing.costs, 0.0).size - 1]
        self.proposed = (len(draft) + 1, time.perf_counter())
        return Proposal(chain_tree(ids[-1], torch.tensor(draft, dtype=torch.long, device=self.device)))

    def commit(self, ids: list[int], path: list[int], features: torch.Tensor | None) -> None:
        if self.sizing is not None and self.proposed is not None:
            size, made = self.proposed
            self.sizing.record_round(size, time.perf_counter() - made)
        if self.match is not None and self.match.tokens:  # every draft the target's output can judge, verified or not
            self.rates.update(self.match, ids[len(ids) - len(path) - 1:])


class DraftModel(Proposer):
    """A separate small causal LM (same tokenizer) drafting ``gamma`` tokens autoregressively,
    with its own cache rolled back to the accepted prefix after each round. ``model``: the draft's
    forward, as a ``Target`` offers it (``new_cache()``, ``forward(input_ids, position_ids, cache,
    logits_from=...)``, ``greedy_tokens(hidden)``, ``device``): a model spec loaded by ``load_target`` (its
    lean forward, codes kept), or a transformers module wrapped as one (``eagle.engine.module_draft``).

    With ``suffix`` (``SuffixDrafts``) the chain starts with the most likely suffix continuation, token
    by token as long as each is more likely right than the draft model's own guess there (one scale:
    the suffix token's frequency after the chain so far against the draft's probability of its most
    likely token, which one forward over the continuation gives at every position); the draft model
    then continues to ``gamma`` tokens. Suffix tokens are point-mass drafts, the draft model's are judged
    by the q they were drawn from, and which one a position takes depends on the context and q, never
    on a draw: sampling stays exact. With ``sizing``, its ``gate`` stops drafting while drafting rounds
    give fewer tokens a second than plain ones (a draft model whose steps cost too much for what is
    accepted); the draft catches up on the skipped tokens when it drafts again. With ``vocab``
    (``DraftVocab``), the draft's head computes only its tokens' logits (``eagle.drafting.token_frequencies``): its
    distributions are zero elsewhere, and the target judges its tokens as any others. A chain ends after a token
    the draft gives less than ``cfg.draft_confidence`` (its own probability: the draft alone decides the length)."""

    def __init__(self, model: Target, cfg: SpeculativeConfig, sampling: SamplingConfig,
                 generator: torch.Generator, suffix: "SuffixDrafts | None" = None,
                 sizing: Sizing | None = None, vocab: DraftVocab | None = None) -> None:
        self.model, self.cfg, self.sampling, self.generator = model, cfg, sampling, generator
        self.sizing = sizing
        self.vocab = None if vocab is None else vocab.ids
        self.head = None if vocab is None else vocab.head
        self.last_round = 0  # tokens the last round added after drafting (0: it did not draft)
        self.cache = model.new_cache()
        self.gamma = cfg.gamma
        self.drafted = 0
        self.device = model.device
        self.suffix = suffix

    def start(self, ids: list[int], features: torch.Tensor | None) -> None:
        if self.suffix is not None:
            self.suffix.start(ids)

    @torch.inference_mode()
    def _step(self, tokens: list[int], rows: int = 0) -> "torch.Tensor | tuple[int, float]":
        """Feed ``tokens`` after the cached ones. ``rows`` 0: greedy, the next token and the draft's probability
        of it (1.0 where ``draft_confidence`` does not ask: the argmax alone, its logits not all made where its
        forward screens them); sampling, its probabilities q [V]. ``rows`` > 0: the draft's logits [rows, V]
        after each of the last ``rows`` tokens."""
        past = kv_cache.cache_length(self.cache)
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        pos = torch.arange(past, past + len(tokens), device=self.device)[None]
        greedy = self.sampling.greedy and not rows
        if self.head is not None:  # the draft vocabulary's logits only
            out = self.model.forward(ids, pos, self.cache, logits_from=len(tokens))
            logits = self.head(out.hidden[0, -(rows or 1):]).float()
            if greedy:
                best = logits[0].argmax()
                sure = float(torch.softmax(logits[0], -1)[best]) if self.cfg.draft_confidence else 1.0
                return int(self.vocab[best]), sure
            if rows:
                return logits.new_full((rows, self.model.vocab_size), -torch.inf).index_copy_(1, self.vocab, logits)
            q = logits_to_probs(logits[0], self.sampling)
            return q.new_zeros(self.model.vocab_size).index_copy_(0, self.vocab, q)
        scored = greedy and self.cfg.draft_confidence > 0  # the argmax's probability too: all its logits
        out = self.model.forward(ids, pos, self.cache,
                                 logits_from=len(tokens) - (rows or (0 if greedy and not scored else 1)))
        if rows:
            return out.logits[0]
        if scored:
            probs = torch.softmax(out.logits[0, -1], -1)
            best = probs.argmax()
            return int(best), float(probs[best])
        if greedy:
            return int(self.model.greedy_tokens(out.hidden[0, -1:])[0]), 1.0
        return logits_to_probs(out.logits[0, -1], self.sampling)

    def _suffix_start(self, ids: list[int], pending: list[int],
                      limit: int) -> "tuple[list[int], list[str], torch.Tensor | tuple[int, float] | None]":
        """The suffix tokens the chain starts with (at most ``limit``), their sources, and the draft's next
        step after them, as ``_step`` gives it (None: not computed)."""
        tokens, scores, sources = self.suffix.best_chain(ids, limit)
        if not tokens:
            return [], [], None
        past = kv_cache.cache_length(self.cache)
        logits = self._step(pending + tokens, len(tokens) + 1)  # after the root, then after each suffix token
        probs = torch.softmax(logits.float(), -1) if self.sampling.greedy else logits_to_probs(logits, self.sampling)
        best, guess = probs.max(-1)
        taken, labels, above = 0, [], 0.0
        for token, score, source, q, g in zip(tokens, scores, sources, best.tolist(), guess.tolist()):
            frequency = math.exp(score - above)  # the suffix token's, given the chain so far
            if token != g and frequency <= q:
                break
            labels.append(source if frequency > q else "drafter")  # both propose it: the higher scores it
            taken, above = taken + 1, score
        kv_cache.roll_back(self.cache, past + len(pending) + taken)
        if self.sampling.greedy:
            return tokens[:taken], labels, (int(guess[taken]), float(best[taken]))
        return tokens[:taken], labels, probs[taken]

    def propose(self, ids: list[int], max_depth: int, max_nodes: int) -> Proposal:
        k = self.drafted = min(self.gamma, max_depth, max_nodes - 1)
        self.skipped_seconds = 0.0
        if k <= 0:
            return Proposal(root_only(ids[-1], self.device))
        pending = ids[kv_cache.cache_length(self.cache):]
        skipped = catch_up_share(len(pending), self.last_round)
        drafts, labels, ahead = [], [], None
        if self.suffix is not None:
            drafts, labels, ahead = self._suffix_start(ids, pending, min(max_depth, max_nodes - 1))
        probs: list[torch.Tensor | None] = [None] * len(drafts)
        while len(drafts) < k:
            began = time.perf_counter()
            step = self._step(pending) if ahead is None else ahead
            if not drafts and ahead is None and skipped:
                self.skipped_seconds = (time.perf_counter() - began) * skipped
            if self.sampling.greedy:  # greedy acceptance reads the tokens alone
                token, sure = step
            else:
                token = int(sample(step, self.generator))
                sure = float(step[token])
                probs.append(step)
            drafts.append(token)
            labels.append("drafter")
            pending, ahead = [token], None
            if sure < self.cfg.draft_confidence:
                break  # the draft doubts this token: the next would be accepted still less often
        self.drafted = len(drafts)
        tree = chain_tree(ids[-1], torch.tensor(drafts, dtype=torch.long, device=self.device))
        if self.suffix is not None:
            self.suffix.proposed(tree.tokens.tolist(), tree.parents.tolist(), [""] + labels)
        if self.sampling.greedy:
            return Proposal(tree)
        if all(q is not None for q in probs):
            return Proposal(tree, draft_probs=torch.stack(probs))
        if all(q is None for q in probs):
            return Proposal(tree)
        # suffix tokens first: point masses; the drawn ones after them, judged by their q
        rows = torch.zeros(tree.size, next(q.shape[-1] for q in probs if q is not None), device=self.device)
        for i, q in enumerate(probs):
            if q is not None:
                rows[i] = q
        drawn = torch.tensor([False] + [q is not None for q in probs], device=self.device)
        return Proposal(tree, child_probs=rows, drawn=drawn)

    def commit(self, ids: list[int], path: list[int], features: torch.Tensor | None) -> None:
        accepted = len(path)
        self.last_round = accepted + 1 if self.drafted else 0
        kv_cache.roll_back(self.cache, len(ids) - 1)  # keep entries of accepted tokens; the new root is pending
        if self.suffix is not None:
            self.suffix.commit(ids, path)
        if self.cfg.adaptive_gamma and self.drafted:  # grow when all drafts were accepted, shrink on an early rejection
            if accepted >= self.drafted:
                self.gamma = min(self.gamma + 2, self.cfg.max_gamma)
            elif accepted < self.drafted // 2:
                self.gamma = max(1, self.gamma - 1)

    def finish(self, ids: list[int]) -> None:
        if self.suffix is not None:
            self.suffix.finish(ids)

    def accepted_by_source(self) -> dict[str, int]:
        return dict(self.suffix.accepted) if self.suffix is not None else {}


LOOKUP_NODES = 3  # draft nodes (besides the root) whose paths are looked up in the context too


class EagleDrafter(Proposer):
    """EAGLE-2 dynamic tree from the feature-level drafter; ``top_k = 1`` gives a chain. With
    ``cfg.lookup_tokens`` > 0 prompt-lookup chains join the candidate pool (``graft_lookup``),
    scored by how often the target has agreed with such drafts so far (``LookupRates``), and
    compete with the drafter's nodes for the ``total_tokens`` slots."""

    needs_features = True

    def __init__(self, drafter: LeanDrafter, target: Target, cfg: TreeConfig, cost: CostCurve | None = None,
                 lookup: PromptLookupConfig | None = None, sampling: SamplingConfig | None = None,
                 generator: torch.Generator | None = None, sizing: Sizing | None = None,
                 new_cache: Callable[[], kv_cache.StaticCache] | None = None, host_trees: bool = False,
                 suffix: "SuffixDrafts | None" = None) -> None:
        """``drafter``: the inference copy (its ``dtype`` is what it is fed the target's features
        and embeddings in); ``total_tokens`` "auto" sizes by ``sizing`` (what it learns as it
        decodes, updated in place, so that one kept across generations carries it) or, without one,
        by a new ``Sizing`` of ``cost``, the target's measured forward-time curve;
        ``lookup``: the n-gram sizes for ``cfg.lookup_tokens``;
        ``sampling``/``generator``: with temperature > 0 and ``cfg.sampled_tree`` (dynamic tree) the
        children are drawn from the drafter (``tree.drawn_children``) with ``generator``; ``new_cache``: where
        ``start`` takes the drafter's cache from (default: a cache of its own; ``ServingEngine``: a slot
        of a pool, given back by ``close``); ``host_trees``: greedy trees made on the host (from the
        host values they are drafted as), for a caller that moves a round's trees to the device at once;
        ``suffix``: suffix drafts grafted onto each tree (``graft_suffix``)."""
        vocab = drafter.config.draft_vocab_size or drafter.config.vocab_size
        widest = max((r + 1 for c in cfg.choices or () for r in c), default=cfg.top_k)
        if max(cfg.top_k, widest) > vocab:
            raise EagleError(f"tree top_k / choice rank {max(cfg.top_k, widest)} exceeds the drafter's vocabulary ({vocab})")
        self.drafter, self.target, self.cfg = drafter, target, cfg
        self.suffix, self.kept = suffix, []  # kept: the pool nodes of the last tree, by tree node
        self.sources: list[str] = []  # each node's source in the last pool (``graft_lookup``), the root's ""
        self.dtype = drafter.dtype
        self.aux_layers = tuple(drafter.config.aux_layers)
        self.new_cache = new_cache or drafter.new_cache
        self.cache: kv_cache.StaticCache | None = None  # from ``new_cache`` at ``start`` (a graphed drafter has one)
        self.last_hidden: torch.Tensor | None = None  # drafter's prediction of the root's feature [H]
        self.device = target.device
        self.lookup = lookup or PromptLookupConfig()
        self.lookup_rates = LookupRates(self.lookup.max_ngram)
        self.last_matches: list[tuple[list[int], LookupMatch]] = []  # (path below the root, its lookup)
        self.draw_temperature = 0.0  # what the children are drawn at; 0: the drafter's top_k instead
        if sampling is not None and not sampling.greedy and cfg.sampled_tree and not cfg.choices:
            self.draw_temperature = sampling.temperature * cfg.draw_temperature_scale
        self.generator = generator
        # where trees are made: drawn children's trees stay with their distributions, on the device
        self.tree_device = torch.device("cpu") if host_trees and not self.draw_temperature else self.device
        # pool node -> (the draft indices its children were drawn among, their log-probs)
        self.drawn_from: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.draft_ids = drafter.to_target_ids(torch.arange(vocab, device=self.device))  # draft index -> target id
        self.next_depth = cfg.levels  # a sampled tree's draft levels with "auto" (see ``_size_next_round``)
        self.sizing = sizing if sizing is not None or cost is None else Sizing(cost)  # None: a fixed total_tokens
        self.proposed: tuple[DraftTree, float] | None = None  # the last proposal's tree and when it was made
        # (features, tokens) of rounds accepted since the drafter last ran (``catching_up``), and of the
        # prompt until the drafter first runs (``start``)
        self.pending: list[tuple[torch.Tensor, list[int]]] = []
        self.prompt: tuple[torch.Tensor, list[int]] | None = None
        # a sampled tree's size with "auto", chosen before its draws (see ``propose``): at first the most
        # nodes that cost no more than one token to verify, then what the previous round's pool asked for
        costs = self.sizing.costs if self.sizing is not None else []
        self.next_size = max((n for n, c in enumerate(costs, start=1) if c <= 1.05 * costs[0]), default=0)

    def _feed(self, features: list[torch.Tensor], next_tokens: list[int]) -> Generator[DraftStep, StepResult, None]:
        """Feed pairs (f_t, x_{t+1}) for the new committed positions (``features``: their rows, in parts);
        keep the last prediction."""
        if not next_tokens:
            return
        past = kv_cache.cache_length(self.cache)
        out = yield DraftStep(self.drafter, self.target, self.cache, rows=features, tokens=next_tokens,
                              positions=range(past, past + len(next_tokens)), head=False)
        self.last_hidden = out.hidden[-1]

    def start(self, ids: list[int], features: torch.Tensor | None) -> None:
        """Keeps the prompt's features: the drafter is prefilled when it first drafts (``prepare`` or
        ``propose``), so a sequence that never drafts (a batch's root-only rounds) costs it nothing."""
        self.close()
        self.cache = self.new_cache()
        if self.suffix is not None:
            self.suffix.start(ids)
        self.last_hidden = None
        self.pending = []
        self.prompt = (features, ids[1:]) if features is not None and len(ids) > 1 else None

    def close(self) -> None:
        if isinstance(self.cache, kv_cache.SlotCache):
            self.cache.pool.release(self.cache)
            self.cache = None

    def prepare(self) -> None:
        run_alone(self.preparing())

    def preparing(self) -> Generator[DraftStep, StepResult, None]:
        if self.prompt is not None:
            (features, tokens), self.prompt = self.prompt, None
            yield from self._feed([features], tokens)

    def commit(self, ids: list[int], path: list[int], features: torch.Tensor | None) -> None:
        # features: target features of the root and the accepted drafts; tokens that follow them.
        produced = ids[len(ids) - len(path) - 1:]
        if self.sizing is not None and self.proposed is not None:  # what the round cost, which drafts paid off
            tree, made = self.proposed
            self.sizing.record_round(tree.size, time.perf_counter() - made)
            scores, kept = tree.scores.tolist(), set(path)
            ranked = best_frontier(scores[1:], len(scores) - 1)
            self.sizing.record_drafts([math.exp(scores[i + 1]) for i in ranked], [i + 1 in kept for i in ranked])
        for drafts, match in self.last_matches:  # judge each lookup whose node the target reached
            if produced[:len(drafts)] == drafts:
                self.lookup_rates.update(match, produced[len(drafts):])
        if self.suffix is not None:
            self.suffix.commit(ids, path, self.kept)
        self.pending.append((features, produced))  # fed to the drafter when it next drafts (``catching_up``)

    def catching_up(self) -> Generator[DraftStep, StepResult, None]:
        """Feed the drafter the prompt (if ``start`` kept it) and what was accepted since it last ran,
        in one call: ``commit`` defers it, so rounds that draft nothing (a batch's root-only rounds)
        cost the drafter nothing."""
        pending = ([self.prompt] if self.prompt is not None else []) + self.pending
        self.skipped_seconds = 0.0
        if pending:
            tokens = [t for _, produced in pending for t in produced]
            last = len(self.pending[-1][1]) if self.pending and self.prompt is None else 0  # the last round's
            self.prompt, self.pending, began = None, [], time.perf_counter()
            yield from self._feed([f for f, _ in pending], tokens)
            self.skipped_seconds = (time.perf_counter() - began) * catch_up_share(len(tokens), last)

    def propose(self, ids: list[int], max_depth: int, max_nodes: int) -> Proposal:
        return run_alone(self.drafting(ids, max_depth, max_nodes))

    def drafting(self, ids: list[int], max_depth: int, max_nodes: int) -> Generator[DraftStep, StepResult, Proposal]:
        self.skipped_seconds = 0.0
        if max_depth >= 1 and max_nodes >= 2:  # a round that may draft
            yield from self.catching_up()
        proposal = yield from self._propose(ids, max_depth, max_nodes)
        self.proposed = (proposal.tree, time.perf_counter())
        return proposal

    def _propose(self, ids: list[int], max_depth: int, max_nodes: int) -> Generator[DraftStep, StepResult, Proposal]:
        start = time.perf_counter()
        total = self.cfg.total_tokens if isinstance(self.cfg.total_tokens, int) else max_nodes
        total, levels = min(total, max_nodes), min(self.cfg.levels, max_depth)
        self.last_matches, self.drawn_from, self.kept = [], {}, [0]
        if self.last_hidden is None or levels < 1 or total < 2:
            return Proposal(root_only(ids[-1], self.tree_device))
        committed = kv_cache.cache_length(self.cache)
        calibration = self.sizing.calibration if self.sizing is not None else []
        if self.draw_temperature and self.sizing is not None:
            total, levels = max(2, min(total, self.next_size)), min(levels, self.next_depth)
        if self.cfg.choices:
            pool = yield from self._static(ids[-1], min(levels, max(len(c) for c in self.cfg.choices)), committed)
        else:
            select = functools.partial(self._to_expand, total=total, start=start, calibration=calibration)
            pool = yield from self._grow(ids[-1], self.cfg.top_k, levels - 1, committed, select)
        kv_cache.roll_back(self.cache, committed)
        drafted = pool.size  # pool nodes from the drafter; grafts come after them, so they are tried after their siblings
        pool = self.graft_lookup(ids, pool, max_depth)
        pool = self.graft_suffix(ids, pool, drafted, max_depth)
        if self.sizing is not None and not self.draw_temperature:  # "auto": the size with the most expected tokens/s
            best_first = sorted(pool.scores[1:], reverse=True)
            choice = choose_tree_size(best_first, self.sizing.costs, time.perf_counter() - start, calibration)
            total = min(total, choice.size)
        elif self.sizing is not None:  # drawn children: no size may depend on this round's draws, so they size the next
            self._size_next_round(pool, drafted, time.perf_counter() - start, calibration)
        kept = self.kept = kept_indices(pool.scores, total)
        tree = pool.subtree(kept).tree(self.tree_device)
        if not self.draw_temperature or tree.size < 2:
            return Proposal(tree)
        drawn_from = {row: self.drawn_from[node] for row, node in enumerate(kept) if node in self.drawn_from}
        return Proposal(tree, child_probs=DrawDistributions(drawn_from, self.draft_ids, self.target.vocab_size,
                                                            self.draw_temperature),
                        drawn=torch.tensor([0 < node < drafted for node in kept], device=self.tree_device))

    def _size_next_round(self, pool: Pool, drafted: int, elapsed: float, calibration: list[float]) -> None:
        """``next_size`` and ``next_depth`` (sampled "auto") from this round's pool, as if the next one
        drew the same: the size with the most expected tokens per second, a size paying a drafter
        call (``Sizing.step_seconds``) for each depth its nodes need past the first (grafted lookup nodes
        need their drafted ancestor's), and the depths those nodes need, one more where a deeper
        level would pay for its call (``expansion_floor``, as greedy "auto" decides each depth)."""
        parents, scores = pool.parents, pool.scores
        depths = [0]
        for node, parent in enumerate(parents[1:], start=1):
            depths.append(depths[parent] + (node < drafted))
        order = best_frontier(scores[1:], len(scores) - 1)
        calls = [max(1, depths[i + 1]) for i in order]
        step = self.sizing.step_seconds
        first_call = max(0.0, elapsed - step * (max(calls, default=1) - 1))
        ranked = [scores[i + 1] for i in order]
        self.next_size = choose_tree_size(ranked, self.sizing.costs, first_call, calibration, calls, step).size
        needed = max(calls[:self.next_size - 1], default=1)
        within = [score for score, c in zip(ranked, calls) if c <= needed]
        deepest = [score for score, c in zip(ranked, calls) if c == needed]
        floor = expansion_floor(within, deepest, self.sizing.costs, first_call + step * (needed - 1), step,
                                math.log(self.sizing.child_prob), calibration)
        self.next_depth = needed + (floor is not None)

    def _children(self, parent_scores: torch.Tensor, logprobs: torch.Tensor, k: int,
                  nodes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The k children of pool nodes ``nodes`` [F] drawn without replacement, among the drafter's
        ``draw_support`` most likely tokens (those and their log-probs are kept for ``DrawDistributions``);
        children by rank come from ``run_steps``."""
        width, support = logprobs.shape[-1], max(k, self.cfg.draw_support)
        support = support if self.cfg.draw_support and support < width else width
        uniform = torch.rand(logprobs.shape[0], support, generator=self.generator,
                             device=self.generator.device).to(logprobs.device)
        tokens, scores, among, among_lp = drawn_children(parent_scores, logprobs, k, self.draw_temperature, support,
                                                         uniform)
        self.drawn_from.update(zip(nodes, zip(among, among_lp)))
        return tokens, scores

    def graft_lookup(self, ids: list[int], pool: Pool, max_depth: int) -> Pool:
        """The pool with prompt-lookup continuations grafted on: of the context itself (at the
        root) and of the context followed by the path to each of the ``LOOKUP_NODES`` best draft
        nodes (a copied span often starts at a token the drafter guessed). In a sampled tree
        the chains are new nodes (``share=False``), after all drawn ones: a chain and its place
        depend only on nodes that outrank it and on its ancestors, so no drawn node's inclusion
        comes to depend on its own token, and siblings are tried in an order the rule allows.
        Sets ``sources``: "lookup" for the nodes a chain added or scored higher, else "drafter"."""
        self.sources = [""] + ["drafter"] * (pool.size - 1)
        if self.cfg.lookup_tokens < 1:
            return pool
        tokens, parents = pool.tokens, pool.parents
        best = best_frontier(pool.scores[1:], LOOKUP_NODES)
        context, chains = array("i", ids).tobytes(), []
        for node in [0] + [i + 1 for i in best]:
            path, i = [], node
            while i > 0:
                path.insert(0, tokens[i])
                i = parents[i]
            limit = min(self.cfg.lookup_tokens, max_depth - len(path))
            match = lookup_words(context + array("i", path).tobytes(), self.lookup, limit)
            if match.tokens:
                self.last_matches.append((path, match))
                chains.append((match.tokens, self.lookup_rates.scores(match), node))
        if not chains:
            return pool
        out = graft_chains(pool, chains, share=not self.draw_temperature)
        self.sources = [s if out.scores[i] <= pool.scores[i] else "lookup" for i, s in enumerate(self.sources)]
        self.sources += ["lookup"] * (out.size - pool.size)
        return out

    def graft_suffix(self, ids: list[int], pool: Pool, drafted: int, max_depth: int) -> Pool:
        """The pool with suffix drafts below its root (``SuffixDrafts.graft``), scored by their frequencies
        beside the drafter's path products. In a sampled tree they are new nodes after the drawn ones
        and the lookup chains (as ``graft_lookup``'s): they depend on the context alone."""
        if self.suffix is None:
            return pool
        return self.suffix.graft(ids, pool, max_depth, pool.size if self.draw_temperature else 0, self.sources)

    def finish(self, ids: list[int]) -> None:
        if self.suffix is not None:
            self.suffix.finish(ids, self.kept)

    def accepted_by_source(self) -> dict[str, int]:
        return dict(self.suffix.accepted) if self.suffix is not None else {}

    def _grow(self, root: int, k: int, calls: int, committed: int,
              select: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]) -> Generator[DraftStep, StepResult, Pool]:
        """The candidate pool grown by ``tree.growing`` (B = 1, on the host) from ``last_hidden``, each of its
        expansions one drafter step (the root's: the head alone); the nodes expanded after the root's are
        ``select``'s. With a ``sizing``, each call's seconds and each expanded node's best child are recorded."""
        run = growing(torch.tensor([root]), k, calls, select)
        node, prev = next(run), self.last_hidden[None]
        while True:
            began = time.perf_counter()
            f, parent_scores = node.nodes.shape[1], node.scores[0].tolist()
            if node.d == 0:
                out = yield DraftStep(self.drafter, self.target, hidden=prev, k=self._ranked_k(k),
                                      parent_scores=parent_scores)
            else:
                earlier = node.earlier[0, :, :node.written]
                chain = f == 1 and bool(earlier.all())  # a lone node below every row run so far: causal
                seen = None if chain else torch.cat([earlier, torch.eye(f, dtype=torch.bool)], 1)
                out = yield DraftStep(self.drafter, self.target, self.cache, rows=prev, pick=node.rows[0].tolist(),
                                      tokens=node.tokens[0].tolist(), positions=[committed + node.d - 1] * f,
                                      seen=seen, k=self._ranked_k(k), parent_scores=parent_scores)
            prev = out.hidden
            if out.child_tokens is not None:  # ranked by ``run_steps``
                child_tokens, child_scores = torch.tensor(out.child_tokens), torch.tensor(out.child_scores)
            else:
                child_tokens, child_scores = self._children(torch.tensor(parent_scores, device=self.device),
                                                            out.logprobs, k, node.nodes[0].tolist())
                child_tokens, child_scores = self.drafter.to_target_ids(child_tokens).cpu(), child_scores.cpu()
            if self.sizing is not None and node.d:  # this call's seconds, each expanded node's best child (first)
                best = child_scores.view(f, k)[:, 0].tolist()
                self.sizing.record_step(time.perf_counter() - began,
                                        [math.exp(c - p) for c, p in zip(best, parent_scores)])
            try:
                node = run.send((child_tokens.view(1, f, k), child_scores.view(1, f, k).float()))
            except StopIteration as stop:
                tokens, parents, scores = stop.value
                return Pool(tokens[0].tolist(), parents[0].tolist(), scores[0].tolist())

    def _ranked_k(self, k: int) -> int:
        """What a step asks ``run_steps`` for: ``k`` children by rank, or 0 (the log-probs alone) when they are drawn."""
        return 0 if self.draw_temperature else k

    def _to_expand(self, d: int, flat_scores: torch.Tensor, pool_scores: torch.Tensor, total: int, start: float,
                   calibration: list[float]) -> torch.Tensor:
        """EAGLE-2's ``select`` (``tree.growing``): of expansion ``d``'s k best children (``flat_scores`` [1, F k];
        ``pool_scores`` [1, M] the pool's, root first), those the next call expands. Sized ("auto", ranked
        children): those whose expected best child would be kept, if the call pays for itself
        (``expansion_floor``). Else those that could have a kept child: one among the best ``total - 2`` of
        the pool (a child scores no higher than its parent and ranks after it; the tree kept is the same,
        with fewer drafter rows). Never sized for drawn children: a stop chosen from a node's own draw
        would make whether it is kept depend on its token and bias it."""
        best = ranked(flat_scores, self.cfg.top_k)[0].tolist()
        flat, scores = flat_scores[0].tolist(), pool_scores[0].tolist()[1:]
        if self.sizing is not None and not self.draw_temperature:
            floor = expansion_floor(scores, [flat[j] for j in best], self.sizing.costs,
                                    time.perf_counter() - start, self.sizing.step_seconds,
                                    math.log(self.sizing.child_prob), calibration)
        else:
            rank = min(total - 2, len(scores))
            floor = sorted(scores, reverse=True)[rank - 1] if rank > 0 else None
        return torch.tensor([[j for j in best if floor is not None and flat[j] >= floor]], dtype=torch.long)

    def _static(self, root: int, levels: int, committed: int) -> Generator[DraftStep, StepResult, Pool]:
        """EAGLE-1: a fixed tree shape (``choices``) filled with the drafter's ranked children: ``tree.growing``
        with each layout node's rank among its parent's children, expanding the layout's nodes that have
        children; the pool cut to the layout's nodes."""
        layout = static_layout(self.cfg.choices)
        n = int((layout.depths <= levels).sum())  # breadth-first order: shallow nodes come first
        parents, ranks, depths = layout.parents[:n].tolist(), layout.ranks[:n].tolist(), layout.depths[:n].tolist()
        k = max(ranks) + 1
        has_children = {p for p in parents if p >= 0}
        column = {0: 0}  # layout node -> its column in its expansion's nodes
        place = [0] * n  # layout node -> its pool index
        width = [1]  # how many nodes the last expansion ran

        def placed(level: list[int], start: int) -> None:  # the pool index of each node of a level
            for i in level:
                place[i] = start + column[parents[i]] * k + ranks[i]

        def select(d: int, flat_scores: torch.Tensor, pool_scores: torch.Tensor) -> torch.Tensor:
            start = pool_scores.shape[1] - flat_scores.shape[1]
            level = [i for i in range(n) if depths[i] == d + 1]
            placed(level, start)
            grow = [i for i in level if i in has_children]
            column.update((i, c) for c, i in enumerate(grow))
            width[0] = len(grow)
            return torch.tensor([[place[i] - start for i in grow]], dtype=torch.long)

        pool = yield from self._grow(root, k, levels - 1, committed, select)
        placed([i for i in range(n) if depths[i] == levels], pool.size - width[0] * k)  # no select after the last
        return pool.subtree(place)


class SuffixDrafts:
    """Suffix drafts for one request at a time: the longest match of the context's suffix in the
    request itself (a ``SuffixIndex`` of prompt and output, fed as it grows), in earlier outputs and
    in a corpus (``store``), each a tree of continuations scored log(count / (occurrences + prior)),
    grafted below a pool's root (``graft``). ``finish`` adds the request's output to the store.
    Keeps which source proposed each node of the last tree, to count accepted tokens by source."""

    def __init__(self, store: SuffixStore, capacity: int) -> None:
        self.store, self.cfg, self.capacity = store, store.cfg, capacity
        self.request: SuffixIndex | None = None
        self.seen = self.prompt = 0
        self.labels: list[str] = []  # the source of each pool node of the last ``graft`` (others: "")
        self.pool_tokens: list[int] = []  # the last pool's tokens and parents
        self.pool_parents: list[int] = []
        self.accepted: dict[str, int] = {}

    def start(self, ids: list[int]) -> None:
        self.request = new_index(self.capacity, self.cfg)
        self.request.extend(ids)
        self.seen = self.prompt = len(ids)

    def commit(self, ids: list[int], path: list[int], kept: list[int] | None = None) -> None:
        """``path``: the accepted tree nodes (``kept``: the pool node of each tree node; None: the same)."""
        self._count([kept[node] if kept is not None else node for node in path])
        if self.request is not None:
            self.request.extend(ids[self.seen:])
            self.seen = len(ids)

    def finish(self, ids: list[int], kept: list[int] | None = None) -> None:
        """The generation ended with ``ids``: count the last round's accepted drafts (the loop commits no
        round that ends it: they are the path of the last tree, ``kept`` of the last pool, that the new
        tokens follow) and add the output to the store's history."""
        nodes = kept if kept is not None else range(len(self.pool_parents))
        at, path = 0, []
        for token in ids[self.seen:]:
            at = next((n for n in nodes if n and self.pool_parents[n] == at and self.pool_tokens[n] == token), None)
            if at is None:
                break
            path.append(at)
        self._count(path)
        if self.request is not None and len(ids) > self.prompt:
            self.store.history.add(ids[self.prompt:])
        self.request, self.labels, self.pool_tokens, self.pool_parents = None, [], [], []

    def _count(self, pool_nodes: list[int]) -> None:
        for node in pool_nodes:
            label = self.labels[node] if node < len(self.labels) else ""
            if label:
                self.accepted[label] = self.accepted.get(label, 0) + 1

    def best_chain(self, ids: list[int], depth: int) -> tuple[list[int], list[float], list[str]]:
        """The most likely path (the best-scored child at each node) of the sources' continuations of
        ``ids`` (``graft`` below a lone root), at most ``depth`` tokens: (tokens, cumulative log-scores,
        sources)."""
        pool = self.graft(ids, Pool([ids[-1]], [-1], [0.0]), depth)
        path, node = [], 0
        while True:
            children = [i for i in range(node + 1, pool.size) if pool.parents[i] == node]
            if not children:
                break
            node = max(children, key=pool.scores.__getitem__)  # the first on ties
            path.append(node)
        return [pool.tokens[n] for n in path], [pool.scores[n] for n in path], [self.labels[n] for n in path]

    def proposed(self, tokens: list[int], parents: list[int], labels: list[str]) -> None:
        """The tree a proposer made of its own (``labels``: each node's source, the root's ""), which
        ``commit`` and ``finish`` count accepted drafts by, tree nodes being its nodes (``kept`` None)."""
        self.pool_tokens, self.pool_parents, self.labels = tokens, parents, labels

    def graft(self, ids: list[int], pool: Pool, max_depth: int, share_from: int = 0,
              labels: list[str] | None = None) -> Pool:
        """``pool`` with each source's continuations of ``ids`` below its root, at most ``max_depth`` deep.
        ``labels``: the sources of ``pool``'s nodes so far (default: none)."""
        cfg = self.cfg
        self.labels = list(labels) if labels is not None else [""] * pool.size
        self.pool_tokens, self.pool_parents = pool.tokens, pool.parents
        if max_depth < 1:
            return pool
        sources = ([("request", self.request)] if self.request is not None else []) + self.store.sources()
        for name, index in sources:
            found = index.lookup(ids, min(cfg.max_depth, max_depth), cfg.min_token_prob, cfg.max_nodes,
                                 cfg.max_spec_factor)
            if not found.tokens:
                continue
            scale = found.occurrences + cfg.prior
            before = list(pool.scores)
            pool, places = graft_tree(pool, 0, found.tokens, found.parents,
                                      [math.log(c / scale) for c in found.counts], share_from)
            self.labels += [""] * (pool.size - len(self.labels))
            for place in places:
                if place >= len(before) or pool.scores[place] > before[place]:
                    self.labels[place] = name
        self.pool_tokens, self.pool_parents = pool.tokens, pool.parents
        return pool


class SuffixLookup(Proposer):
    """Method ``suffix``: the tree of ``SuffixDrafts`` alone (no drafter), sized as ``eagle-tree``'s
    "auto" trees are: the size with the most expected tokens per second (``choose_tree_size``) from
    its scores and the target's measured cost (``sizing``; None: all of ``max_nodes``)."""

    def __init__(self, drafts: SuffixDrafts, device: torch.device, sizing: Sizing | None = None) -> None:
        self.drafts, self.device, self.sizing = drafts, device, sizing
        self.proposed: tuple[DraftTree, list[int], float] | None = None

    def start(self, ids: list[int], features: torch.Tensor | None) -> None:
        self.drafts.start(ids)

    def propose(self, ids: list[int], max_depth: int, max_nodes: int) -> Proposal:
        start = time.perf_counter()
        pool = self.drafts.graft(ids, Pool([ids[-1]], [-1], [0.0]), max_depth)
        total = max_nodes
        if self.sizing is not None:
            best_first = sorted(pool.scores[1:], reverse=True)
            total = min(total, choose_tree_size(best_first, self.sizing.costs, time.perf_counter() - start,
                                                self.sizing.calibration).size)
        kept = kept_indices(pool.scores, total)
        tree = pool.subtree(kept).tree(self.device)
        self.proposed = (tree, kept, time.perf_counter())
        return Proposal(tree)

    def commit(self, ids: list[int], path: list[int], features: torch.Tensor | None) -> None:
        kept = None
        if self.proposed is not None:
            tree, kept, made = self.proposed
            if self.sizing is not None:
                self.sizing.record_round(tree.size, time.perf_counter() - made)
                scores, accepted = tree.scores.tolist(), set(path)
                ranked = best_frontier(scores[1:], len(scores) - 1)
                self.sizing.record_drafts([math.exp(scores[i + 1]) for i in ranked],
                                          [i + 1 in accepted for i in ranked])
        self.drafts.commit(ids, path, kept)

    def finish(self, ids: list[int]) -> None:
        self.drafts.finish(ids, self.proposed[1] if self.proposed is not None else None)

    def accepted_by_source(self) -> dict[str, int]:
        return dict(self.drafts.accepted)
