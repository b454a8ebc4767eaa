"""Trees of many sequences grown together (``batch_trees``) against each sequence's own drafting (the host
path, ``EagleDrafter.drafting``), on tiny random models with pooled drafter caches."""

from __future__ import annotations

import pytest
import torch

from eagle import EagleModel
from eagle.decoding import batch_trees
from eagle.decoding.batch_trees import draft_together, grows_together
from eagle.decoding.tree import pool_depths
from eagle.decoding.serving import ServingEngine, RequestOptions, generate_together
from eagle.decoding.draft_steps import run_alone, run_together
from eagle.decoding.tree_sizing import batch_tree_sizes
from eagle.runtime.pooled import PooledGraphs

from tests.conftest import prompts, tiny_drafter, tiny_target


def flat_drafter(target):
    """A tiny drafter whose children are not nearly certain: which node each row expands shows in the tree."""
    drafter = tiny_drafter(target)
    with torch.no_grad():
        for p in drafter.parameters():
            p.mul_(0.4)
    return drafter


def paths(tree) -> dict[tuple[int, ...], float]:
    """A tree's nodes as {the tokens of the path to it: its score}, whatever their order."""
    tokens, parents, scores = tree.tokens.tolist(), tree.parents.tolist(), tree.scores.tolist()
    out, path = {}, {-1: ()}
    for i, (token, parent) in enumerate(zip(tokens, parents)):
        path[i] = path[parent] + (token,)
        out[path[i]] = scores[i]
    return out


def running(model: EagleModel, n: int, rounds: int, seed: int, static: bool = False) -> ServingEngine:
    """An engine of ``n`` greedy eagle-tree sequences in pooled caches after ``rounds`` rounds; ``static``: on
    static shapes (``PooledGraphs``, so the drafter's pool gets ``DrafterGraphs``)."""
    engine = ServingEngine(model, max_batch=n, load_sizing=False, cache_pool=True)
    if static:
        engine._pool.graphs = PooledGraphs(model.target.lean, engine._pool)
    for i, ids in enumerate(prompts(n, seed=seed)):
        engine.add(i, ids * 3, RequestOptions(method="eagle-tree", max_new_tokens=60))
    for _ in range(rounds):
        engine.step()
    return engine


@pytest.mark.parametrize("lookup_tokens,static", [(0, False), (10, False), (0, True)])
def test_trees_grown_together_are_each_sequences_own(lookup_tokens, static, monkeypatch, request):
    """Eight sequences at different lengths, each with its own depth and size limits (a sequence near its
    end, a tree of two nodes): the trees grown together, with one pooled drafter call per depth for all,
    are the trees each sequence drafts alone: the same paths with the same scores, grafted lookup chains
    included, and node for node without them. On static shapes the whole phase is one captured function
    (the CPU stand-in for CUDA capture where there is no GPU), replayed for a second batch."""
    capture = request.getfixturevalue("fake_capture") if static else None
    target = tiny_target(eos=False, seed=10)  # made after fake_capture turned the compiled CPU kernels off
    model = EagleModel.from_pretrained(target, drafter=flat_drafter(target), total_tokens=16, depth=3, top_k=3,
                                       lookup_tokens=lookup_tokens, auto_length=False)
    engine = running(model, 8, rounds=3, seed=4, static=static)
    live = list(engine._active.values())
    proposers = [seq.proposer for seq in live]
    assert len(proposers) == 8 and all(grows_together(p) for p in proposers)
    run_together([p.catching_up() for p in proposers])  # what each drafting would feed first
    ids = [seq.ids for seq in live]
    depths = [4, 1, 2, 4, 3, 4, 4, 2]
    nodes = [16, 16, 16, 2, 5, 16, 11, 16]
    alone = [run_alone(p.drafting(i, d, n)).tree for p, i, d, n in zip(proposers, ids, depths, nodes)]
    calls = []
    forward = batch_trees.pooled_drafter_forward
    monkeypatch.setattr(batch_trees, "pooled_drafter_forward", lambda *a: calls.append(len(a[4])) or forward(*a))
    together = [p.tree for p in draft_together(proposers, ids, depths, nodes).proposals]
    if static:  # one captured function for the whole phase
        graphs = proposers[0].cache.pool.graphs
        assert not calls and [key[0] for key in graphs.shapes].count("trees") == 1 and graphs.fallbacks == 0
        assert capture is None or graphs.captured >= 1
        again = [p.tree for p in draft_together(proposers, ids, depths, nodes).proposals]  # replayed
        assert all(torch.equal(a.tokens, t.tokens) and torch.equal(a.scores, t.scores) for a, t in zip(again, together))
        five = [p.tree for p in draft_together(proposers[:5], ids[:5], depths[:5], nodes[:5]).proposals]  # 3 padding
        assert [paths(t).keys() for t in five] == [paths(a).keys() for a in alone[:5]]
    else:
        assert calls == [8] * 3  # levels 4: three calls after the root's children, each for all eight sequences
    for a, t in zip(alone, together):
        assert paths(t).keys() == paths(a).keys()
        torch.testing.assert_close(torch.tensor([paths(t)[p] for p in paths(a)]), torch.tensor(list(paths(a).values())),
                                   rtol=1e-5, atol=1e-6)  # to the last bits a product over other rows may change
        if not lookup_tokens:  # node for node; a grafted chain may reach a node alone that was not among the best
            assert t.tokens.tolist() == a.tokens.tolist() and t.parents.tolist() == a.parents.tolist()
    assert together[1].size == 4 and together[3].size == 2  # depth 1: the root's 3 children; two nodes
    assert max(int((t.parents >= 4).sum()) for t in together) > 0  # nodes of the third level


def test_a_batched_round_of_trees_grown_together_equals_each_request_alone():
    """Greedy eagle-tree requests of one pooled batch (their trees grown together) give each request's
    own tokens and accepted lengths, as decoded alone."""
    target = tiny_target(eos=True, seed=10)
    model = EagleModel.from_pretrained(target, drafter=tiny_drafter(target), total_tokens=8, depth=3, top_k=3,
                                       lookup_tokens=0)  # alone on CUDA: device rounds, which graft no lookups
    batch = prompts(6, seed=7)
    engine = ServingEngine(model, max_batch=6, load_sizing=False, cache_pool=True)
    for i, ids in enumerate(batch):
        engine.add(i, ids, RequestOptions(method="eagle-tree", max_new_tokens=16))
    tokens, lengths = {i: [] for i in range(6)}, {i: [] for i in range(6)}
    while engine.active or engine.queued:
        for event in engine.step():
            tokens[event.request_id].extend(event.new_token_ids)
            lengths[event.request_id].append(len(event.new_token_ids))
    for i, ids in enumerate(batch):
        alone = model.generate(ids, method="eagle-tree", max_new_tokens=16)
        assert tokens[i] == alone.token_ids and lengths[i] == alone.accept_lengths
    assert sum(map(len, lengths.values())) < sum(map(len, tokens.values()))  # drafts accepted


def test_pool_depths():
    assert pool_depths(2, 2) == [0, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]


def test_trees_grown_together_pay_their_phase_once_a_round():
    """``batch_tree_sizes`` with a group: its phase is paid once, with the first member that drafts. One good
    draft among eight sequences does not pay for a whole phase (all ones), though it pays for its share of
    one (the same cost split per sequence); eight do; whatever the choice, never below batched ``ar``."""
    flat = [1.0] * 64
    one_good = [[0.5]] + [[0.0]] * 7
    assert batch_tree_sizes(flat, one_good, [0.0] * 8, groups=["t"] * 8, group_seconds={"t": 0.2}) == [1] * 8
    assert batch_tree_sizes(flat, one_good, [0.2 / 8] * 8) == [2] + [1] * 7
    assert batch_tree_sizes(flat, [[0.3]] * 8, [0.0] * 8, groups=["t"] * 8, group_seconds={"t": 0.2}) == [2] * 8
    assert batch_tree_sizes(flat, [[0.3]] * 8, [0.0] * 8, groups=["t"] * 8, group_seconds={"t": 1.0}) == [1] * 8
    # two groups and a sequence of its own: each group's phase counted once, in the rate the choice is made by
    gains = [[0.4, 0.2]] * 3 + [[0.6, 0.1]] * 2 + [[0.3]]
    groups, phases = ["a"] * 3 + ["b"] * 2 + [None], {"a": 0.3, "b": 0.05}
    seconds = [1.0 + 0.02 * n for n in range(64)]
    sizes = batch_tree_sizes(seconds, gains, [0.01] * 6, groups=groups, group_seconds=phases)
    drafting = sum(phases[g] for g in {g for g, n in zip(groups, sizes) if n > 1 and g is not None})
    drafting += 0.01 * sum(n > 1 for n in sizes)
    kept = sum(sum(g[:n - 1]) for g, n in zip(gains, sizes))
    assert (6 + kept) / (drafting + seconds[sum(sizes) - 1]) >= 6 / seconds[5]
    assert max(sizes[3:5]) > 1  # the cheap group drafts


def test_the_engine_learns_a_groups_phase_and_lets_it_fade():
    """A batched engine of pooled greedy eagle-tree sequences records what its trees grown together took, once
    a round (``_phase_seconds``), sizes by it, and fades it in rounds without a tree."""
    from eagle.decoding.serving import DRAFT_FADE

    target = tiny_target(eos=False, seed=10)
    model = EagleModel.from_pretrained(target, drafter=tiny_drafter(target), total_tokens=8, depth=3, top_k=3)
    engine = ServingEngine(model, max_batch=4, load_sizing=True, cache_pool=True, row_seconds=[1.0] * 64)
    for i, ids in enumerate(prompts(4, seed=2)):
        engine.add(i, ids, RequestOptions(method="eagle-tree", max_new_tokens=30))
    engine.step()
    engine.step()
    assert engine._phase_seconds["eagle-tree"] > 0  # cheap rows: trees drafted together
    engine._phase_seconds["eagle-tree"] = 1e6  # a phase dearer than any gain: no trees
    for rounds in range(1, 3):
        assert all(e.stats.tree_size == 1 for e in engine.step())
        assert engine._phase_seconds["eagle-tree"] == pytest.approx(1e6 * DRAFT_FADE ** rounds)


def test_trees_grown_together_beside_sequences_drafting_alone(monkeypatch):
    """One pooled round holds greedy eagle-tree sequences (trees grown together), a sampled one (its drawn
    tree grown alone on the host path, with the same drafter pool), a chain (another group) and ``ar``: each
    greedy request's tokens and rounds are its own decoding's, and the sampled one finishes."""
    target = tiny_target(eos=True, seed=10)
    model = EagleModel.from_pretrained(target, drafter=tiny_drafter(target), total_tokens=8, depth=3, top_k=3,
                                       auto_length=False)
    batch = prompts(5, seed=11)
    options = [RequestOptions(method="eagle-tree", max_new_tokens=14), RequestOptions(method="ar", max_new_tokens=14),
               RequestOptions(method="eagle-tree", max_new_tokens=14, temperature=0.8, seed=3),
               RequestOptions(method="eagle-chain", max_new_tokens=14),
               RequestOptions(method="eagle-tree", max_new_tokens=14)]
    engine = ServingEngine(model, max_batch=5, load_sizing=False, cache_pool=True)
    groups = []
    together = batch_trees.draft_together
    monkeypatch.setattr("eagle.decoding.serving.draft_together",
                        lambda proposers, *a: groups.append(len(proposers)) or together(proposers, *a))
    results = generate_together(engine, batch, options)
    for ids, opts, result in zip(batch, options, results):
        if opts.temperature:
            assert 0 < len(result.token_ids) <= 14
            continue
        alone = model.generate(ids, method=opts.method, max_new_tokens=14)
        assert result.token_ids == alone.token_ids and result.accept_lengths == alone.accept_lengths, opts.method
    assert 2 in groups and 1 in groups  # the two greedy trees together; the chain, a group of its own
