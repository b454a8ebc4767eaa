import math

import numpy as np
import pytest
import torch

from eagle.decoding.tree import (Pool, best_frontier, chain_tree, graft_chains, kept_indices, ranked,
                                 static_layout, topk_children)
from eagle.decoding.tree_mask import tree_attention
from eagle.runtime.masks import host_tensor

from tests.conftest import test_device as device_under_test


def test_topk_children_scores_add_parent_score():
    lp = torch.log_softmax(torch.randn(3, 10), -1)
    tokens, scores = topk_children(torch.tensor([0.0, -1.0, -2.0]), lp, 4)
    assert tokens.shape == scores.shape == (3, 4)
    assert torch.allclose(scores, torch.tensor([0.0, -1.0, -2.0])[:, None] + lp.gather(1, tokens))
    assert (scores[:, :-1] >= scores[:, 1:]).all()


@pytest.mark.parametrize("shape", [(12288,), (1, 12288), (4, 5000), (2, 3, 1000), (3, 200)])
def test_ranked_is_a_stable_descending_sort_ties_and_infinities_included(shape):
    """``ranked`` (topk, then a sort of the k best, on long CPU rows) against the whole stable sort: the k best,
    best first, the lower index first on ties; rows with many ties, -inf and NaN included."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(40):
        scores = torch.randn(*shape, generator=gen)
        if trial % 3 == 0:
            scores = (scores * 4).round()  # ties everywhere, the k-th value's included
        if trial % 4 == 1:
            scores[..., : shape[-1] // 2] = float("-inf")
        if trial % 10 == 9:
            scores.view(-1)[7] = float("nan")
        for k in (1, 10, 64):
            expected = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
            assert torch.equal(ranked(scores, k), expected), (trial, k)


def brute_force_rerank(parents, scores, keep):
    """Sort all non-root nodes by (score desc, index asc); take ``keep``; check it is a subtree."""
    order = sorted(range(1, len(scores)), key=lambda i: (-scores[i], i))[:keep]
    return [0] + sorted(order)


def test_kept_indices_are_the_best_nodes_and_form_a_subtree():
    gen = torch.Generator().manual_seed(0)
    for trial in range(50):
        n = 2 + trial
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
        scores = [0.0]
        for i in range(1, n):  # a child scores at most its parent (log-probabilities are <= 0)
            drop = 0.0 if trial % 5 == 0 else -float(torch.rand(1, generator=gen))
            scores.append(scores[parents[i]] + drop)
        tokens = [100 + i for i in range(n)]
        keep = 1 + trial % 7
        tree = Pool(tokens, parents, scores).subtree(kept_indices(scores, keep + 1)).tree()
        expected = brute_force_rerank(parents, scores, keep)
        assert tree.tokens.tolist() == [100 + i for i in expected]
        assert tree.size <= keep + 1
        assert tree.parents[0] == -1 and all(0 <= p < i for i, p in enumerate(tree.parents.tolist()) if i)
        for i, p in enumerate(tree.parents.tolist()[1:], start=1):  # parent mapping preserved
            assert tree.tokens[p] - 100 == parents[int(tree.tokens[i]) - 100]


def token_paths(tokens, parents):
    """Brute force: node -> the tuple of tokens from the root's child down to it (root: ())."""
    paths = {}
    for i, p in enumerate(parents):
        paths[i] = () if p < 0 else paths[p] + (tokens[i],)
    return paths


def test_graft_chains_adds_exactly_the_chain_prefixes_below_its_node_and_keeps_a_pool():
    gen = torch.Generator().manual_seed(1)
    for trial in range(60):
        n = 1 + trial % 15
        parents, tokens, scores = [-1], [9], [0.0]
        while len(parents) < n:  # distinct tokens among siblings from a vocabulary of 4, so chains often overlap
            p = int(torch.randint(0, len(parents), (1,), generator=gen))
            free = [t for t in range(4) if all(not (q == p and tokens[j] == t) for j, q in enumerate(parents))]
            if not free:
                continue
            parents.append(p)
            tokens.append(free[int(torch.randint(0, len(free), (1,), generator=gen))])
            scores.append(scores[p] - float(torch.rand(1, generator=gen)))
        at = int(torch.randint(0, len(parents), (1,), generator=gen)) if trial % 2 else 0
        chain = torch.randint(0, 4, (1 + trial % 5,), generator=gen)
        chain_scores = scores[at] - torch.rand(chain.shape[0], generator=gen).cumsum(0)
        pool = Pool(list(tokens), list(parents), list(scores))
        out = graft_chains(pool, [(chain.tolist(), (chain_scores - scores[at]).tolist(), at)])
        before = token_paths(tokens, parents)
        after = token_paths(out.tokens, out.parents)
        prefixes = {before[at] + tuple(chain[:d].tolist()): float(chain_scores[d - 1])
                    for d in range(1, chain.shape[0] + 1)}
        assert set(after.values()) == set(before.values()) | set(prefixes) | {()}
        assert len(set(after.values())) == out.size  # no two siblings share a token
        assert out.tokens[:len(tokens)] == tokens and out.parents[:len(parents)] == parents
        assert pool.tokens == tokens and pool.scores == scores  # the pool itself is not changed
        assert all(0 <= p < i for i, p in enumerate(out.parents) if i)
        old = {path: scores[i] for i, path in before.items()}
        for i, path in after.items():
            want = max(old.get(path, -float("inf")), prefixes.get(path, -float("inf"))) if i else 0.0
            assert out.scores[i] == pytest.approx(want)
            if i:
                assert out.scores[i] <= out.scores[out.parents[i]] + 1e-6  # kept_indices' precondition still holds
        # several chains in one call: as grafting them one after another (the second at a node the first made)
        second = (torch.randint(0, 4, (3,), generator=gen).tolist(), [-0.5, -0.7, -1.5], out.size - 1)
        both = graft_chains(pool, [(chain.tolist(), (chain_scores - scores[at]).tolist(), at), second])
        one_by_one = graft_chains(out, [second])
        assert both.tokens == one_by_one.tokens and both.parents == one_by_one.parents
        assert both.scores == pytest.approx(one_by_one.scores)
        apart = graft_chains(pool, [(chain.tolist(), [0.0] * chain.shape[0], 0)] * 2, share=False)
        assert apart.size == pool.size + 2 * chain.shape[0]  # share=False: always new nodes


def test_best_frontier_is_stable():
    assert best_frontier([-1.0, -0.5, -0.5, -3.0], 2) == [1, 2]
    assert best_frontier([-1.0, -0.5], 5) == [1, 0]


def test_chain_tree():
    tree = chain_tree(7, torch.tensor([1, 2, 3]))
    assert tree.tokens.tolist() == [7, 1, 2, 3] and tree.parents.tolist() == [-1, 0, 1, 2]


def test_static_layout_from_choices():
    layout = static_layout([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    assert layout.parents.tolist() == [-1, 0, 0, 1, 1, 2, 3]
    assert layout.ranks.tolist() == [0, 0, 1, 0, 1, 0, 0]
    assert layout.depths.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert torch.equal(tree_attention(layout.parents).depths, layout.depths)
    with pytest.raises(ValueError):
        static_layout([[0, 1]])


def test_auto_tree_size_follows_the_cost_curve():
    from eagle.decoding.tree_sizing import CostCurve, choose_tree_size

    scores = torch.log(torch.tensor([0.9, 0.8, 0.7, 0.3, 0.1, 0.05, 0.01])).tolist()
    flat = CostCurve(sizes=[1, 64], seconds=[1.0, 1.0])  # a GPU-like curve: more tokens are free
    assert choose_tree_size(scores, flat.per_token, draft_seconds=0.0).size == 8
    steep = CostCurve(sizes=[1, 2, 64], seconds=[1.0, 2.0, 64.0])  # every token costs a full forward
    assert choose_tree_size(scores, steep.per_token, draft_seconds=0.0).size == 1
    cpu = CostCurve(sizes=[1, 4, 16, 64], seconds=[1.0, 1.5, 2.0, 4.4])
    choice = choose_tree_size(scores, cpu.per_token, draft_seconds=0.5)
    assert choice.size == 6 and choice.tokens_per_second == pytest.approx(3.8 / (0.5 + 1.5 + 0.5 * 2 / 12))
    assert cpu.at(8) == pytest.approx(1.5 + 0.5 * 4 / 12) and cpu.at(128) == pytest.approx(8.8)


def test_a_deeper_tree_is_drafted_only_where_it_pays():
    from eagle.decoding.tree_sizing import CostCurve, expansion_floor

    curve = CostCurve(sizes=[1, 2, 3, 4], seconds=[1.0, 1.1, 1.3, 1.8]).per_token
    pool = [math.log(0.6), math.log(0.2)]  # the root's children, both expandable
    # the 0.6 node's best child expected at 0.6 * 0.8: root + 2 nodes, 2.08 tokens in 0.2 + 1.3 s, beat the
    # best size now (root + 1 node, 1.6 tokens in 0.1 + 1.1 s); the 0.2 node's child would not be kept
    floor = expansion_floor(pool, pool, curve, draft_seconds=0.1, step_seconds=0.1, child_logprob=math.log(0.8))
    assert floor == pytest.approx(math.log(0.6))
    assert expansion_floor(pool, pool, curve, 0.1, step_seconds=0.3, child_logprob=math.log(0.8)) is None  # dear call
    assert expansion_floor(pool, pool, curve, 0.1, 0.1, child_logprob=math.log(0.5)) is None  # unlikely child
    assert expansion_floor(pool, pool, curve, 0.1, 0.1, math.log(0.8), calibration=[0.5]) is None  # overconfident
    assert expansion_floor(pool, pool[1:], curve, 0.1, 0.1, math.log(0.8)) is None  # only the 0.2 node can grow
    free = CostCurve(sizes=[1, 64], seconds=[1.0, 1.0]).per_token  # more tokens cost nothing: every candidate grows
    assert expansion_floor(pool, pool, free, 0.1, 0.0, math.log(0.8)) == pytest.approx(math.log(0.2))


def test_sizing_maps_the_curve_onto_measured_round_costs_by_weighted_least_squares():
    from eagle.decoding.tree_sizing import measured_costs

    prior = [1.0, 2.0, 3.0, 4.0, 5.0]
    assert measured_costs(prior, {}, {}) == prior
    assert measured_costs(prior, {2: 3.0, 4: 7.0, 9: 1.0}, {}) == pytest.approx([1.0, 3.0, 5.0, 7.0, 9.0])  # 2x - 1
    assert measured_costs(prior, {1: 0.5}, {1: 4.0}) == pytest.approx([0.5, 1.5, 2.5, 3.5, 4.5])  # one size: a shift
    assert measured_costs(prior, {1: 1.0, 2: 100.0}, {})[:2] == pytest.approx([49.0, 52.0])  # slope at most 3
    rng = np.random.default_rng(0)  # against numpy's weighted fit
    measured = {n: 0.7 + 1.3 * prior[n - 1] + rng.normal(0, 0.1) for n in (1, 3, 4)}
    weights = {1: 2.0, 3: 5.0, 4: 1.0}
    a, b = np.polyfit([prior[n - 1] for n in measured], list(measured.values()), 1,
                      w=[math.sqrt(weights[n]) for n in measured])
    assert measured_costs(prior, measured, weights) == pytest.approx([a * x + b for x in prior])


def test_sizing_learns_calibration_per_rank_and_running_costs():
    from eagle.decoding.tree_sizing import (AVERAGING, CALIBRATED_RANKS, CHILD_PROB_PRIOR, PRIOR_MASS, REFIT_ROUNDS, CostCurve,
                              Sizing, choose_tree_size)

    sizing = Sizing(CostCurve(sizes=[1, 2, 3], seconds=[1.0, 2.0, 3.0]))
    assert sizing.calibration == [1.0] * CALIBRATED_RANKS  # face value
    assert sizing.costs == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]  # the curve, extrapolated as choose_tree_size reads it
    for _ in range(10):  # the best draft said 0.5 and was always accepted, the second said 0.4 and never was
        sizing.record_drafts([0.5, 0.4, 0.1, 0.1], [True, False, False, True])
    assert sizing.calibration == pytest.approx([(10 + PRIOR_MASS) / (5 + PRIOR_MASS), 0.25,
                                                (10 + PRIOR_MASS) / (2 + PRIOR_MASS)])  # the third rank: all past it
    scores = [math.log(0.5), math.log(0.4)]
    flat = [1.0, 1.0, 1.0]
    assert choose_tree_size(scores, flat, 0.0).tokens_per_second == pytest.approx(1.9)
    assert choose_tree_size(scores, flat, 0.0, sizing.calibration).tokens_per_second == pytest.approx(
        1 + 0.5 * sizing.calibration[0] + 0.4 * 0.25)
    calibration = list(sizing.calibration)
    sizing.record_round(2, 2.5)  # a size not timed before: fitted at once
    assert sizing.calibration == calibration  # timing a round leaves what the drafts taught alone
    assert sizing.costs[:3] == pytest.approx([1.5, 2.5, 3.5])  # one size measured: the curve shifted onto it
    sizing.record_round(2, 3.5)  # a running average: the first sets it
    assert sizing.round_seconds == {2: pytest.approx(2.5 + AVERAGING)} and sizing.rounds == {2: 2}
    assert sizing.costs[:3] == pytest.approx([1.5, 2.5, 3.5])  # not refitted for every round
    for _ in range(REFIT_ROUNDS - 1):
        sizing.record_round(2, 2.5 + AVERAGING)
    assert sizing.costs[:3] == pytest.approx([1.6, 2.6, 3.6])
    sizing.record_step(0.2, [0.9, 0.9])
    assert sizing.step_seconds == 0.2 and sizing.child_prob > CHILD_PROB_PRIOR


@pytest.mark.timed_gate
def test_draft_gate_stops_drafting_where_it_does_not_pay_and_probes_again():
    """Drafting rounds of 1.5 tokens in 2 s lose to plain rounds of 1 token in 1 s: the gate stops
    drafting, probes again after 8 plain rounds, then 16, 32 and 64 at most while probes lose;
    once a round's drafts pay again (4 tokens in 2 s) the next probe finds it (a probe weighs more than a
    round: what drafting gave long ago is stale), and it drafts every round but one plain round in
    ``PLAIN_EVERY[1]`` (what drafting must beat, measured again), its patience reset."""
    from eagle.decoding.tree_sizing import PLAIN_EVERY, PROBE_ROUNDS, DraftGate

    gate, plan = DraftGate(), []
    assert gate.drafts(1.0)  # nothing seen: draft
    for _ in range(400):
        drafts = gate.drafts(1.0)
        plan.append(drafts)
        gate.record(drafts, 1 if not drafts else 1.5, 1.0 if not drafts else 2.0, 1.0)
    probes = [i for i, d in enumerate(plan) if d]
    assert probes[0] == 0 and all(not d for d in plan[1:9]) and plan[9]
    gaps = [b - a - 1 for a, b in zip(probes, probes[1:])]
    assert gaps[:4] == [8, 16, 32, 64] and set(gaps[4:]) == {PROBE_ROUNDS[1]}
    assert not gate.pays(1.0)
    for _ in range(PROBE_ROUNDS[1] + 4 * PLAIN_EVERY[1]):
        drafts = gate.drafts(1.0)
        plan.append(drafts)
        gate.record(drafts, 1 if not drafts else 4, 1.0 if not drafts else 2.0, 1.0)
    plain = [k for k, d in enumerate(plan[-3 * PLAIN_EVERY[1]:]) if not d]
    assert len(plain) >= 2 and {b - a for a, b in zip(plain, plain[1:])} == {PLAIN_EVERY[1] + 1}
    assert gate.patience == PROBE_ROUNDS[0]
    # before any plain round the estimate stands for one: 1.5 tokens in 2 s pay against 2 s a token
    gate = DraftGate()
    gate.record(True, 1.5, 2.0, 2.0)
    assert gate.drafts(2.0) and not gate.drafts(1.0)


@pytest.mark.timed_gate
def test_draft_gate_measures_a_plain_round_instead_of_trusting_the_estimate():
    """An estimate of a plain round drawn from drafting rounds' own costs (3 s against drafting's 2 s for 1.5
    tokens) would keep drafting forever; after ``PLAIN_EVERY[0]`` drafting rounds one plain round (1 s)
    is measured, and the gate stops drafting. A negative control without the plain round keeps drafting."""
    from eagle.decoding.tree_sizing import PLAIN_EVERY, DraftGate

    def plan(gate: DraftGate, rounds: int) -> list[bool]:
        out = []
        for _ in range(rounds):
            drafts = gate.drafts(3.0)
            out.append(drafts)
            gate.record(drafts, 1.5 if drafts else 1, 2.0 if drafts else 1.0, 3.0)
        return out

    drafted = plan(DraftGate(), 40)
    assert drafted[:PLAIN_EVERY[0]] == [True] * PLAIN_EVERY[0] and not drafted[PLAIN_EVERY[0]]
    assert drafted[PLAIN_EVERY[0]:].count(True) <= 3  # probes only
    control = DraftGate(since_plain=-10**9)  # never due for a plain round
    assert all(plan(control, 40))


def test_measured_costs_are_fitted_non_decreasing_by_least_squares():
    """Against brute force: the best non-decreasing fit on a grid is no better than the PAV fit."""
    import itertools

    from eagle.decoding.tree_sizing import non_decreasing

    assert non_decreasing([43.0, 46.0, 37.5, 39.7, 43.8, 54.0]) == pytest.approx([41.55] * 4 + [43.8, 54.0])
    assert non_decreasing([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0] and non_decreasing([]) == []
    gen = torch.Generator().manual_seed(0)
    grid = [i / 4 for i in range(13)]  # 0 .. 3 in quarters
    for _ in range(20):
        values = (torch.randint(0, 13, (4,), generator=gen) / 4).tolist()
        fit = non_decreasing(values)
        assert all(a <= b for a, b in zip(fit, fit[1:])) and sum(fit) == pytest.approx(sum(values))
        loss = sum((f - v) ** 2 for f, v in zip(fit, values))
        best = min(sum((f - v) ** 2 for f, v in zip(c, values))
                   for c in itertools.combinations_with_replacement(grid, 4))
        assert loss <= best + 1e-9


def test_a_cost_step_is_seen_and_the_tree_stops_below_it(target):
    """CPU kernels block their rows: 6 tree tokens cost what 1 does and 7 a step more. The curve
    is measured at every small size, and the non-decreasing fit keeps a real step, so auto stops
    below it; the old coarse curve (1, 4, 8, a line between) put 6 near 8 and chose 8."""
    from eagle.decoding.tree_sizing import SIZES, CostCurve, choose_tree_size, measure_cost_curve, non_decreasing

    scores = torch.log(torch.tensor([0.9, 0.8, 0.7, 0.6, 0.5, 0.3, 0.25, 0.1])).tolist()
    stepped = CostCurve(sizes=list(range(1, 9)), seconds=non_decreasing([1.0, 1.1, 1.0, 1.0, 1.0, 1.0, 1.15, 1.2]))
    assert stepped.seconds[5] == pytest.approx(1.02) and stepped.seconds[6] == 1.15  # the step survives the fit
    assert choose_tree_size(scores, stepped.per_token, draft_seconds=0.2).size == 6
    coarse = CostCurve(sizes=[1, 4, 8], seconds=[1.05, 1.05, 1.15])
    assert choose_tree_size(scores, coarse.per_token, draft_seconds=0.2).size == 8
    curve = measure_cost_curve(target, repeats=1)
    assert measure_cost_curve(target, sizes=(1, 4), repeats=1, greedy=True).sizes == [1, 4]
    assert curve.sizes == list(SIZES) and all(s > 0 for s in curve.seconds)
    assert all(n in curve.sizes for n in range(1, 17))


def test_a_noisy_cost_curve_is_measured_again_a_few_times_the_least_noisy_kept(target, tmp_path, monkeypatch):
    """A curve measured while the machine was busy (timings spread more than ``NOISY``) serves the
    process that measured it (measured once) and is kept on disk, but later processes measure
    again, up to ``NOISY_TRIES`` measurements, keeping the least noisy: then it is read back, as a
    steady curve is at once."""
    import eagle.decoding.tree_sizing as budget

    assert budget.relative_spread([1.0]) == 0.0
    assert budget.relative_spread([1.0, 1.0, 1.0, 1.0, 1.0]) == 0.0
    assert budget.relative_spread([1.0, 1.0, 2.0, 3.0, 3.0]) == pytest.approx(1.0)  # IQR 2 over median 2
    monkeypatch.setenv("EAGLE_CACHE", str(tmp_path))
    monkeypatch.setattr(budget, "NOISY_TRIES", 3)
    spreads = [0.5, 0.3, 0.4, 0.01]
    measured = []

    def fake_measure(t, greedy=False, sizes=None):
        measured.append(spreads[len(measured)])
        return budget.CostCurve(sizes=[1, 2], seconds=[1.0, 1.0 + measured[-1]], spread=measured[-1])

    def new_process():
        monkeypatch.setattr(budget, "_MEASURED", {})

    monkeypatch.setattr(budget, "measure_cost_curve", fake_measure)
    new_process()
    noisy = budget.cost_curve(target)
    assert noisy.spread == 0.5 and budget.cost_curve(target) is noisy and len(measured) == 1
    assert len(list(tmp_path.rglob("*.json"))) == 1
    new_process()
    assert budget.cost_curve(target).spread == 0.3 and len(measured) == 2
    new_process()
    third = budget.cost_curve(target)
    assert (third.spread, third.seconds, third.measurements) == (0.3, [1.0, 1.3], 3) and len(measured) == 3
    new_process()
    assert budget.cost_curve(target) == third and len(measured) == 3  # tried enough: read back from disk
    new_process()
    steady = budget.cost_curve(target, greedy=True)  # greedy rounds have a curve of their own
    assert steady.spread == 0.01 and steady.measurements == 1 and len(measured) == 4
    new_process()
    assert budget.cost_curve(target, greedy=True) == steady and len(measured) == 4
    assert len(list(tmp_path.rglob("*.json"))) == 2


def drawn(parent_scores, lp, k, temperature, gen):
    from eagle.decoding.tree import drawn_children

    uniform = torch.rand(lp.shape, generator=gen)
    return drawn_children(parent_scores, lp, k, temperature, lp.shape[-1], uniform)[:2]


def test_drawn_children_are_draws_without_replacement_scored_by_rank():
    """First draw ~ softmax(logprobs / T); second draw ~ q(b | not a) summed over a; the scores
    are the parent's plus the top-k log-probabilities whatever was drawn."""
    q = torch.tensor([0.5, 0.3, 0.15, 0.05])
    lp = q.log()[None].expand(20000, -1)
    gen = torch.Generator().manual_seed(0)
    tokens, scores = drawn(torch.full((20000,), -1.0), lp, 2, 1.0, gen)
    assert torch.allclose(scores, (-1.0 + q.log().topk(2).values).expand(20000, -1))
    assert (tokens[:, 0] != tokens[:, 1]).all()
    first = torch.bincount(tokens[:, 0], minlength=4) / 20000.0
    second = torch.bincount(tokens[:, 1], minlength=4) / 20000.0
    expect_second = torch.stack([sum(q[a] * q[b] / (1 - q[a]) for a in range(4) if a != b) for b in range(4)])
    assert (first - q).abs().max() < 0.015 and (second - expect_second).abs().max() < 0.015
    cold = torch.softmax(q.log() / 0.5, -1)  # temperature 0.5 sharpens the draws
    tokens, _ = drawn(torch.zeros(20000), lp, 1, 0.5, gen)
    assert (torch.bincount(tokens[:, 0], minlength=4) / 20000.0 - cold).abs().max() < 0.015


def test_host_tensor_is_torch_tensor_of_the_list():
    cases = [([3, -1, 2 ** 40], torch.long), ([0.0, -1.5, -3.25e-3], torch.float32), ([], torch.long)]
    for values, dtype in cases:
        made = host_tensor(values, dtype)
        assert made.dtype == dtype and made.device.type == "cpu"
        assert torch.equal(made, torch.tensor(values, dtype=dtype))


def toy_drafter(vocab: int = 6, seed: int = 0):
    """A drafter of elementwise operations only (each row's values the same in any batch): a node's
    prediction is f(its parent's prediction, its token); log-probabilities rounded to halves, so that
    siblings and cousins tie often. -> (logprobs(rows [N, V]) -> [N, V], predict(h [..., V], token [...]))."""
    gen = torch.Generator().manual_seed(seed)
    embed, bias = torch.randn(vocab, vocab, generator=gen), torch.randn(vocab, generator=gen)

    def logprobs(rows):
        return -torch.round(2 * (rows + bias).abs()) / 2 - 0.5

    def predict(h, token):
        return torch.tanh(1.3 * h + embed[token])

    return logprobs, predict


def brute_force_pool(hidden, k, calls, logprobs, predict):
    """EAGLE-2's pool by its definition, one node at a time, ties to the first in pool order: the
    root's k best children, then ``calls`` times the k best of the newest level expanded ->
    [(path, score)] in pool order (the root first)."""
    def kids(path, h, score):
        lp = logprobs(h[None])[0].tolist()
        best = sorted(range(len(lp)), key=lambda v: (-lp[v], v))[:k]
        return [(path + [v], h, score + lp[v]) for v in best]  # (path, its parent's prediction, score)

    level = kids([], hidden, 0.0)
    pool = [([], 0.0)] + [(p, s) for p, _, s in level]
    for _ in range(calls):
        frontier = sorted(range(len(level)), key=lambda i: -level[i][2])[:k]  # stable: the first on ties
        level = [c for i in frontier
                 for c in kids(level[i][0], predict(level[i][1], torch.tensor(level[i][0][-1])), level[i][2])]
        pool += [(p, s) for p, _, s in level]
    return pool


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("k, calls, total", [(2, 3, 6), (3, 2, 9), (3, 3, 30)])
def test_grown_pools_are_brute_force_eagle2_ties_included(batch, k, calls, total):
    """``tree.grow_pools`` (the device rounds' and the batched engine's grower) with ranked children,
    then ``kept_pool``: each sequence of a batch gets the pool and the kept nodes of EAGLE-2 by its
    definition, ties going to the first in pool order (the host path's order)."""
    from eagle.decoding.tree import grow_pools, kept_pool, topk_children

    device = device_under_test()
    logprobs, predict = toy_drafter()
    draft_ids = torch.arange(6) + 100
    gen = torch.Generator().manual_seed(batch * 10 + k)
    hidden = torch.randn(batch, 6, generator=gen)

    def step(d, inputs, tokens, earlier):
        return predict(inputs.cpu(), tokens.cpu() - 100).to(device)

    tokens, parents, scores, frontiers = grow_pools(
        hidden.to(device), torch.arange(batch, device=device), k, calls, lambda rows: logprobs(rows.cpu()).to(device),
        lambda s, lp, row: topk_children(s, lp, k), step, draft_ids.to(device))
    assert tokens.shape == parents.shape == scores.shape == (batch, 1 + k + calls * k * k)
    assert len(frontiers) == calls
    kept = kept_pool(scores, total).cpu()
    tokens, parents, scores = tokens.cpu(), parents.cpu(), scores.cpu()
    ties = 0
    for b in range(batch):
        want = brute_force_pool(hidden[b], k, calls, logprobs, predict)
        paths = [[]]
        for i in range(1, tokens.shape[1]):
            paths.append(paths[int(parents[b, i])] + [int(tokens[b, i]) - 100])
        assert int(tokens[b, 0]) == b
        assert [(p, float(s)) for p, s in zip(paths, scores[b])] == want
        keep = [0] + sorted(sorted(range(1, len(want)), key=lambda i: -want[i][1])[:total - 1])
        assert kept[b].tolist() == keep
        ties += len(set(s for _, s in want)) < len(want)
    assert ties  # the case has ties: the order among them is checked


@pytest.mark.parametrize("k, calls, total, rows_run", [(2, 3, 4, "fewer"), (3, 2, 5, "fewer"), (3, 3, 9, None),
                                                       (3, 3, 30, "all")])
def test_a_host_pool_expanding_only_what_can_be_kept_keeps_brute_force_eagle2(k, calls, total, rows_run):
    """``tree.growing`` as the host drives it (B = 1, ``EagleDrafter._to_expand``'s rule: of each expansion's
    k best children only those among the best ``total - 2`` of the pool so far run, and none when none
    does): fewer drafter rows, the same kept paths as EAGLE-2 by its definition, ties included."""
    logprobs, predict = toy_drafter()
    for seed in range(6):
        check_host_pool(torch.randn(6, generator=torch.Generator().manual_seed(seed)), k, calls, total, rows_run,
                        logprobs, predict)


def check_host_pool(hidden, k, calls, total, rows_run, logprobs, predict):
    from eagle.decoding.tree import growing, kept_indices, ranked

    def select(d, flat, pool):
        best, scores = ranked(flat, k)[0].tolist(), sorted(pool[0, 1:].tolist(), reverse=True)
        floor = scores[min(total - 2, len(scores)) - 1] if total > 2 else float("inf")
        return torch.tensor([[j for j in best if flat[0, j] >= floor]], dtype=torch.long)

    run, rows = growing(torch.tensor([0]), k, calls, select), 0
    node, out = next(run), hidden[None, None]
    while True:
        if node.d:
            out = predict(out.gather(1, node.rows[:, :, None].expand(-1, -1, 6)), node.tokens - 100)
            rows += node.nodes.shape[1]
        picks, scores = topk_children(node.scores, logprobs(out), k)
        try:
            node = run.send((picks + 100, scores))
        except StopIteration as stop:
            tokens, parents, scores = (t[0].tolist() for t in stop.value)
            break
    paths = [[]]
    for i in range(1, len(tokens)):
        paths.append(paths[parents[i]] + [tokens[i] - 100])
    want = brute_force_pool(hidden, k, calls, logprobs, predict)
    keep = sorted(range(1, len(want)), key=lambda i: -want[i][1])[:total - 1]
    kept = kept_indices(scores, total)
    assert sorted((paths[i], scores[i]) for i in kept[1:]) == sorted(want[i] for i in keep)
    if rows_run == "fewer":
        assert rows < calls * k
    elif rows_run == "all":
        assert rows == calls * k


@pytest.mark.timed_gate
def test_draft_gate_probes_at_the_start_of_each_generation():
    """A gate that stopped drafting (its patience grown to the most plain rounds) probes in a new generation's
    first round, and that probe alone sets the drafting averages: 4 tokens in 2 s against 1 in 1 s resume drafting at
    once. Without ``start`` (the control) the same generation waits out its patience."""
    from eagle.decoding.tree_sizing import PROBE_ROUNDS, DraftGate

    def stopped() -> DraftGate:
        gate = DraftGate()
        for _ in range(300):  # drafting rounds lose: probes every PROBE_ROUNDS[1] plain rounds at last
            drafts = gate.drafts(1.0)
            gate.record(drafts, 1 if not drafts else 1.5, 1.0 if not drafts else 2.0, 1.0)
        assert gate.patience == PROBE_ROUNDS[1] and not gate.pays(1.0)
        while gate.waited:  # just after a probe
            drafts = gate.drafts(1.0)
            gate.record(drafts, 1 if not drafts else 1.5, 1.0 if not drafts else 2.0, 1.0)
        return gate

    def plan(gate: DraftGate, rounds: int) -> list[bool]:
        out = []
        for _ in range(rounds):
            drafts = gate.drafts(1.0)
            out.append(drafts)
            gate.record(drafts, 1 if not drafts else 4, 1.0 if not drafts else 2.0, 1.0)
        return out

    gate = stopped()
    gate.start()
    assert plan(gate, 4) == [True] * 4
    assert not any(plan(stopped(), 4))
