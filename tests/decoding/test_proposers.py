"""Proposers: the n-gram lookup, its running acceptance rates, and grafting it onto the tree."""

import math

import pytest
import torch

from eagle import EagleModel
from eagle.config import PromptLookupConfig, SamplingConfig
from eagle.drafting.drafter import Drafter
from eagle.decoding.proposers import LOOKUP_NODES, DrawDistributions, LookupMatch, LookupRates, prompt_lookup
from eagle.decoding.tree import Pool

from tests.conftest import prompts, tiny_target


def target_prefill(target, ids: list[int], aux_layers: tuple[int, ...] = ()):
    """The target's forward over the context before the root ``ids[-1]`` (on the target's device),
    with the outputs of ``aux_layers`` (``.features``: what a drafter fusing them reads)."""
    dev = target.device
    return target.forward(torch.tensor([ids[:-1]], device=dev), torch.arange(len(ids) - 1, device=dev)[None],
                          target.new_cache(), aux_layers=aux_layers)


def test_prompt_lookup_takes_the_longest_then_most_recent_match():
    cfg = PromptLookupConfig(max_ngram=3, min_ngram=1)
    assert prompt_lookup([1, 2, 3, 9, 8, 5, 2, 3, 7, 1, 2, 3], cfg, 2) == LookupMatch([9, 8], 3)
    assert prompt_lookup([2, 3, 6, 5, 2, 3, 7, 6, 1, 2, 3], cfg, 5) == LookupMatch([7, 6, 1, 2, 3], 2)
    assert prompt_lookup([4, 3, 5, 4], cfg, 5) == LookupMatch([3, 5, 4], 1)
    assert prompt_lookup([1, 2, 3], cfg, 5) == LookupMatch([], 0)
    assert prompt_lookup([1, 2, 3, 1, 2, 3], cfg, 0) == LookupMatch([], 0)


def test_prompt_lookup_is_the_brute_force_search():
    """The word search equals a plain scan (longest n-gram first, most recent earlier match), on
    random contexts over small vocabularies (many matches) and ids past 255 (multi-byte words, so
    byte-level matches that straddle tokens must be skipped)."""
    import random

    def scan(ids: list[int], cfg: PromptLookupConfig, limit: int) -> LookupMatch:
        for n in range(cfg.max_ngram, cfg.min_ngram - 1, -1):
            for start in range(len(ids) - n - 1, -1, -1) if limit > 0 and len(ids) > n else ():
                if ids[start:start + n] == ids[-n:]:
                    return LookupMatch(ids[start + n:start + n + limit], n)
        return LookupMatch([], 0)

    rng = random.Random(0)
    for trial in range(3000):
        cfg = PromptLookupConfig(max_ngram=rng.randint(1, 4), min_ngram=1)
        vocab = rng.choice([2, 5, 300, 70000, 2 ** 31 - 1])
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        if trial % 3 == 0:  # the same tokens as 256-multiples and their bytes: byte matches across words
            ids = [rng.choice([0, 1, 256, 65536, 257]) for _ in range(rng.randint(1, 30))]
        limit = rng.randint(0, 6)
        assert prompt_lookup(ids, cfg, limit) == scan(ids, cfg, limit), (ids, cfg, limit)


def test_lookup_rates_judge_a_draft_only_when_the_drafts_before_it_agreed():
    rates = LookupRates(max_ngram=3)
    match = LookupMatch([4, 5, 6, 7], 2)
    rates.update(match, [4, 5, 9])  # 4 and 5 agree, 6 is refuted, 7 is not judged
    assert rates.first[2] == [2.0, 3.0] and rates.later == [2.0, 4.0]
    rates.update(match, [4])  # the round produced one token: only the first draft is judged
    assert rates.first[2] == [3.0, 4.0] and rates.later == [2.0, 4.0]
    rates.update(LookupMatch([8], 1), [3])
    assert rates.first[1] == [1.0, 3.0] and rates.first[3] == [1.0, 2.0]
    want = [math.log(3 / 4) + i * math.log(2 / 4) for i in range(4)]
    assert rates.scores(match) == pytest.approx(want)


def test_eagle_tree_grafts_the_lookup_chain_and_learns_from_what_the_target_produced(target, drafter):
    model = EagleModel.from_pretrained(target, drafter=drafter, total_tokens=100, depth=1, top_k=2, lookup_tokens=3)
    ids = [7, 1, 2, 3, 4, 5, 9, 1, 2, 3]
    prefill = target_prefill(target, ids)
    proposer = model._proposer("eagle-tree", SamplingConfig(), torch.Generator())
    proposer.start(ids, prefill.hidden[0])
    tree = proposer.propose(ids, max_depth=10, max_nodes=100).tree
    paths, tokens = {0: ()}, tree.tokens.tolist()
    for i, parent in enumerate(tree.parents.tolist()[1:], start=1):
        paths[i] = paths[parent] + (tokens[i],)
    assert {(4,), (4, 5), (4, 5, 9)} <= set(paths.values())  # "1 2 3" was followed by "4 5 9" before
    assert tree.size > 1 + 2 + 4  # the drafter's own pool (2 + 2 * 2 nodes) did not hold all of them
    node = {path: i for i, path in paths.items()}
    proposer.commit(ids + [4, 5, 0], [node[4,], node[4, 5]], torch.zeros(3, target.hidden_size, device=target.device))
    assert proposer.lookup_rates.first[3] == [2.0, 3.0] and proposer.lookup_rates.later == [2.0, 4.0]
    chain = model._proposer("eagle-chain", SamplingConfig(), torch.Generator())
    chain.start(ids, prefill.hidden[0])
    assert chain.propose(ids, max_depth=10, max_nodes=100).tree.size == 3  # a chain stays the drafter's chain


def test_a_sampled_tree_grafts_lookup_chains_as_new_nodes_after_the_drawn_ones(target, drafter):
    """At temperature > 0 the drafter's children are drawn; prompt-lookup chains join as new
    nodes (never merged with a drawn node, even one with the same token: its score would then
    depend on what was drawn), flagged as not drawn and placed after every drawn node, so the
    acceptance rule tries them after their drawn siblings; each drawn node's parent has the
    distribution it was drawn from."""
    model = EagleModel.from_pretrained(target, drafter=drafter, total_tokens=100, depth=1, top_k=2, lookup_tokens=3)
    ids = [7, 1, 2, 3, 4, 5, 9, 1, 2, 3]
    prefill = target_prefill(target, ids)
    proposer = model._proposer("eagle-tree", SamplingConfig(temperature=1.0), torch.Generator().manual_seed(0))
    proposer.start(ids, prefill.hidden[0])
    proposal = proposer.propose(ids, max_depth=10, max_nodes=100)
    tree, drawn = proposal.tree, proposal.drawn.tolist()
    assert drawn == [False] + [True] * 6 + [False] * (tree.size - 7)  # 2 + 2 * 2 drawn nodes, then the grafts
    parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
    root_chain = [i for i in range(7, tree.size) if parents[i] == 0]
    assert len(root_chain) == 1 and tokens[root_chain[0]] == 4  # "1 2 3" was followed by "4 5 9" before
    for node in set(tree.parents[proposal.drawn].tolist()):
        assert proposal.child_probs[node].sum().item() == pytest.approx(1.0, abs=1e-4)
    pool = Pool([5, 6, 8], [-1, 0, 0], [0.0, -0.1, -2.0])
    grafted = proposer.graft_lookup([6, 11, 12, 5, 8, 13, 14, 5], pool, max_depth=10)  # root lookup: "8 13 14"
    assert grafted.tokens[:3] == [5, 6, 8] and grafted.scores[:3] == pool.scores
    assert grafted.tokens.count(8) >= 2 and grafted.parents.count(0) == 3  # a second root 8


def test_lookups_below_draft_nodes_are_grafted_and_judged_only_where_the_target_went(target, drafter):
    assert LOOKUP_NODES >= 2
    model = EagleModel.from_pretrained(target, drafter=drafter, lookup_tokens=3)
    proposer = model._proposer("eagle-tree", SamplingConfig(), torch.Generator())
    ids = [6, 11, 12, 5, 8, 13, 14, 5]
    dev = target.device
    pool = Pool([5, 6, 8], [-1, 0, 0], [0.0, -0.1, -2.0])
    tree = proposer.graft_lookup(ids, pool, max_depth=10)
    paths, tokens = {0: ()}, tree.tokens
    for i, parent in enumerate(tree.parents[1:], start=1):
        paths[i] = paths[parent] + (tokens[i],)
    # root: "5" was followed by "8 13 14"; after draft 6: "6" by "11 12 5"; after draft 8: "5 8" by "13 14 5"
    assert set(paths.values()) == {(), (6,), (6, 11), (6, 11, 12), (6, 11, 12, 5), (8,), (8, 13), (8, 13, 14),
                                   (8, 13, 14, 5)}
    assert [(path, m.ngram) for path, m in proposer.last_matches] == [([], 1), ([6], 1), ([8], 2)]
    proposer.last_hidden = torch.zeros(target.hidden_size, device=dev)
    node = {path: i for i, path in paths.items()}
    proposer.commit(ids + [6, 11, 7], [node[6,], node[6, 11]], torch.zeros(3, target.hidden_size, device=dev))  # 6 11 7
    rates = proposer.lookup_rates
    assert rates.first[1] == [2.0, 4.0]  # root's "8" refuted, "11" after 6 confirmed
    assert rates.later == [1.0, 3.0]  # "12" refuted
    assert rates.first[2] == [1.0, 2.0]  # the lookup below draft 8 is not judged: the target did not go there


def test_greedy_without_lookup_matches_ar(kind_pair):
    """The drafter's tree alone (EAGLE-2), with a drafter of each kind; with lookup (the default)
    see tests/test_engine.py."""
    target, drafter = kind_pair
    model = EagleModel.from_pretrained(target, drafter=drafter, total_tokens=12, depth=4, top_k=3, lookup_tokens=0)
    for ids in prompts(20, seed=4):
        assert model.generate(ids, method="eagle-tree", max_new_tokens=24).token_ids == \
            model.generate(ids, method="ar", max_new_tokens=24).token_ids



def brute_force_prediction(proposer, ids: list[int], features: torch.Tensor, path: list[int],
                           path_features: list[torch.Tensor]) -> torch.Tensor:
    """A tree node's predicted feature [H], recomputed by running the drafter causally over the context and the
    node's ``path`` (fed the predictions ``path_features`` along it). An EAGLE-3 drafter reads the target's
    ``features`` [n, (1 + a) H] over the context and its own predictions along the path: two calls, the second
    on the first's cache."""
    drafter, target = proposer.drafter, proposer.target
    dev = target.device
    if drafter.config.kind == "eagle3":
        cache, context = drafter.new_cache(), torch.tensor([ids[1:]], device=dev)
        out = drafter(features[None], target.embed(context), torch.arange(context.shape[1], device=dev)[None], cache)
        if path:
            positions = torch.arange(context.shape[1], context.shape[1] + len(path), device=dev)[None]
            out = drafter(torch.stack(path_features)[None], target.embed(torch.tensor([path], device=dev)),
                          positions, cache)
        return out[0, -1]
    feats = torch.cat([features, torch.stack(path_features)]) if path_features else features
    tokens = torch.tensor([ids[1:] + path], device=dev)
    positions = torch.arange(tokens.shape[1], device=dev)[None]
    return drafter(feats[None], target.embed(tokens), positions)[0, -1]


def brute_force_eagle2(proposer, ids: list[int], features: torch.Tensor, depth: int, k: int,
                       total: int) -> dict[tuple[int, ...], float]:
    """EAGLE-2 by its code, each node's predicted feature recomputed (``brute_force_prediction``): the root's
    k children, then ``depth`` expansions of the k best frontier nodes (paths of up to depth + 1 drafts);
    the kept paths -> their scores."""
    drafter, target = proposer.drafter, proposer.target

    def predict(path: list[int], path_features: list[torch.Tensor]) -> torch.Tensor:
        return brute_force_prediction(proposer, ids, features, path, path_features)

    def children(path, path_features, hidden, score):
        logprobs = torch.log_softmax(drafter.draft_logits(hidden, target.lm_head), -1)
        top = torch.topk(logprobs, k)
        return [(path + [int(t)], path_features + [hidden], score + float(s)) for s, t in zip(top.values, top.indices)]

    level = children([], [], predict([], []), 0.0)  # (path, features fed along it, score)
    pool = list(level)
    for _ in range(depth):
        frontier = sorted(range(len(level)), key=lambda i: -level[i][2])[:k]  # stable: ties keep order
        level = [c for i in frontier for c in children(level[i][0], level[i][1],
                                                       predict(level[i][0], level[i][1]), level[i][2])]
        pool += level
    kept = sorted(range(len(pool)), key=lambda i: -pool[i][2])[: total - 1]
    return {tuple(pool[i][0]): pool[i][2] for i in kept}


def grown_tree(model, target, flat, ids, monkeypatch):
    """The greedy eagle-tree proposer after its prefill on ``ids``, the target's prefill, the drafter rows of each
    call (``drafter_rows``) and the tree it proposes."""
    prefill = target_prefill(target, ids, tuple(flat.config.aux_layers))
    proposer = model._proposer("eagle-tree", SamplingConfig(), torch.Generator())
    proposer.start(ids, prefill.features[0])
    proposer.prepare()
    rows = drafter_rows(monkeypatch)
    return proposer, prefill, rows, proposer.propose(ids, max_depth=10, max_nodes=100).tree


def drafter_rows(monkeypatch) -> list[int]:
    """The rows of each drafter call that expands tree nodes from now on (a step with rows and a head), as they run."""
    from eagle.decoding import draft_steps

    rows, run_steps = [], draft_steps.run_steps
    monkeypatch.setattr(draft_steps, "run_steps", lambda steps: rows.extend(
        len(s.tokens) for s in steps if s.rows is not None and s.head) or run_steps(steps))
    return rows


def flat_pair(request, kind: str):
    """(target, drafter of ``kind`` with unscaled random weights): a flat draft distribution, where deep
    and shallow nodes compete. An EAGLE-3 drafter drafts over 20 of the 32 tokens."""
    torch.manual_seed(5)
    if kind == "eagle":
        target = request.getfixturevalue("target")
        return target, Drafter.from_target(target).eval()
    target = request.getfixturevalue("eagle3_target")
    return target, Drafter.from_target(target, kind="eagle3", draft_vocab_size=20).eval()


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("total, frontier_rows", [(3, "first"), (5, "fewer"), (7, None), (9, None), (12, None),
                                                  (40, "all")])
def test_dynamic_tree_equals_brute_force_eagle2_and_skips_nodes_that_cannot_be_kept(request, monkeypatch, kind, total,
                                                                                    frontier_rows):
    """With a flat draft distribution (no weight scaling) deep and shallow nodes compete. An
    EAGLE-3 drafter (over a draft vocabulary) is fed the target's aux features at the root and its
    own predictions below."""
    depth, k = 4, 3
    target, flat = flat_pair(request, kind)
    model = EagleModel.from_pretrained(target, drafter=flat, total_tokens=total, depth=depth, top_k=k, lookup_tokens=0,
                                       drafter_dtype=torch.float32)
    ids = [3, 9, 4, 17, 8, 2, 11]
    proposer, prefill, rows, tree = grown_tree(model, target, flat, ids, monkeypatch)
    paths, tokens, scores = {0: ()}, tree.tokens.tolist(), tree.scores.tolist()
    for i, parent in enumerate(tree.parents.tolist()[1:], start=1):
        paths[i] = paths[parent] + (tokens[i],)
    got = {paths[i]: scores[i] for i in range(1, tree.size)}
    want = brute_force_eagle2(proposer, ids, prefill.features[0], depth, k, total)
    assert got.keys() == want.keys()
    assert [got[p] for p in want] == pytest.approx(list(want.values()), abs=1e-4)
    if frontier_rows == "first":  # 2 nodes kept: only the best of the root's children can have a kept child
        assert rows[0] == 1
    if frontier_rows == "fewer":  # 4 nodes kept: some frontier nodes could not be and were not run
        assert sum(rows) < k * depth
    elif frontier_rows == "all":  # every node can be kept: all k frontier nodes run at every depth
        assert rows == [k] * depth


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_static_tree_is_its_layout_filled_with_ranked_children(request, monkeypatch, kind):
    """An EAGLE-1 static tree (``choices``): node by node the drafter's ranked child (the first on ties) of
    its parent's recomputed prediction at the node's rank, scored by its path's log-probability; only
    nodes with children in the layout run through the drafter."""
    choices = ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (2, 0), (0, 0, 0), (0, 0, 1), (1, 0, 0))
    target, flat = flat_pair(request, kind)
    model = EagleModel.from_pretrained(target, drafter=flat, total_tokens=100, choices=[list(c) for c in choices],
                                       lookup_tokens=0, drafter_dtype=torch.float32)
    ids = [3, 9, 4, 17, 8, 2, 11]
    proposer, prefill, rows, tree = grown_tree(model, target, flat, ids, monkeypatch)
    want = {(): ([], [], 0.0)}  # rank path -> (tokens, predictions fed along it, score)
    for choice in sorted(choices, key=lambda c: (len(c), c)):
        tokens, fed, score = want[choice[:-1]]
        hidden = brute_force_prediction(proposer, ids, prefill.features[0], tokens, fed)
        lp = torch.log_softmax(proposer.drafter.draft_logits(hidden, target.lm_head), -1).tolist()
        token = sorted(range(len(lp)), key=lambda v: (-lp[v], v))[choice[-1]]
        want[choice] = (tokens + [token], fed + [hidden], score + lp[token])
    layout = sorted(want, key=lambda c: (len(c), c))
    assert tree.size == len(layout)
    got_tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    assert parents == [-1] + [layout.index(c[:-1]) for c in layout[1:]]
    assert got_tokens[1:] == [int(proposer.drafter.to_target_ids(torch.tensor(want[c][0][-1]))) for c in layout[1:]]
    assert tree.scores.tolist() == pytest.approx([want[c][2] for c in layout], abs=1e-4)
    assert rows == [3, 2]  # depth 1: (0,), (1,), (2,) have children; depth 2: (0, 0), (1, 0)


def test_a_sampled_auto_tree_takes_the_size_chosen_before_its_draws(target, drafter, monkeypatch):
    """With drawn children a round's size must not depend on that round's draws: "auto" sizes
    each round from the previous round's pool (the first round: the most nodes that cost no more
    than one token), and every node with children has the distribution they were drawn from."""
    import eagle.decoding.proposers as proposers
    from eagle.decoding.tree_sizing import CostCurve, TreeChoice

    model = EagleModel.from_pretrained(target, drafter=drafter, total_tokens="auto", depth=4, top_k=3)
    curve = CostCurve(sizes=[1, 4, 5, 8], seconds=[1.0, 1.0, 1.2, 1.3])
    proposer = proposers.EagleDrafter(model._inference_copy(drafter, torch.float32), target, model.tree, cost=curve,
                                      sampling=SamplingConfig(temperature=1.0), generator=torch.Generator().manual_seed(0))
    assert proposer.next_size == 4
    sizes, calls = [3, 6, 5], []

    def choose(*args, **kwargs):
        calls.append(sizes[len(calls)])
        return TreeChoice(size=calls[-1], tokens_per_second=1.0)

    monkeypatch.setattr(proposers, "choose_tree_size", choose)
    ids = [7, 1, 2, 3, 4, 5, 9, 1, 2, 3]
    prefill = target_prefill(target, ids)
    proposer.start(ids, prefill.hidden[0])
    for round_, expected in enumerate((4, 3, 6)):
        proposal = proposer.propose(ids, max_depth=10, max_nodes=100)
        assert proposal.tree.size == expected and len(calls) == round_ + 1 and proposer.next_size == sizes[round_]
        for node in set(proposal.tree.parents[proposal.drawn].tolist()):
            assert proposal.child_probs[node].sum().item() == pytest.approx(1.0, abs=1e-4)


def test_greedy_auto_drafts_a_deeper_level_only_where_it_pays(target, drafter, monkeypatch):
    """Greedy "auto": the next depth is drafted only when its expected gain pays for the drafter
    call (``expansion_floor``): never with a curve where each extra token costs a full forward,
    always with one where tokens are free; the call's seconds and how likely an expanded node's
    best child is are learned as it drafts."""
    import eagle.decoding.proposers as proposers
    from eagle.decoding.tree_sizing import CHILD_PROB_PRIOR, CostCurve

    model = EagleModel.from_pretrained(target, drafter=drafter, total_tokens="auto", depth=4, top_k=3)
    ids = [7, 1, 2, 3, 4, 5, 9, 1, 2, 3]
    prefill = target_prefill(target, ids)
    steep = CostCurve(sizes=[1, 2, 64], seconds=[1.0, 2.0, 64.0])
    free = CostCurve(sizes=[1, 64], seconds=[1.0, 1.0])
    for curve, step_seconds, deeper in ((steep, 0.0, False), (free, 0.0, True), (free, 100.0, False)):
        proposer = proposers.EagleDrafter(model._inference_copy(drafter, torch.float32), target, model.tree, cost=curve)
        proposer.sizing.step_seconds = step_seconds  # a drafter call that takes 100 s never pays, whatever the curve
        proposer.start(ids, prefill.hidden[0])
        proposer.prepare()
        calls = drafter_rows(monkeypatch)
        proposer.propose(ids, max_depth=10, max_nodes=100)
        assert bool(calls) == deeper
        assert (proposer.sizing.step_seconds != step_seconds) == deeper
        assert (proposer.sizing.child_prob != CHILD_PROB_PRIOR) == deeper and 0 < proposer.sizing.child_prob <= 1


def test_auto_sizing_keeps_what_it_learns_across_generations(target, drafter, monkeypatch):
    """"auto" times each round from its proposal to its commit, per tree size, and counts which
    drafts were accepted against what their draft probabilities said, per rank in the tree
    (``Sizing``); the model keeps that per kind of decoding, so the next generation starts from it."""
    import eagle.decoding.proposers as proposers
    from eagle.decoding.tree_sizing import CostCurve

    curve = CostCurve(sizes=[1, 16], seconds=[1.0, 1.0])  # every size as cheap as one token: large trees
    monkeypatch.setattr("eagle.decoding.tree_sizing.cost_curve", lambda target, greedy=False: curve)
    # every round drafts (a random drafter's rounds lose to plain ones): this is about what drafting teaches
    monkeypatch.setattr("eagle.decoding.tree_sizing.DraftGate.drafts", lambda self, estimate: True)
    model = EagleModel.from_pretrained(target, drafter=drafter, total_tokens="auto", depth=4, top_k=3)
    trees = []
    propose = proposers.EagleDrafter.propose

    def recorded(self, *args, **kwargs):
        proposal = propose(self, *args, **kwargs)
        trees.append(proposal.tree)
        return proposal

    monkeypatch.setattr(proposers.EagleDrafter, "propose", recorded)
    out = model.generate([5, 6, 7, 8], method="eagle-tree", max_new_tokens=12)
    sizing = model._sizing["eagle", True]
    assert set(sizing.round_seconds) and set(sizing.round_seconds) <= {tree.size for tree in trees}
    assert ("eagle", False) not in model._sizing or not model._sizing["eagle", False].round_seconds
    assert all(0 < seconds < 1.0 for seconds in sizing.round_seconds.values())  # far below the curve's second a round
    assert sizing.costs[0] < 1.0 and sizing.costs[-1] < curve.per_token[-1]
    # the last round ends the generation: it is never committed
    assert sum(sizing.accepted) == sum(out.accept_lengths[:-1]) - len(out.accept_lengths[:-1]) > 0  # accepted drafts
    assert sum(sizing.predicted) == pytest.approx(sum(float(t.scores[1:].exp().sum()) for t in trees[:-1]))
    assert sizing.predicted[0] == pytest.approx(sum(float(t.scores[1:].exp().max()) for t in trees[:-1] if t.size > 1))
    assert model._proposer("eagle-tree", SamplingConfig(), None).sizing is sizing


@pytest.mark.timed_gate
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_auto_drafts_none_while_drafting_rounds_lose_to_plain_ones(target, drafter, monkeypatch, temperature):
    """"auto"'s gate (``Sizing.gate``): once drafting rounds are known to give fewer tokens per second than
    plain ones (here 1 token in 1000 s), rounds verify the root alone but for probes: a generation's first two
    (the first, which feeds the drafter the prompt, not counted), then one after 16 plain rounds (the probe lost:
    patience 8 doubled); greedy output stays ``ar``'s. Where drafting rounds pay (1000 tokens a round)
    it drafts every round but one plain round after the first ``PLAIN_EVERY[0]`` counted (what drafting must beat)."""
    import eagle.decoding.proposers as proposers
    from eagle.decoding.tree_sizing import PLAIN_EVERY, PROBE_ROUNDS, CostCurve

    curve = CostCurve(sizes=[1, 16], seconds=[1e-3, 1e-3])
    monkeypatch.setattr("eagle.decoding.tree_sizing.cost_curve", lambda target, greedy=False: curve)
    asked = []
    propose = proposers.EagleDrafter.propose
    monkeypatch.setattr(proposers.EagleDrafter, "propose",
                        lambda self, ids, max_depth, max_nodes: asked.append(max_nodes > 1) or propose(
                            self, ids, max_depth, max_nodes))
    ids = [5, 6, 7, 8]
    for slow in (False, True):
        model = EagleModel.from_pretrained(target, drafter=drafter, total_tokens="auto", depth=4, top_k=3)
        gate = model._cost_sizing("eagle", SamplingConfig(temperature=temperature)).gate
        gate.drafted_seconds, gate.drafted_tokens = (1e3, 1.0) if slow else (1e-9, 1e3)
        asked.clear()
        out = model.generate(ids, method="eagle-tree", max_new_tokens=40, temperature=temperature, seed=1)
        assert len(asked) == len(out.accept_lengths)
        probes = [0, 1, 2 + 2 * PROBE_ROUNDS[0]]  # the generation's start, then after 16 plain rounds
        drafted = [i for i, d in enumerate(asked) if d]
        fast = [i for i in range(len(asked)) if i != 1 + PLAIN_EVERY[0]]
        assert drafted == ([i for i in probes if i < len(asked)] if slow else fast)
        if temperature == 0:
            assert out.token_ids == model.generate(ids, method="ar", max_new_tokens=40).token_ids


@pytest.mark.parametrize("method", ["eagle-tree", "sd"])
def test_the_gate_judges_a_round_without_the_catching_up_on_rounds_that_did_not_draft(target, drafter, monkeypatch,
                                                                                      method):
    """A drafting round after plain ones feeds the drafter (``sd``: the draft model, in its first step) what it
    skipped (and the prompt, the first time): that share of the call is ``skipped_seconds``, left out of the time
    the gate judges; a drafting round after a drafting one feeds only the last round's tokens and skips nothing."""
    import eagle.decoding.proposers as proposers

    pattern = iter([True, True, False, False, True, True] + [True] * 40)
    monkeypatch.setattr("eagle.decoding.tree_sizing.DraftGate.drafts", lambda self, estimate: next(pattern))
    recorded, skipped = [], []
    monkeypatch.setattr("eagle.decoding.tree_sizing.DraftGate.record",
                        lambda self, drafted, tokens, seconds, estimate: recorded.append(seconds))
    cls = proposers.DraftModel if method == "sd" else proposers.EagleDrafter
    propose = cls.propose

    def watched(self, ids, max_depth, max_nodes):
        proposal = propose(self, ids, max_depth, max_nodes)
        skipped.append((max_nodes > 1, self.skipped_seconds))
        return proposal

    monkeypatch.setattr(cls, "propose", watched)
    if method == "sd":
        draft = tiny_target(seed=5, hidden=16, layers=1)
        model = EagleModel.from_pretrained(target, draft_model=draft, gamma=2, draft_confidence=0.0)
    else:
        model = EagleModel.from_pretrained(target, drafter=drafter, total_tokens="auto", depth=3, top_k=2)
    model.generate(list(range(5, 30)), method=method, max_new_tokens=12)
    assert [d for d, _ in skipped[:6]] == [True, True, False, False, True, True]
    assert skipped[0][1] > 0  # the prompt
    assert skipped[1][1] == 0 and skipped[5][1] == 0  # the last round only
    assert skipped[2][1] == skipped[3][1] == 0  # plain rounds feed nothing
    assert skipped[4][1] > 0  # two plain rounds caught up on
    assert all(seconds > 0 for seconds in recorded)


def test_prompt_lookup_verifies_the_drafts_that_pay_for_their_rows(target, monkeypatch):
    """``pld`` (``auto_length``): each round's chain is the length with the most expected tokens per
    second, by the brute-force ratio (1 + the drafts' summed agreement rates) / cost, with the rates
    the target's output gave so far, every draft it could judge counted; a forward whose extra rows
    cost nothing keeps every looked-up draft, one where they cost 100 s keeps none (the rates still
    learn); without ``auto_length`` every draft is verified. The output is ``ar``'s in each case."""
    import eagle.decoding.proposers as proposers
    from eagle.decoding.tree_sizing import CostCurve

    chains = []  # (the lookup, the rates before the round, the costs, the chain verified)
    propose = proposers.PromptLookup.propose

    def recorded(self, *args, **kwargs):
        before = [list(c) for c in self.rates.first], list(self.rates.later)
        costs = list(self.sizing.costs) if self.sizing is not None else None
        proposal = propose(self, *args, **kwargs)
        chains.append((self.match, before, costs, proposal.tree.size - 1))
        return proposal

    monkeypatch.setattr(proposers.PromptLookup, "propose", recorded)
    ids = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7, 3, 5, 6]
    for name, per_row in (("steep", lambda n: 1.0 + 100.0 * (n - 1)), ("flat", lambda n: 1.0),
                          ("sloped", lambda n: 1.0 + 0.4 * (n - 1))):
        curve = CostCurve(sizes=list(range(1, 17)), seconds=[per_row(n) for n in range(1, 17)])
        monkeypatch.setattr("eagle.decoding.tree_sizing.cost_curve", lambda target, greedy=False: curve)
        for auto in (True, False):
            model = EagleModel.from_pretrained(target, num_draft_tokens=6, auto_length=auto)
            chains.clear()
            out = model.generate(ids, method="pld", max_new_tokens=40)
            assert out.token_ids == model.generate(ids, method="ar", max_new_tokens=40).token_ids
            matched = [c for c in chains if c[0].tokens]
            assert matched
            for match, (first, later), costs, kept in matched:
                if not auto:
                    assert kept == len(match.tokens) and costs is None
                    continue
                p1, pl = first[match.ngram][0] / first[match.ngram][1], later[0] / later[1]
                rates = [(1 + sum(p1 * pl ** i for i in range(n))) / costs[n] for n in range(len(match.tokens) + 1)]
                assert rates[kept] == pytest.approx(max(rates)), (name, match, kept)
            if auto and name == "steep":
                assert all(kept == 0 for *_, kept in matched) and out.accept_lengths == [1] * len(out.accept_lengths)
                learned = model._proposer("pld", SamplingConfig(), None).rates
                assert learned.first == [[1.0, 2.0]] * 4  # a new generation's rates start afresh
                assert any(c[1][0] != [[1.0, 2.0]] * 4 for c in matched)  # judged though never verified
            if auto and name == "flat":
                assert all(kept == len(match.tokens) for match, _, _, kept in matched)


def test_draw_distributions_give_the_rows_of_the_dense_matrix():
    """``DrawDistributions[i]``: what node i's children were drawn from, over the target's
    vocabulary (softmax of the draft log-probs / temperature over the draft tokens they were
    drawn among), zeros for a node with no drawn children: row i of the dense [N, V] matrix,
    computed only when read; ``support(i)`` the same row's non-zero entries."""
    torch.manual_seed(0)
    lp = torch.log_softmax(torch.randn(2, 4), -1)
    ids = torch.tensor([1, 3, 4, 6])
    rows = DrawDistributions({0: (torch.arange(4), lp[0]), 2: (torch.tensor([3, 1]), lp[1, [3, 1]])}, ids, 8, 0.5)
    dense = torch.zeros(3, 8, dtype=torch.float64)
    dense[0, ids] = torch.softmax(lp[0].double() / 0.5, -1)
    dense[2, ids[[3, 1]]] = torch.softmax(lp[1, [3, 1]].double() / 0.5, -1)
    for i in range(3):
        assert torch.equal(rows[i], dense[i])
    tokens, probs = rows.support(2)
    assert tokens.tolist() == [6, 3] and torch.equal(probs, dense[2, [6, 3]])


def test_children_are_drawn_at_the_scaled_temperature_the_rule_is_told_of(target, drafter):
    """``draw_temperature_scale`` s: a sampled tree's children are drawn from softmax(lp / (T s)),
    and that distribution is what the proposal hands to the rule (``child_probs``), not
    softmax(lp / T) (the two are told apart: the draws match the first only)."""
    import eagle.decoding.proposers as proposers

    def proposer(scale: float) -> proposers.EagleDrafter:
        model = EagleModel.from_pretrained(target, drafter=drafter, total_tokens=2, depth=1, top_k=1, lookup_tokens=0,
                                           draw_temperature_scale=scale)
        p = proposers.EagleDrafter(model._inference_copy(drafter, torch.float32), target, model.tree,
                                   sampling=SamplingConfig(temperature=temperature),
                                   generator=torch.Generator().manual_seed(0))
        p.start(ids, prefill.hidden[0])
        return p

    temperature = 8.0  # the tiny drafter is all but certain at 1
    ids = [7, 1, 2, 3, 4, 5, 9, 1, 2, 3]
    prefill = target_prefill(target, ids)
    sharp, flat = proposer(0.5), proposer(1.0)
    q_sharp, q_flat = sharp.propose(ids, 10, 100).child_probs[0], flat.propose(ids, 10, 100).child_probs[0]
    assert torch.allclose(q_sharp, q_flat.pow(2) / q_flat.pow(2).sum())  # softmax(lp / (T/2)) from softmax(lp / T)
    draws = torch.zeros(target.vocab_size, dtype=torch.float64, device=target.device)
    for _ in range(3000):
        proposal = sharp.propose(ids, 10, 100)
        assert torch.equal(proposal.child_probs[0], q_sharp) and proposal.drawn.tolist() == [False, True]
        draws[int(proposal.tree.tokens[1])] += 1
    tv = lambda q: 0.5 * float((draws / draws.sum() - q).abs().sum())  # noqa: E731
    assert tv(q_sharp) < 0.05 < 0.1 < tv(q_flat)
