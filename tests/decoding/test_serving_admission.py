"""Admission to ``ServingEngine``: the prompts admitted in one step are prefilled together, and a
drafter is prefilled only when its sequence first drafts (root-only rounds cost it nothing)."""

from __future__ import annotations

import pytest
import torch

from eagle import EagleModel
from eagle.config import SamplingConfig
from eagle.decoding import serving
from eagle.decoding.serving import ServingEngine, RequestOptions
from eagle.decoding.draft_steps import run_alone
from eagle.decoding.proposers import EagleDrafter

from tests.conftest import prompts, tiny_drafter, tiny_target

CHEAP = [1.0] * 64  # a forward costs the same for 1-64 rows: every draft pays
DEAR = [float(2 ** n) for n in range(40)]  # every extra row doubles a forward: no draft pays


@pytest.fixture(scope="module")
def model():
    target = tiny_target(eos=True, seed=10)
    return EagleModel.from_pretrained(target, drafter=tiny_drafter(target), total_tokens=8, depth=3, top_k=3)


def decode(engine: ServingEngine) -> dict:
    """Step ``engine`` until nothing runs -> {request id: its final event}."""
    final = {}
    while engine.active or engine.queued:
        final.update((e.request_id, e) for e in engine.step() if e.finished)
    return final


def test_prompts_admitted_together_are_prefilled_by_one_forward(model, monkeypatch):
    """Six prompts of 1-19 tokens (one of a single token, one longer than the compiled stack takes)
    join in one step: one ``segment_forward`` prefills all those of more than one token, each
    from position 0; every request's greedy output equals its own decoding, ar and eagle-tree.
    With a budget of 19 rows a step admits the prompts in order while they fit (one at least):
    four steps admit them, the two that fit together by one forward."""
    calls = []

    def spy(lean, ids, positions, caches, sizes, masks, aux_layers=()):
        calls.append((list(sizes), positions.tolist(), list(masks)))
        return segment_forward(lean, ids, positions, caches, sizes, masks, aux_layers)

    segment_forward = serving.segment_forward
    monkeypatch.setattr(serving, "segment_forward", spy)
    gen = torch.Generator().manual_seed(3)
    batch = [torch.randint(1, 32, (n,), generator=gen).tolist() for n in (5, 1, 19, 8, 3, 12)]
    methods = ["eagle-tree", "ar"] * 3
    alone = [model.generate(ids, method="ar", max_new_tokens=8).token_ids for ids in batch]
    for budget, forwards, joined in ((serving.PREFILL_ROWS, [[4, 18, 7, 2, 11]], [6]),
                                     (19, [[7, 2]], [2, 3, 5, 6])):  # one prompt alone: its own forward
        monkeypatch.setattr(serving, "PREFILL_ROWS", budget)
        calls.clear()
        engine = ServingEngine(model, max_batch=8, row_seconds=CHEAP)
        for i, (ids, method) in enumerate(zip(batch, methods)):
            engine.add(i, ids, RequestOptions(method=method, max_new_tokens=8))
        final, running = {}, []
        while engine.active or engine.queued:
            final.update((e.request_id, e) for e in engine.step() if e.finished)
            running.append(engine.active + len(final))
        prefills = [(sizes, positions) for sizes, positions, masks in calls if all(m is None for m in masks)
                    and any(n > 1 for n in sizes)]
        assert [sizes for sizes, _ in prefills] == forwards and running[:len(joined)] == joined
        for sizes, positions in prefills:
            assert positions == [p for n in sizes for p in range(n)]
        assert [final[i].result.token_ids for i in range(len(batch))] == alone
        assert sum(sum(final[i].stats.accept_lengths) - len(final[i].stats.accept_lengths) for i in (0, 2, 4)) > 0


def test_root_only_sequences_never_run_their_drafter_and_catch_up_when_they_draft(model, monkeypatch):
    """Rows too dear to draft: eagle-tree sequences verify their roots alone for four rounds and
    their drafters never run (the features of the prompt and of each round are only kept). Once
    rows are cheap they draft: each drafter is fed its prompt (all together), then the four rounds, and every
    output still equals its request decoded alone, with drafts accepted."""
    fed = []
    feed = EagleDrafter._feed
    monkeypatch.setattr(EagleDrafter, "_feed", lambda self, f, tokens: (fed.append(len(tokens)),
                                                                        feed(self, f, tokens))[1])
    batch = [ids for ids in prompts(8, seed=6) if len(ids) > 2][:3]
    engine = ServingEngine(model, max_batch=4, row_seconds=DEAR)
    for i, ids in enumerate(batch):
        engine.add(i, ids, RequestOptions(method="eagle-tree", max_new_tokens=16))
    for _ in range(4):
        assert {e.stats.tree_size for e in engine.step()} == {1}
    assert fed == []
    engine._seconds = list(CHEAP)
    final = decode(engine)
    assert fed[:2 * len(batch)] == [len(ids) - 1 for ids in batch] + [4] * len(batch)  # prompts, then rounds
    for i, ids in enumerate(batch):
        assert final[i].result.token_ids == model.generate(ids, method="ar", max_new_tokens=16).token_ids
    assert sum(max(final[i].stats.accept_lengths) for i in final) > len(batch)


def test_a_drafter_prefilled_late_drafts_what_one_fed_at_once_drafts(model):
    """``start`` keeps the prompt and root-only rounds keep their features; the first round that may
    draft feeds them all: its tree is the one of a drafter fed the prompt at once and each round as it
    came."""
    target = model.target
    ids = [5, 9, 3, 3, 7, 2, 9, 3]
    out = target.forward(torch.tensor([ids[:-1]]), torch.arange(len(ids) - 1)[None], target.new_cache())
    gen = torch.Generator().manual_seed(0)
    lazy, eager = (model._proposer("eagle-tree", SamplingConfig(), torch.Generator()) for _ in range(2))
    for p in (lazy, eager):
        p.start(ids, out.features[0])
    eager.prepare()
    assert lazy.cache.get_seq_length() == 0 and eager.cache.get_seq_length() == len(ids) - 1
    context = list(ids)
    for token in (4, 11, 6):  # three root-only rounds
        features = torch.randn(1, out.features.shape[-1], generator=gen)
        for p in (lazy, eager):
            assert p.propose(context, max_depth=5, max_nodes=1).tree.size == 1
        context.append(token)
        for p in (lazy, eager):
            p.commit(context, [], features)
        run_alone(eager.catching_up())
    assert lazy.cache.get_seq_length() == 0
    want, got = (p.propose(context, max_depth=5, max_nodes=8).tree for p in (eager, lazy))
    assert lazy.cache.get_seq_length() == eager.cache.get_seq_length() == len(context) - 1
    assert got.size > 1 and torch.equal(got.tokens, want.tokens) and torch.equal(got.parents, want.parents)
    torch.testing.assert_close(got.scores, want.scores)
