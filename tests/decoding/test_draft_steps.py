"""Drafting many sequences in lockstep (``draft_steps``): each sequence drafts the tree it drafts
alone, with one head call per step for all of them; a pooled drafter call (``pooled_drafter_forward``)
gives each sequence's rows what its own cache gives them."""

from __future__ import annotations

import pytest
import torch

from eagle import EagleModel
from eagle.config import SamplingConfig
from eagle.decoding import draft_steps
from eagle.decoding.draft_steps import run_alone, run_together
from eagle.runtime.masks import attention_bias
from eagle.drafting.drafter import LeanDrafter
from eagle.runtime.kv_cache import CachePool
from eagle.runtime.pooled import DrafterGraphs, pooled_drafter_forward

from tests.conftest import prompts, tiny_drafter, tiny_target


@pytest.fixture(scope="module")
def model():
    target = tiny_target(eos=True, seed=10)
    return EagleModel.from_pretrained(target, drafter=tiny_drafter(target), total_tokens=8, depth=3, top_k=3,
                                      lookup_tokens=0)


def started(model, ids, **kw):
    """An eagle-tree proposer started on ``ids`` (the target's prefill of ``ids[:-1]``)."""
    target = model.target
    proposer = model._proposer("eagle-tree", SamplingConfig(**kw), torch.Generator().manual_seed(len(ids)))
    dev = target.device
    prefill = target.forward(torch.tensor([ids[:-1]], device=dev), torch.arange(len(ids) - 1, device=dev)[None],
                             target.new_cache())
    proposer.start(ids, prefill.features[0])
    return proposer


def test_sequences_drafting_together_draft_their_trees_alone_with_one_head_call_per_step(model, monkeypatch):
    """Five sequences (prompts of different lengths, a drafter fed its prompt in the first step)
    drafting three rounds together: every tree equals the tree the same proposer drafts alone, and the
    head runs once per step for all of them, not once per sequence."""
    batch = [ids for ids in prompts(9, seed=4) if len(ids) > 2][:5]
    together, alone = ([started(model, ids) for ids in batch] for _ in range(2))
    heads = []
    run_steps = draft_steps.run_steps
    monkeypatch.setattr(draft_steps, "run_steps", lambda steps: heads.append(len(steps)) or run_steps(steps))
    contexts = [list(ids) for ids in batch]
    for round_ in range(3):
        heads.clear()
        proposals, seconds = run_together([p.drafting(ids, max_depth=5, max_nodes=8)
                                           for p, ids in zip(together, contexts)])
        assert heads and set(heads) == {len(batch)} and all(s > 0 for s in seconds)  # every step: all five at once
        for p, ids, got in zip(alone, contexts, proposals):
            want = p.propose(ids, max_depth=5, max_nodes=8).tree
            assert got.tree.size > 2
            assert torch.equal(got.tree.tokens, want.tokens) and torch.equal(got.tree.parents, want.parents)
            # a row's bits beside other rows are promised by the compiled kernels only, not by oneDNN
            torch.testing.assert_close(got.tree.scores, want.scores, rtol=1e-4, atol=1e-4)
        for p, q, ids, got in zip(together, alone, contexts, proposals):  # accept the first child, go on
            path = [1]
            ids.extend([int(got.tree.tokens[1]), 5])
            features = torch.randn(2, model.target.hidden_size, generator=torch.Generator().manual_seed(round_)).to(
                model.target.device)
            p.commit(ids, path, features)
            q.commit(ids, path, features)


def test_sampled_trees_draw_alone_what_they_draw_together(model):
    """Drawn children use each sequence's own generator: drafting together draws what each draws alone."""
    batch = [ids for ids in prompts(6, seed=5) if len(ids) > 1][:3]
    together = [started(model, ids, temperature=1.0) for ids in batch]
    alone = [started(model, ids, temperature=1.0) for ids in batch]
    proposals, _ = run_together([p.drafting(ids, max_depth=5, max_nodes=8) for p, ids in zip(together, batch)])
    for p, ids, got in zip(alone, batch, proposals):
        want = p.propose(ids, max_depth=5, max_nodes=8)
        assert got.drawn is not None and torch.equal(got.tree.tokens, want.tree.tokens)
        assert torch.equal(got.drawn, want.drawn)


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_a_pooled_drafter_call_gives_each_sequence_what_its_own_cache_gives(kind, static, request):
    """Three sequences' drafter caches as slots of one pool (one in use by nobody in between): a causal
    feed of different lengths, then a tree step whose rows see only their ancestors among the round's
    cached nodes, run by one pooled call each: the outputs and cache entries equal each sequence's own
    drafter calls on its own cache, up to rounding (EAGLE-3: three fused target layers in, the token's
    embedding beside the hidden state in attention). ``static``: the pool's ``DrafterGraphs`` (captured by the
    CPU stand-in for CUDA capture where there is no GPU), each shape replayed by a later call."""
    if static:
        request.getfixturevalue("fake_capture")  # before the models: the compiled CPU kernels off
    target = tiny_target(seed=3, layers=8 if kind == "eagle3" else 2)
    extra = {"kind": "eagle3", "draft_vocab_size": 20} if kind == "eagle3" else {}
    drafter = LeanDrafter(tiny_drafter(target, **extra), torch.float32)
    cfg, h = drafter.config, target.hidden_size * (1 + len(drafter.config.aux_layers))
    gen = torch.Generator().manual_seed(0)
    dev = target.device
    pool = CachePool(cfg.num_layers, 4, cfg.num_key_value_heads, cfg.head_dim, torch.float32, dev, capacity=16)
    graphs = pool.graphs = DrafterGraphs(drafter, pool) if static else None
    spare = pool.cache()  # slot 0 taken: the sequences sit in slots 1-3, gathered
    pooled, own = [pool.cache() for _ in range(3)], [drafter.new_cache() for _ in range(3)]
    pool.release(spare)

    def call(sizes, pasts, masks):
        rows = torch.randn(sum(sizes), h, generator=gen).to(dev)
        tokens = torch.randint(0, 32, (sum(sizes),), generator=gen).to(dev)
        positions = torch.cat([torch.arange(p, p + n) for p, n in zip(pasts, sizes)]).to(dev)
        embeds = target.embed(tokens[None])[0]
        got = pooled_drafter_forward(drafter, rows, embeds, positions, pooled, sizes, masks)
        biases = [None if m is None else attention_bias(m, p, torch.float32).to(dev) for m, p in zip(masks, pasts)]
        want = torch.cat([drafter(r[None], e[None], q[None], c, b)[0] for r, e, q, c, b in
                          zip(rows.split(sizes), embeds.split(sizes), positions.split(sizes), own, biases)])
        torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)  # the weights are scaled up: values of ~10

    call([5, 2, 20], [0, 0, 0], [None] * 3)  # prompts: causal (the third outgrows the pool: it grows)
    def tree_masks(pattern):  # each sequence's committed keys, then the round's nodes as ``pattern`` allows
        return [torch.tensor(pattern, dtype=torch.bool)] * 3

    # a, b, c: the root's child a, then b and c below it; then d below b and e below c, each seeing its branch
    call([3, 3, 3], [5, 2, 20], tree_masks([[1, 0, 0], [1, 1, 0], [1, 0, 1]]))
    call([2, 2, 2], [8, 5, 23], tree_masks([[1, 1, 0, 1, 0], [1, 0, 1, 0, 1]]))
    call([2, 2, 1], [10, 7, 25], tree_masks([[1, 0, 0, 1, 1, 1, 0], [1, 0, 1, 1, 0, 0, 1]])[:2] + [None])
    if static:  # the prompts (rows of 20) ran eagerly; the two tree steps' shapes were captured, the last replayed
        assert graphs.captured == len(graphs.shapes) == 2 and graphs.fallbacks == 0
    for p, c in zip(pooled, own):
        assert p.get_seq_length() == c.get_seq_length()
        for i in range(cfg.num_layers):
            n = c.get_seq_length()
            torch.testing.assert_close(p.keys[i][..., :n, :], c.keys[i][..., :n, :], atol=1e-5, rtol=1e-5)


def test_prepare_and_propose_alone_are_the_steps_run_alone(model):
    """``propose`` and ``prepare`` are their step generators run alone (``run_alone``)."""
    ids = prompts(4, seed=9)[3]
    a, b = started(model, ids), started(model, ids)
    a.prepare()
    run_alone(b.preparing())
    assert a.cache.get_seq_length() == b.cache.get_seq_length() == len(ids) - 1
    assert torch.equal(a.propose(ids, 5, 8).tree.tokens, run_alone(b.drafting(ids, 5, 8)).tree.tokens)
