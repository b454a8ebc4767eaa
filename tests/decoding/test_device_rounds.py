"""Device rounds (``eagle.decoding.device_rounds``): each piece against its host-path twin or a brute
force, greedy output identical to ``ar``, and one host read per round."""

from __future__ import annotations

import collections
import math
import dataclasses
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from eagle import EagleModel
from eagle.config import SamplingConfig, TreeConfig
from eagle.decoding import acceptance
from eagle.decoding.device_rounds import (DeviceDraws, DeviceTree, ancestor_matrix, device_rounds_apply, drawn_accept,
                                          greedy_accept, sampled_accept, select_tree)
from eagle.decoding.tree import Pool, drawn_children, kept_indices
from eagle.decoding.tree_mask import tree_attention
from eagle.errors import EagleError
from eagle.runtime.fake_capture import syncs

from tests.conftest import prompts, tiny_drafter, tiny_target
from tests.conftest import test_device as device_under_test
from tests.decoding.test_proposers import brute_force_eagle2, flat_pair, target_prefill


def random_tree(rng: random.Random, n: int) -> list[int]:
    return [-1] + [rng.randrange(i) for i in range(1, n)]


def depth_of(parents: list[int]) -> list[int]:
    depths = []
    for parent in parents:
        depths.append(0 if parent < 0 else depths[parent] + 1)
    return depths


def device_tree(tokens: list[int], parents: list[int]) -> DeviceTree:
    depths = depth_of(parents)
    p = torch.tensor(parents)
    return DeviceTree(torch.tensor(tokens), p, torch.zeros(len(parents)), torch.tensor(depths),
                      ancestor_matrix(p, max(depths)), max(depths))


def test_ancestor_matrix_is_the_tree_mask():
    rng = random.Random(0)
    for n in (1, 2, 5, 17, 40):
        parents = random_tree(rng, n)
        p = torch.tensor(parents)
        assert torch.equal(ancestor_matrix(p, max(depth_of(parents))), tree_attention(p).mask)
        if max(depth_of(parents)) > 1:  # too few steps up miss the deepest ancestors
            assert not torch.equal(ancestor_matrix(p, max(depth_of(parents)) - 1), tree_attention(p).mask)


def test_select_tree_keeps_what_the_host_path_keeps_ties_included():
    rng = random.Random(1)
    for trial in range(30):
        m = rng.randrange(2, 40)
        parents = random_tree(rng, m)
        scores = [0.0]
        for i in range(1, m):  # a child scores no higher than its parent; coarse values make ties
            scores.append(scores[parents[i]] - rng.choice([0.0, 0.5, 1.0]))
        tokens = [rng.randrange(100) for _ in range(m)]
        depths = depth_of(parents)
        total = rng.randrange(1, m + 1)
        got = select_tree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(scores), torch.tensor(depths),
                          total, max(depths))
        want = Pool(tokens, parents, scores).subtree(kept_indices(scores, total)).tree()
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.parents, want.parents)
        assert torch.equal(got.scores, want.scores)
        assert got.depths.tolist() == depth_of(want.parents.tolist())
        assert torch.equal(got.ancestors, tree_attention(want.parents).mask)


def test_greedy_accept_is_the_host_rule():
    rng = random.Random(2)
    for trial in range(200):
        n = rng.randrange(1, 20)
        parents = random_tree(rng, n)
        tokens = [rng.randrange(3) for _ in range(n)]
        for child in range(1, n):  # siblings carry distinct tokens, as top-k children do
            while tokens[child] in [tokens[s] for s in range(1, child) if parents[s] == parents[child]]:
                tokens[child] = rng.randrange(50)
        argmax = torch.tensor([rng.randrange(3) for _ in range(n)])
        tree = device_tree(tokens, parents)
        got = greedy_accept(tree, argmax)
        want = acceptance.greedy_tree(tree.tokens, tree.parents, tree_attention(tree.parents).paths, argmax)
        count = int(got.count)
        assert got.path[:count].tolist() == want.nodes.tolist()
        assert int(got.next_token) == want.next_token


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("total", [2, 5, 9, 40])
@pytest.mark.parametrize("graphs", [False, True])
def test_device_draft_is_brute_force_eagle2(request, kind, total, graphs):
    """The fixed-shape tree: the k best frontier nodes expanded at every depth, the best
    ``total - 1`` of the pool kept, each with its score, as EAGLE-2's code does (brute force:
    every node's feature recomputed from scratch). ``graphs``: the whole phase as one static
    function on the static path (replayed as one graph on CUDA), twice (the second a replay)."""
    depth, k = 4, 3
    target, flat = flat_pair(request, kind)
    model = EagleModel.from_pretrained(target, drafter=flat, total_tokens=total, depth=depth, top_k=k, lookup_tokens=0,
                                       drafter_dtype=torch.float32, device_rounds=True, cuda_graphs=graphs)
    ids = [3, 9, 4, 17, 8, 2, 11]
    prefill = target_prefill(target, ids, tuple(flat.config.aux_layers))
    drafter = model._device_drafter("eagle-tree", SamplingConfig())
    drafter.start()
    drafter.extend(prefill.features[0], torch.tensor(ids[1:], device=target.device))
    for _ in range(2):
        tree, draws = drafter.draft(torch.tensor([ids[-1]], device=target.device), depth + 1)
    assert draws is None  # greedy: the top-k children
    assert drafter.cache.get_seq_length() == len(ids) - 1  # the round's nodes are gone from the drafter's cache
    runner = getattr(drafter.drafter, "runner", None)
    assert (runner is not None) == graphs
    assert not graphs or any(key[0] == "draft phase" for key in runner.shapes)
    paths, tokens, scores = {0: ()}, tree.tokens.tolist(), tree.scores.tolist()
    for i, parent in enumerate(tree.parents.tolist()[1:], start=1):
        paths[i] = paths[parent] + (tokens[i],)
    got = {paths[i]: scores[i] for i in range(1, tree.size)}
    proposer = model._proposer("eagle-tree", SamplingConfig(), torch.Generator())
    want = brute_force_eagle2(proposer, ids, prefill.features[0], depth, k, total)
    assert got.keys() == want.keys()
    assert [got[p] for p in want] == pytest.approx(list(want.values()), abs=1e-4)
    assert tree.depths.tolist() == [len(paths[i]) for i in range(tree.size)]


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("method", ["eagle-tree", "eagle-chain"])
def test_greedy_device_rounds_equal_ar(kind_pair, graphs, method):
    target, drafter = kind_pair
    for options in (dict(total_tokens=12, depth=4, top_k=3, lookup_tokens=0),
                    dict(total_tokens=40, depth=5, top_k=4, lookup_tokens=0)):
        model = EagleModel.from_pretrained(target, drafter=drafter, cuda_graphs=graphs, device_rounds=True, **options)
        for ids in prompts(8, seed=4):
            got = model.generate(ids, method=method, max_new_tokens=24)
            assert got.token_ids == model.generate(ids, method="ar", max_new_tokens=24).token_ids
            assert sum(got.accept_lengths) == len(got.token_ids) and got.target_forwards == len(got.accept_lengths)


def test_tree_and_chain_share_a_drafter_but_not_its_draft_phase(target, drafter):
    """One model's ``eagle-tree`` and ``eagle-chain`` draft through the same static drafter (one
    runner, one cache); each keeps its own tree shape whichever ran first."""
    options = dict(drafter=drafter, total_tokens=12, depth=4, top_k=3, lookup_tokens=0, cuda_graphs=True,
                   device_rounds=True)
    ids = prompts(3, seed=11)
    alone = {m: [EagleModel.from_pretrained(target, **options).generate(p, method=m, max_new_tokens=24).accept_lengths
                 for p in ids] for m in ("eagle-chain", "eagle-tree")}
    shared = EagleModel.from_pretrained(target, **options)
    for method in ("eagle-tree", "eagle-chain", "eagle-tree"):
        assert [shared.generate(p, method=method, max_new_tokens=24).accept_lengths for p in ids] == alone[method]


def test_device_rounds_accept_deep_paths():
    """On a peaked target with a vocabulary of 8, drafts are accepted several deep in some rounds:
    identity with ``ar`` alone would also hold for trees that are never accepted."""
    target = tiny_target(vocab_size=8, seed=1, init_std=1.0)
    drafter = tiny_drafter(target, seed=2)
    model = EagleModel.from_pretrained(target, drafter=drafter, total_tokens=20, depth=4, top_k=4, lookup_tokens=0,
                                       device_rounds=True)
    host = EagleModel.from_pretrained(target, drafter=drafter, total_tokens=20, depth=4, top_k=4, lookup_tokens=0,
                                      device_rounds=False)
    got = [model.generate(ids, method="eagle-tree", max_new_tokens=40) for ids in prompts(6, vocab_size=8, seed=3)]
    want = [host.generate(ids, method="ar", max_new_tokens=40) for ids in prompts(6, vocab_size=8, seed=3)]
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert max(max(g.accept_lengths) for g in got) >= 3


def test_generation_stops_at_eos_and_at_the_context_end():
    target = tiny_target(vocab_size=16, seed=2, eos=True, max_positions=48)
    model = EagleModel.from_pretrained(target, drafter=tiny_drafter(target, seed=3), total_tokens=16, depth=5, top_k=3,
                                       lookup_tokens=0, device_rounds=True, cuda_graphs=True)
    for ids in prompts(6, vocab_size=16, seed=9):
        for budget in (1, 5, 60):
            got = model.generate(ids, method="eagle-tree", max_new_tokens=budget)
            want = model.generate(ids, method="ar", max_new_tokens=budget)
            assert got.token_ids == want.token_ids and got.stop_reason == want.stop_reason


class SyncCounter(TorchDispatchMode):
    """Counts the operations that make a CUDA host wait for the device (``fake_capture.syncs``: a
    value read, or an output size that depends on the data)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # a read of a CPU tensor (e.g. a seed drawn from the caller's CPU generator) waits for no device
        if syncs(func, args, kwargs or {}) and (device_under_test().type == "cpu" or any(
                isinstance(a, torch.Tensor) and a.device.type != "cpu" for a in args)):
            self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def host_reads(model: EagleModel, monkeypatch, **generate) -> tuple[collections.Counter, int]:
    """What one generation reads back to the host: (syncing ops, ``.tolist()`` calls) and its rounds."""
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(1) or tolist(self))
    with SyncCounter() as counter:
        result = model.generate(**generate)
    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    counts = counter.counts + collections.Counter({"tolist": len(reads)})
    return counts, len(result.accept_lengths)


@pytest.mark.parametrize("temperature, sampled_tree", [(0.0, False), (1.0, False), (1.0, True)])
def test_a_round_reads_the_device_once(target, drafter, monkeypatch, temperature, sampled_tree):
    """On the static path (what a GPU runs), with the greedy head that reads candidates on a CPU
    switched off (a GPU has none): one ``.tolist()`` a round and nothing else that waits, children
    drawn or not. The host path, the control, reads many times a round."""
    monkeypatch.setattr(target.lean, "greedy_head", None)
    options = dict(drafter=drafter, total_tokens=12, depth=4, top_k=3, lookup_tokens=0, cuda_graphs=True,
                   sampled_tree=sampled_tree, draw_support=8)
    device = EagleModel.from_pretrained(target, device_rounds=True, **options)
    host = EagleModel.from_pretrained(target, device_rounds=False, **options)
    generate = dict(prompt=[3, 4, 5, 6, 7, 3, 4], method="eagle-tree", max_new_tokens=20, temperature=temperature,
                    seed=0)
    device.generate(**generate)  # first use: kernels, graphs, layouts
    counts, rounds = host_reads(device, monkeypatch, **generate)
    assert counts == collections.Counter({"tolist": rounds})
    counts, rounds = host_reads(host, monkeypatch, **generate)
    assert sum(counts.values()) > 3 * rounds


def test_device_rounds_default_on_cuda_only_and_fall_back_where_the_tree_needs_the_host(target, drafter):
    """Drawn children (the default when sampling) run in device rounds too; static trees do not. Options device
    rounds cannot honour (prompt-lookup grafts, total_tokens "auto") keep the host path by default and are an
    error with device_rounds=True: an option means the same on every path."""
    model = EagleModel.from_pretrained(target, drafter=drafter)
    assert model.device_rounds == (target.device.type == "cuda")
    with pytest.raises(EagleError, match="device_rounds"):
        EagleModel.from_pretrained(target, drafter=drafter, device_rounds="yes")
    on = EagleModel.from_pretrained(target, drafter=drafter, device_rounds=True, total_tokens=12, lookup_tokens=0)
    greedy, sampled = SamplingConfig(), SamplingConfig(temperature=1.0)
    for options, message in ((dict(total_tokens=12), "set lookup_tokens=0 \\(it is 10\\)"),
                             (dict(lookup_tokens=0), "give total_tokens an integer")):
        asked = EagleModel.from_pretrained(target, drafter=drafter, device_rounds=True, **options)
        with pytest.raises(EagleError, match="device_rounds: device rounds .*" + message):
            asked._device_drafter("eagle-tree", greedy)
        assert asked._device_drafter("eagle-chain", greedy) is not None  # a chain grafts nothing, has one size
        by_default = asked._with(asked.drafter, asked.tree)
        by_default.device_rounds_given, by_default.device_rounds = None, True  # what CUDA's default is
        assert by_default._device_drafter("eagle-tree", greedy) is None  # the host path runs them
        assert by_default._device_drafter("eagle-chain", greedy) is not None
    assert on._device_drafter("eagle-tree", greedy) is not None
    assert on._device_drafter("eagle-tree", sampled).draw_temperature == pytest.approx(0.85)  # drawn children
    assert on._device_drafter("eagle-chain", sampled).draw_temperature == pytest.approx(0.85)
    assert on._device_drafter("eagle-tree", greedy).draw_temperature == 0
    assert on._device_drafter("ar", greedy) is None
    assert not device_rounds_apply(TreeConfig(choices=((0,), (1,))), greedy)
    assert device_rounds_apply(TreeConfig(sampled_tree=False), sampled)
    big = EagleModel.from_pretrained(target, drafter=drafter, device_rounds=True, total_tokens=200, depth=6, top_k=10,
                                     lookup_tokens=0)
    assert big._device_drafter("eagle-tree", greedy).total == 64  # the largest static bucket


def outcome_p(rule, size: int, want: dict, n: int) -> float:
    """Chi-square p of the (accepted path, next token) outcomes of ``rule`` (uniforms [size + 1] -> a
    ``DeviceAcceptance``) over n uniform draws, vectorized with vmap, against ``want``; cells
    expected below 5 pooled; an outcome ``want`` rules out fails outright (p = 0)."""
    from scipy.stats import chisquare

    uniform = torch.rand(n, size + 1, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    path, count, next_token = torch.func.vmap(lambda u: tuple(vars(rule(u)).values()))(uniform)
    counts = collections.Counter((tuple(p[:c]), y) for p, c, y in zip(path.tolist(), count.tolist(),
                                                                        next_token.tolist()))
    if not set(counts) <= {key for key, p in want.items() if p > 0}:
        return 0.0
    big = [key for key, p in want.items() if p * n >= 5]
    small = [key for key, p in want.items() if 0 < p * n < 5]  # pooled into one cell
    observed = [counts[key] for key in big] + ([sum(counts[key] for key in small)] if small else [])
    expected = [want[key] * n for key in big] + ([sum(want[key] * n for key in small)] if small else [])
    return float(chisquare(observed, [e * n / sum(expected) for e in expected]).pvalue)


def test_sampled_accept_follows_the_recursive_rule_in_distribution():
    """One tree, one target distribution per node: how often each (accepted path, next token)
    outcome comes out of ``sampled_accept`` matches the host's ``recursive_rejection_tree``
    (itself checked against exact distributions in test_losslessness.py), and the host rule's
    exact outcome probabilities computed by enumeration (40k vectorized runs). The control tries
    each child against the full p, whatever its earlier siblings took."""
    vocab = 5
    parents = [-1, 0, 0, 1, 1, 2]
    tokens = [0, 1, 3, 2, 4, 0]
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(len(parents), vocab, generator=gen)
    for child, parent in enumerate(parents[1:], start=1):  # drafts the target likes, as a drafter's top-k are
        logits[parent, tokens[child]] += 1.5
    probs = torch.softmax(logits, -1)
    tree = device_tree(tokens, parents)

    def exact() -> dict[tuple, float]:  # enumerate the recursive rule
        out: dict[tuple, float] = collections.defaultdict(float)

        def walk(node, path, mass):
            r = probs[node].double().clone()
            kids = [c for c in range(len(parents)) if parents[c] == node]
            for c in kids:
                x = tokens[c]
                chance = float(r[x] / r.sum())
                walk(c, path + (c,), mass * chance)
                mass *= 1 - chance
                r[x] = 0
            for x in range(vocab):
                out[(path, x)] += mass * float(r[x] / r.sum())

        walk(0, (0,), 1.0)
        return out

    want = exact()
    assert outcome_p(lambda u: sampled_accept(tree, probs, u), tree.size, want, 40000) > 1e-3
    from tests.decoding.test_losslessness import device_no_renormalization

    assert outcome_p(lambda u: device_no_renormalization(tree, probs, u), tree.size, want, 40000) < 1e-3


@pytest.mark.parametrize("support", [0, 3])
def test_drawn_children_are_gumbel_top_k_among_the_support(support):
    """``tree.drawn_children`` (the host's and the device's draws alike), against a brute force: among the
    ``support`` most likely of 7 draft tokens (0: all; the first on ties), the k largest of log-prob / T plus
    Gumbel noise of the given uniforms, in that order; scored by the k largest log-probabilities."""
    gen = torch.Generator().manual_seed(0)
    logprobs = torch.log_softmax(2 * torch.randn(4, 7, generator=gen), -1)
    logprobs[0, 5] = logprobs[0, 2]  # a tie: the lower index ranks first
    parent_scores, k, temperature = torch.randn(4, generator=gen), 2, 0.85
    width = support or 7
    uniform = torch.rand(4, width, generator=torch.Generator().manual_seed(5))
    tokens, scores, got_among, got_lp = drawn_children(parent_scores, logprobs, k, torch.tensor(temperature), width,
                                                       uniform)
    for f in range(4):
        best = sorted(range(7), key=lambda v: (-float(logprobs[f, v]), v))
        order = best[:width] if support else list(range(7))  # the whole vocabulary in index order
        assert got_among[f].tolist() == order and torch.equal(got_lp[f], logprobs[f, order])
        keyed = [float(logprobs[f, v]) / temperature - math.log(-math.log(float(uniform[f, j])))
                 for j, v in enumerate(order)]
        drawn = sorted(range(width), key=lambda j: -keyed[j])[:k]
        assert tokens[f].tolist() == [order[j] for j in drawn]
        assert torch.allclose(scores[f], parent_scores[f] + logprobs[f, best[:k]])


def exact_drawn_rule(tokens: list[int], parents: list[int], probs: torch.Tensor, draws: DeviceDraws) -> dict:
    """The recursive rule's (accepted path, next token) probabilities for a tree of drawn children
    (``acceptance.recursive_rejection_tree`` with each child's chance instead of a draw)."""
    out: dict[tuple, float] = collections.defaultdict(float)

    def walk(node, path, chance):
        r = probs[node].double().clone()
        mass = float(r.sum())
        kids = [c for c in range(len(parents)) if parents[c] == node]
        if kids:
            ids, q = draws.ids[draws.rows[node]], torch.softmax(draws.logprobs[draws.rows[node]].double()
                                                                / draws.temperature.double(), -1)
        for c in kids:
            hit = ids == tokens[c]
            qx = float(q[hit].sum())
            if qx <= 0:
                continue
            accept = min(1.0, float(r[tokens[c]]) / (qx * mass))
            walk(c, path + (c,), chance * accept)
            chance *= 1 - accept
            residual = r.clone()
            residual[ids] = (r[ids] - q * mass).clamp(min=0)
            if residual.sum() > 0:
                r, mass = residual, float(residual.sum())
            q = q.masked_fill(hit, 0.0)
            q = q / q.sum() if q.sum() > 0 else q
        for y in range(r.shape[0]):
            out[(path, y)] += chance * float(r[y] / r.sum())

    walk(0, (0,), 1.0)
    return out


def test_drawn_accept_follows_the_recursive_rule_in_distribution():
    """A tree of drawn children (the root's 3 draws among 4 of 6 tokens, below them 2 and 1): how
    often each (accepted path, next token) comes out of ``drawn_accept`` matches the host rule's
    exact probabilities (``recursive_rejection_tree``, itself checked against the target in
    test_losslessness.py). The control tells the rule the draws came at twice the temperature."""
    parents = [-1, 0, 0, 0, 1, 1, 2]
    tokens = [0, 2, 5, 1, 1, 3, 0]
    gen = torch.Generator().manual_seed(3)
    probs = torch.softmax(1.5 * torch.randn(len(parents), 6, generator=gen), -1)
    draws = DeviceDraws(rows=torch.tensor([0, 1, 2, -1, -1, -1, -1]),
                        ids=torch.tensor([[2, 5, 1, 4], [1, 3, 0, 2], [0, 4, 3, 5]]),
                        logprobs=torch.log_softmax(torch.randn(3, 4, generator=gen), -1),
                        temperature=torch.tensor(0.85), width=3)
    tree = device_tree(tokens, parents)
    want = exact_drawn_rule(tokens, parents, probs, draws)
    assert sum(want.values()) == pytest.approx(1.0)
    assert outcome_p(lambda u: drawn_accept(tree, probs, draws, u), tree.size, want, 40000) > 1e-3
    told = dataclasses.replace(draws, temperature=2 * draws.temperature)
    assert outcome_p(lambda u: drawn_accept(tree, probs, told, u), tree.size, want, 40000) < 1e-3


def test_sampled_acceptance_can_be_captured(fake_capture):
    """``drawn_accept`` and ``sampled_accept`` make no host tensor and read nothing back (captured:
    by the CPU stand-in for CUDA capture where there is no GPU), and a replay on new uniforms gives
    the eager result."""
    from eagle.runtime.cuda_graphs import capture_graph

    dev = device_under_test()
    parents, tokens = [-1, 0, 0, 0, 1, 1, 2], [0, 2, 5, 1, 1, 3, 0]
    gen = torch.Generator().manual_seed(3)
    probs = torch.softmax(1.5 * torch.randn(len(parents), 6, generator=gen), -1).to(dev)
    draws = DeviceDraws(rows=torch.tensor([0, 1, 2, -1, -1, -1, -1], device=dev),
                        ids=torch.tensor([[2, 5, 1, 4], [1, 3, 0, 2], [0, 4, 3, 5]], device=dev),
                        logprobs=torch.log_softmax(torch.randn(3, 4, generator=gen), -1).to(dev),
                        temperature=torch.tensor(0.85, device=dev), width=3)
    tree = DeviceTree(*(x.to(dev) if isinstance(x, torch.Tensor) else x
                        for x in vars(device_tree(tokens, parents)).values()))
    uniform = torch.zeros(len(parents) + 1, dtype=torch.float64, device=dev)
    for rule in (lambda: drawn_accept(tree, probs, draws, uniform), lambda: sampled_accept(tree, probs, uniform)):
        graph, out = capture_graph(lambda: tuple(vars(rule()).values()), probs.device,
                                   torch.cuda.graph_pool_handle() if dev.type == "cuda" else None)
        assert graph is not None
        for _ in range(20):
            uniform.copy_(torch.rand(uniform.shape, generator=gen, dtype=torch.float64))
            want = [x.clone() for x in vars(rule()).values()]
            graph.replay()
            assert all(torch.equal(a, b) for a, b in zip(out, want))


@pytest.mark.parametrize("method", ["eagle-tree", "eagle-chain"])
@pytest.mark.parametrize("kind", ["eagle", pytest.param("eagle3", marks=pytest.mark.slow)])
def test_device_rounds_capture(fake_capture, kind, method):
    """Every static function of a device round (the draft phase, greedy and with drawn children,
    the drafter's and the target's forwards) is captured (by the CPU stand-in for CUDA capture
    where there is no GPU: a host tensor, a host read or a data-dependent shape inside fails the
    test), and the replayed graphs give ``ar``'s tokens."""
    # built here, after fake_capture turned the compiled CPU kernels off (a recording cannot replay them)
    target = tiny_target() if kind == "eagle" else tiny_target(layers=8)
    drafter = tiny_drafter(target) if kind == "eagle" else tiny_drafter(target, kind="eagle3", draft_vocab_size=20)
    model = EagleModel.from_pretrained(target, drafter=drafter, cuda_graphs=True, device_rounds=True, total_tokens=12,
                                       depth=4, top_k=3, lookup_tokens=0)
    for ids in prompts(3, seed=4)[1:]:
        got = model.generate(ids, method=method, max_new_tokens=16)
        assert got.token_ids == model.generate(ids, method="ar", max_new_tokens=16).token_ids
    runner = model._device_drafter(method, SamplingConfig()).drafter.runner
    assert any(key[0] == "draft phase" and entry.graph is not None for key, entry in runner.shapes.items())
    assert runner.fallbacks == 0 and model.target.graphs.fallbacks == 0
    # drawn children: the phase with its noise buffer captured too; each replay draws anew, seeded
    sampled = [model.generate(prompts(3, seed=4)[2], method=method, max_new_tokens=16, temperature=1.0, seed=seed)
               for seed in (0, 1, 0)]
    assert sampled[0].token_ids == sampled[2].token_ids != sampled[1].token_ids
    drawn = [key for key, entry in runner.shapes.items() if key[0] == "draft phase" and key[-1] and entry.graph]
    assert drawn and runner.fallbacks == 0 and model.target.graphs.fallbacks == 0
