"""``total_tokens="auto"``: size the draft tree by measured cost.

The target's forward time as a function of the number of tree tokens is measured once per
model, device, dtype and thread count, and cached. Each round then keeps the number of nodes
N that maximizes expected tokens per second, (1 + c * sum of the N - 1 best path
probabilities) / (draft time + verify time(N)): the tree's path probabilities (products of
draft probabilities, EAGLE-2's scores) estimate how likely each node is to be accepted, and c
calibrates them with the acceptance the drafter really achieved so far."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import statistics
import time
from typing import Hashable, Mapping, Sequence

import torch

from eagle.cache_dir import keep_measurement, measurement_path
from eagle.runtime.target import Target

# every size up to 16, coarser past it: matrix kernels block their rows, so the cost steps (on the
# 2-core reference CPU 1-6 tree tokens cost the same and 7 about 10% more), which sizes 4 and 8
# with a line between them would hide
SIZES = tuple(range(1, 17)) + (20, 24, 32, 48, 64)


# a measured curve whose repeats spread more than this (median over sizes of the interquartile
# range over the median) was taken while the machine was busy: later processes measure again, up to
# NOISY_TRIES measurements in all, and keep the least noisy one (a machine that is always busy has
# no quiet curve to wait for, and a measurement can take half a minute for a large head)
NOISY = 0.10
NOISY_TRIES = 3


@dataclasses.dataclass
class CostCurve:
    """Measured target forward seconds ``seconds[i]`` for ``sizes[i]`` tree tokens (increasing);
    ``spread``: how much the repeated timings varied (see ``NOISY``)."""

    sizes: list[int]
    seconds: list[float]
    spread: float = 0.0
    measurements: int = 1  # how many were made (``cost_curve``): this one is the least noisy of them

    def at(self, n: int) -> float:
        """Piecewise-linear interpolation; linear extrapolation past the last size."""
        pairs = list(zip(self.sizes, self.seconds))
        if n <= pairs[0][0]:
            return pairs[0][1]
        for (a, ta), (b, tb) in zip(pairs, pairs[1:]):
            if n <= b:
                return ta + (tb - ta) * (n - a) / (b - a)
        return pairs[-1][1] * n / pairs[-1][0]

    @functools.cached_property
    def per_token(self) -> tuple[float, ...]:
        """``at(n)`` for n = 1 .. 2 * sizes[-1] + 1, as ``choose_tree_size`` reads it (computed once
        per curve: a round asks up to three times)."""
        return tuple(self.at(n) for n in range(1, 2 * self.sizes[-1] + 2))


@dataclasses.dataclass
class TreeChoice:
    """The best ``size`` (root included) and the expected tokens per second it gives."""

    size: int
    tokens_per_second: float


def choose_tree_size(sorted_scores: Sequence[float], seconds: Sequence[float], draft_seconds: float,
                     calibration: Sequence[float] = (), depths: Sequence[int] = (),
                     step_seconds: float = 0.0) -> TreeChoice:
    """The total_tokens with the most expected tokens per second this round.

    ``sorted_scores`` [M]: cumulative draft log-probabilities of the candidate nodes, best first;
    ``seconds`` [S]: a round's cost (verification) for 1 .. S tree tokens (``CostCurve.per_token``,
    or ``measured_costs``); ``calibration`` [R]: accepted drafts per unit of draft probability of
    the best, second best, ... candidate, the last for all past R (``Sizing.calibration``; none:
    1). With ``depths`` [M] (the drafter calls each candidate needs: its depth,
    a grafted node its drafted ancestor's) a size costs ``step_seconds`` for each call past the
    first that its nodes need (``draft_seconds`` being the cost with one), for sizing a round not
    drafted yet. In plain floats: a round asks several times, for a few dozen candidates, where
    tensor operations cost more than the sums."""
    logprobs = sorted_scores[: len(seconds) - 1]  # far past the measured sizes never pays
    expected, best = 1.0, TreeChoice(size=1, tokens_per_second=1.0 / (draft_seconds + seconds[0]))
    calls = 1
    ranks = len(calibration)
    for n, logprob in enumerate(logprobs, start=2):  # n tokens: the root and the n - 1 best candidates
        expected += math.exp(logprob) * (calibration[min(n - 2, ranks - 1)] if ranks else 1.0)
        if depths:
            calls = max(calls, depths[n - 2])
        rate = expected / (draft_seconds + step_seconds * (calls - 1) + seconds[n - 1])
        if rate > best.tokens_per_second:
            best = TreeChoice(size=n, tokens_per_second=rate)
    return best


def expansion_floor(pool: Sequence[float], candidates: Sequence[float], seconds: Sequence[float],
                    draft_seconds: float, step_seconds: float, child_logprob: float,
                    calibration: Sequence[float] = ()) -> float | None:
    """Which candidate nodes one more drafter call (one more tree depth) should expand, or None when
    expanding none can raise the expected tokens per second.

    ``pool`` [M]: cumulative draft log-probabilities of the nodes drafted so far this round (root
    left out); ``candidates`` [F]: those of the nodes that could be expanded (among the pool);
    ``seconds``, ``calibration``: as for ``choose_tree_size``; ``draft_seconds``: the round's drafting so far;
    ``step_seconds``: what a drafter call costs; ``child_logprob``: the log-probability a node's
    best child typically has given the node (so an expanded candidate s is expected to bring a node
    scoring s + child_logprob). The call pays when the best size of the pool with those children,
    after the call's time, beats the best size of the pool now (``choose_tree_size``); then a
    candidate is worth expanding if its child would be among the nodes that size keeps. Returns the
    lowest candidate score worth expanding."""
    now = choose_tree_size(sorted(pool, reverse=True), seconds, draft_seconds, calibration)
    grown = sorted([*pool, *(s + child_logprob for s in candidates)], reverse=True)
    then = choose_tree_size(grown, seconds, draft_seconds + step_seconds, calibration)
    if then.tokens_per_second <= now.tokens_per_second:
        return None
    return grown[then.size - 2] - child_logprob  # the lowest kept score, a candidate's child reaching it


def measured_costs(prior: Sequence[float], measured: dict[int, float], weights: dict[int, float]) -> list[float]:
    """A round's cost for 1 .. S tree tokens: the curve ``prior`` [S] (``CostCurve.per_token``) mapped
    onto what rounds of some sizes really cost in this decoding (``measured``: size -> seconds, running
    averages of the time from a proposal to its commit) by the line a * prior + b that fits them best
    (least squares, size n weighted by ``weights[n]``; one size: b alone; a within 0.5-3). The
    curve is timed once per machine, in a loop of bare forwards; in decoding the sizes cost more,
    and more so the larger they are, which would make "auto" choose trees too large. One line for all
    sizes, not a value per size: a size measured once in a slow spell would look dear, never be
    chosen again, and so never be measured again."""
    points = [(prior[n - 1], measured[n], weights.get(n, 1.0)) for n in measured if n <= len(prior)]
    if not points:
        return list(prior)
    total = sum(w for _, _, w in points)
    mean_x, mean_y = (sum(w * x for x, _, w in points) / total, sum(w * y for _, y, w in points) / total)
    spread = sum(w * (x - mean_x) ** 2 for x, _, w in points)
    a = 1.0 if spread <= 1e-12 * total * mean_x ** 2 else min(3.0, max(0.5, sum(
        w * (x - mean_x) * (y - mean_y) for x, y, w in points) / spread))
    b = mean_y - a * mean_x
    return [a * x + b for x in prior]


CALIBRATED_RANKS = 3  # calibration for the best draft of a tree, the second, and all others
PRIOR_MASS = 1.0  # calibration's prior, per rank: drafts of this much draft probability, accepted as often as it says
ROUNDS_WEIGHED = 20  # a size's weight in fitting the costs: the rounds timed, up to this
REFIT_ROUNDS = 8  # the costs are fitted anew after this many rounds (at once for a size not timed before)
CHILD_PROB_PRIOR = 0.5  # before any drafter call is seen: an expanded node's best child is a coin flip
AVERAGING = 0.1  # the weight of each new observation in the running averages


PROBE_ROUNDS = (8, 64)  # plain rounds before drafting is tried again: at first, and at most (doubling between)
PROBE_WEIGHT = 0.5  # a probe's weight in the drafting averages: what drafting gave many rounds ago is stale
PLAIN_EVERY = (4, 64)  # drafting rounds before a plain round measures what drafting must beat: the first, then again


@dataclasses.dataclass
class DraftGate:
    """Whether a round drafts at all: drafting pays while a drafting round's tokens per second (running
    averages of its new tokens and its whole time, drafting to commit) beat a plain round's (1 token in
    ``plain_seconds``, or before any plain round the ``estimate`` given). A round that does not draft
    verifies the root alone (plain decoding: the drafter is not even fed). After ``patience`` plain rounds
    one drafting round probes again (weighed ``PROBE_WEIGHT``); a probe that does not pay doubles the patience (up to
    ``PROBE_ROUNDS[1]``), one that pays resets it. While drafting pays, one plain round after the first
    ``PLAIN_EVERY[0]`` drafting rounds and then every ``PLAIN_EVERY[1]`` measures what it must beat (an estimate
    from the drafting rounds' own costs would follow them). Each generation starts with a probe where drafting
    did not pay (``start``): what drafting gave on another text says little about this one, so that probe alone
    sets the drafting averages. Only past rounds decide, so acceptance stays lossless (every round verifies a
    tree fixed before its draws)."""

    drafted_seconds: float = 0.0  # 0: no drafting round seen
    drafted_tokens: float = 0.0
    plain_seconds: float = 0.0  # 0: no plain round seen
    waited: int = 0  # plain rounds since the last drafting round
    patience: int = PROBE_ROUNDS[0]
    since_plain: int = 0  # drafting rounds since the last plain one
    probing: bool = False  # the round ``drafts`` allowed is a probe (drafting did not pay)
    fresh: bool = False  # no drafting round judged yet in this generation

    def start(self) -> None:
        """A new generation: while drafting does not pay, its first rounds probe."""
        self.waited, self.fresh = max(self.waited, self.patience), True

    def pays(self, estimate: float) -> bool:
        """Whether drafting rounds so far beat plain ones (``estimate``: a plain round's seconds until one is seen)."""
        plain = self.plain_seconds or estimate
        return not self.drafted_seconds or self.drafted_tokens * plain >= self.drafted_seconds

    def drafts(self, estimate: float) -> bool:
        """Whether the next round drafts: it pays and no plain round is due to measure the reference, or a probe
        is due."""
        if self.drafted_seconds and self.since_plain >= PLAIN_EVERY[1 if self.plain_seconds else 0]:
            self.probing = False
            return False
        pays = self.pays(estimate)
        self.probing = not pays and self.waited >= self.patience
        return pays or self.probing

    def record(self, drafted: bool, tokens: int, seconds: float, estimate: float) -> None:
        """A round's new ``tokens`` and ``seconds``; ``drafted``: whether it drafted (``drafts`` said so)."""
        if not drafted:
            self.plain_seconds += AVERAGING * (seconds - self.plain_seconds) if self.plain_seconds else seconds
            self.waited += 1
            self.since_plain = 0
            return
        weight = 1.0 if not self.drafted_seconds or (self.probing and self.fresh) else (
            PROBE_WEIGHT if self.probing else AVERAGING)
        self.fresh = False
        self.drafted_seconds += weight * (seconds - self.drafted_seconds)
        self.drafted_tokens += weight * (tokens - self.drafted_tokens)
        if self.probing:
            self.patience = PROBE_ROUNDS[0] if self.pays(estimate) else min(PROBE_ROUNDS[1], 2 * self.patience)
        self.waited, self.probing = 0, False
        self.since_plain += 1


@dataclasses.dataclass
class Sizing:
    """What "auto" tree sizing learns while decoding; a model keeps one per kind of decoding (greedy,
    sampled), so each generation starts where the last left off.

    - ``round_seconds``, ``rounds``: tree size -> running average of what a round of it cost (from
      its proposal to its commit), how many were timed; they map the cached ``curve`` onto
      decoding's costs: ``costs`` (``measured_costs``);
    - ``step_seconds``, ``child_prob``: running averages of a drafter call's seconds (0: none seen)
      and of the probability an expanded node's best child has given the node (``expansion_floor``);
    - ``predicted``, ``accepted``: per rank of a verified draft in its tree (best score first; the
      last rank for all past it), their summed draft probabilities (path products) and how many
      were accepted: ``calibration``, their ratios (with ``PRIOR_MASS``, within 0.25-4). A second
      drawn sibling (sampled decoding) is accepted less often than its draft probability says
      (20 dev prompts, 3-token trees: predicted 0.199, accepted 0.159) while the best draft is
      accepted more often (0.347, 0.385): one factor for all let trees grow where they lost.
      Calibrating per bucket of draft probability instead did not pay (sampled 0.969x -> 0.944x
      ``ar``);
    - ``gate``: whether a round drafts at all (``DraftGate``; ``decode_loop`` asks it)."""

    curve: CostCurve
    round_seconds: dict[int, float] = dataclasses.field(default_factory=dict)
    rounds: dict[int, float] = dataclasses.field(default_factory=dict)
    step_seconds: float = 0.0
    child_prob: float = CHILD_PROB_PRIOR
    predicted: list[float] = dataclasses.field(default_factory=lambda: [0.0] * CALIBRATED_RANKS)
    accepted: list[float] = dataclasses.field(default_factory=lambda: [0.0] * CALIBRATED_RANKS)
    gate: DraftGate = dataclasses.field(default_factory=DraftGate)

    def __post_init__(self) -> None:
        self.costs = measured_costs(self.curve.per_token, self.round_seconds, self.rounds)
        self.unfitted = 0  # rounds recorded since ``costs`` was fitted
        self.calibration = [1.0] * CALIBRATED_RANKS

    def record_round(self, size: int, seconds: float) -> None:
        before = self.round_seconds.get(size)
        self.round_seconds[size] = seconds if before is None else before + AVERAGING * (seconds - before)
        self.rounds[size] = min(ROUNDS_WEIGHED, self.rounds.get(size, 0) + 1)
        self.unfitted += 1
        if before is None or self.unfitted >= REFIT_ROUNDS:  # a refit costs ~15 us; the averages move slowly
            self.costs = measured_costs(self.curve.per_token, self.round_seconds, self.rounds)
            self.unfitted = 0

    def record_step(self, seconds: float, child_probs: Sequence[float]) -> None:
        """A drafter call of ``seconds`` that expanded nodes whose best children have ``child_probs``."""
        self.step_seconds += AVERAGING * (seconds - self.step_seconds) if self.step_seconds else seconds
        for p in child_probs:
            self.child_prob += AVERAGING * (p - self.child_prob)

    def record_drafts(self, probs: Sequence[float], accepted: Sequence[bool]) -> None:
        """A verified tree's drafts, best first: their draft probabilities, whether each was accepted."""
        for rank, (p, hit) in enumerate(zip(probs, accepted)):
            self.predicted[min(rank, CALIBRATED_RANKS - 1)] += p
            self.accepted[min(rank, CALIBRATED_RANKS - 1)] += hit
        self.calibration = [min(4.0, max(0.25, (hits + PRIOR_MASS) / (sum_p + PRIOR_MASS)))
                            for hits, sum_p in zip(self.accepted, self.predicted)]


def non_decreasing(values: list[float]) -> list[float]:
    """The least-squares non-decreasing fit (pool adjacent violators): a forward over more
    tokens never costs less, so a timing that says otherwise is noise, averaged with its
    neighbours (a real step up is kept). [n] -> [n]."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (a, n), (b, m) = blocks[-2], blocks.pop()
            blocks[-1] = [(a * n + b * m) / (n + m), n + m]
    return [mean for mean, count in blocks for _ in range(int(count))]


@torch.inference_mode()
def measure_cost_curve(target: Target, sizes: tuple[int, ...] = SIZES, context: int = 128,
                       repeats: int = 7, greedy: bool = False) -> CostCurve:
    """Time one target forward of n tree tokens after ``context`` cached tokens, with what a round
    needs of the head (``greedy``: only the argmaxes, ``Target.greedy_tokens``; else all logits):
    ``repeats`` rounds over all sizes (so a slow spell of the machine touches every size alike),
    the median per size, made non-decreasing in n (``non_decreasing``)."""
    from eagle.runtime import kv_cache
    from eagle.runtime.masks import causal_bias

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (1, context + max(sizes)), generator=gen).to(target.device)
    cache = target.new_cache()
    target.forward(ids[:, :context], torch.arange(context, device=target.device)[None], cache, logits_from=context)
    runs: dict[int, list[float]] = {n: [] for n in sizes}
    for round_ in range(repeats + 1):  # the first round warms up
        # an untimed forward of the smallest size first: timed right after the largest of the round
        # before (which streams the weights through another kernel), it cost 30% more than in decoding
        target.forward(ids[:, context:context + sizes[0]], torch.arange(context, context + sizes[0],
                                                                        device=target.device)[None], cache)
        kv_cache.roll_back(cache, context)
        for n in sizes:
            bias = causal_bias(n, context, target.dtype, target.device)
            start = time.perf_counter()
            out = target.forward(ids[:, context:context + n],
                                 torch.arange(context, context + n, device=target.device)[None], cache, bias,
                                 logits_from=n if greedy else 0)
            if greedy:
                target.greedy_tokens(out.hidden[0])
            if target.device.type == "cuda":
                torch.cuda.synchronize()
            if round_:
                runs[n].append(time.perf_counter() - start)
            kv_cache.roll_back(cache, context)
    return CostCurve(sizes=list(sizes), seconds=non_decreasing([statistics.median(runs[n]) for n in sizes]),
                     spread=statistics.median(relative_spread(runs[n]) for n in sizes))


def relative_spread(times: list[float]) -> float:
    """Interquartile range over median of repeated timings (0 for fewer than two)."""
    if len(times) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
    return (q3 - q1) / statistics.median(times)


_MEASURED: dict[str, CostCurve] = {}  # the curves this process measured (each at most once)


def cost_curve(target: Target, greedy: bool = False) -> CostCurve:
    """The cached cost curve for this target, device, dtype, thread count, kernel choice and kind
    of decoding (greedy rounds need only the head's argmaxes, which can cost less than its
    logits: ``eagle.runtime.decoder.GreedyHead``), measured on a miss and kept on disk; one whose
    timings were noisy (``NOISY``) is measured again by later processes, up to ``NOISY_TRIES``
    measurements, the least noisy kept. A process measures at most once."""
    key = json.dumps(["v6", target.name, target.tokenizer_fingerprint, target.hidden_size,
                      target.config.num_hidden_layers, str(target.device), str(target.dtype),
                      torch.get_num_threads(), target.lean.kernel_choice() if target.lean is not None else "model"]
                     + (["greedy"] if greedy else [])
                     + ([target.graphs.describe()] if target.graphs is not None else []))
    if key in _MEASURED:
        return _MEASURED[key]
    path = measurement_path("cost", key)
    kept = CostCurve(**json.loads(path.read_text())) if path.is_file() else None
    if kept is not None and (kept.spread <= NOISY or kept.measurements >= NOISY_TRIES):
        return kept
    # on static shapes a size costs what its bucket costs: measure each bucket and the size just past it, so
    # that interpolating between them gives the steps
    sizes = target.graphs.curve_sizes() if target.graphs is not None else SIZES
    curve = measure_cost_curve(target, sizes=sizes, greedy=greedy)
    if kept is not None:
        curve = dataclasses.replace(min(curve, kept, key=lambda c: c.spread), measurements=kept.measurements + 1)
    _MEASURED[key] = curve
    keep_measurement(path, dataclasses.asdict(curve))
    return curve


def batch_tree_sizes(seconds: Sequence[float], gains: Sequence[Sequence[float]],
                     draft_seconds: Sequence[float], fixed: Sequence[int | None] | None = None,
                     groups: Sequence[Hashable | None] | None = None,
                     group_seconds: Mapping[Hashable, float] | None = None) -> list[int]:
    """Each sequence's tree size (root included) for one round of a batch verified in one target
    forward: draft rows handed out best gain first across the batch, as many as give the most
    expected tokens per second, (B + kept gains) / (drafting + seconds[B + kept rows - 1]).

    ``seconds`` [S]: a target forward's cost for 1 .. S rows (``CostCurve.at``); ``gains[b]`` [M_b]:
    the expected accepted tokens of sequence b's best, second best, ... draft (non-increasing;
    empty: it cannot draft); ``draft_seconds`` [B]: what drafting costs sequence b, paid only
    when its tree has a draft; ``groups`` [B] (None: none): sequences of one group (not None) draft
    together and pay ``group_seconds[group]`` once a round, with the first of them to get a draft
    (trees grown together: one phase however many join); ``fixed`` [B] (None: none): a size
    sequence b must have (a seeded sampled request, whose draws must not depend on the load), or
    None to size it here. A fixed tree's rows, drafting and gains (its first ``fixed[b] - 1``) are
    the round's from the start, so the other sequences get rows only where they pay on top of it.
    Rows past S are never handed out. Returns [B] sizes >= 1; the sized ones all ones (batched ``ar`` beside the fixed trees)
    when no draft pays for its rows, so the expected rate is never below that. The larger the
    batch, the dearer its rows (a forward stops being bound by reading the weights once it
    computes enough rows): trees shrink as it grows."""
    batch = len(gains)
    fixed = list(fixed) if fixed is not None else [None] * batch
    if len(fixed) != batch or len(draft_seconds) != batch:
        raise ValueError(f"gains, draft_seconds and fixed must have one entry per sequence, got "
                         f"{batch}, {len(draft_seconds)}, {len(fixed)}")
    groups = list(groups) if groups is not None else [None] * batch
    if len(groups) != batch:
        raise ValueError(f"groups must have one entry per sequence, got {len(groups)} for {batch}")
    sizes = [1 if n is None else max(1, n) for n in fixed]
    base = sum(sizes)
    if base > len(seconds):
        return sizes
    paid: set[Hashable] = set()

    def starts_drafting(b: int) -> float:
        """What sequence b's first draft adds to the round's drafting: its own share, and its group's phase
        if it is the group's first."""
        cost, group = draft_seconds[b], groups[b]
        if group is not None and group not in paid:
            paid.add(group)
            cost += (group_seconds or {}).get(group, 0.0)
        return cost

    expected = batch + sum(sum(gains[b][:n - 1]) for b, n in enumerate(sizes))
    drafting = sum(starts_drafting(b) for b, n in enumerate(sizes) if n > 1)
    order = sorted(((g, b) for b, row in enumerate(gains) if fixed[b] is None for g in row),
                   key=lambda gb: (-gb[0], gb[1]))
    best_sizes, best = list(sizes), expected / (drafting + seconds[base - 1])
    for rows, (gain, b) in enumerate(order, start=base + 1):
        if rows > len(seconds):
            break
        if sizes[b] == 1:
            drafting += starts_drafting(b)
        sizes[b] += 1
        expected += gain
        rate = expected / (drafting + seconds[rows - 1])
        if rate > best:
            best, best_sizes = rate, list(sizes)
    return best_sizes


RANK_PRIOR = (0.6, 0.8, 2.0)  # a rank r never verified: accepted 0.6 * 0.8^r of the time, weighed as 2 trees


class RankRates:
    """How often the r-th best draft of a verified tree (by draft score) was accepted, per rank r,
    for one decoding method; ``gains(n)`` -> the expected accepted tokens of the best n drafts of
    the next tree [n], non-increasing. Ranks seldom verified (a batch's trees shrink) stay near
    the prior ``RANK_PRIOR``, so a tree can grow back when the batch shrinks."""

    def __init__(self) -> None:
        self.hits: list[float] = []
        self.tries: list[float] = []

    def record(self, scores: Sequence[float], accepted: Sequence[bool]) -> None:
        """A verified tree's drafts: their scores [M] and whether each was accepted [M]."""
        ranked = sorted(range(len(scores)), key=lambda i: -scores[i])
        for rank, i in enumerate(ranked):
            if rank == len(self.tries):
                self.hits.append(0.0)
                self.tries.append(0.0)
            self.hits[rank] += accepted[i]
            self.tries[rank] += 1

    def gains(self, n: int) -> list[float]:
        first, ratio, weight = RANK_PRIOR
        out, low = [], 1.0
        for rank in range(n):
            prior = first * ratio ** rank
            hits, tries = (self.hits[rank], self.tries[rank]) if rank < len(self.tries) else (0.0, 0.0)
            low = min(low, (hits + weight * prior) / (tries + weight))
            out.append(low)
        return out
