"""Batched decoding (``ServingEngine``) on tiny random models: each request's greedy output is its
own decoding's, whatever joins and leaves the batch; sampled output keeps the target's
distribution; tree sizes from the load (``batch_tree_sizes``) as a pure function."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from eagle import EagleError, EagleModel
from eagle.decoding import acceptance, draft_steps
from eagle.decoding.serving import ServingEngine, RequestOptions, generate_together
from eagle.decoding.tree_mask import tree_attention
from eagle.runtime.masks import attention_bias
from eagle.decoding.tree_sizing import RankRates, batch_tree_sizes
from eagle.runtime import segments
from eagle.runtime.fake_capture import syncs
from eagle.runtime.gemma import GemmaDecoder
from eagle.runtime.kv_cache import CachePool
from eagle.runtime.pooled import DrafterGraphs, PooledGraphs
from eagle.runtime.segments import runs_segments, segment_forward

from tests.conftest import prompts, tiny_drafter, tiny_gemma, tiny_target
from tests.conftest import test_device as device_under_test

METHODS = ("ar", "pld", "sd", "eagle-chain", "eagle-tree")
CHEAP = [1.0] * 64  # a forward costs the same for 1-64 rows: every draft pays
STEP = [1.0] * 8 + [4.0] * 56  # 8 rows for the price of one, then dear: a full batch drafts a little
RISING = [1.0] * 8 + [4.0 + n for n in range(1, 57)]  # 8 rows for the price of one, then each row dear


@pytest.fixture(scope="module")
def model():
    target = tiny_target(eos=True, seed=10)
    draft = tiny_target(eos=True, seed=5, hidden=16, layers=1)
    return EagleModel.from_pretrained(target, drafter=tiny_drafter(target), draft_model=draft.model,
                                      total_tokens=8, depth=3, top_k=3, gamma=3,
                                      auto_length=False)  # pld alone: chains not sized by timing


def run(engine: ServingEngine, joins: dict[int, list[tuple]], trees: list | None = None) -> tuple[dict, dict]:
    """Step ``engine``, adding ``joins[step]`` = [(request id, prompt, options)] before that step,
    until nothing runs -> ({request id: all tokens}, {request id: final event}); ``trees`` gets
    (method, tree size) of every round."""
    tokens, final, step = {}, {}, 0
    while step <= max(joins) or engine.active or engine.queued:
        for request_id, prompt, options in joins.get(step, []):
            engine.add(request_id, prompt, options)
            tokens[request_id] = []
        for event in engine.step():
            tokens[event.request_id].extend(event.new_token_ids)
            if trees is not None:
                trees.append((event.stats.method, event.stats.tree_size))
            assert not event.finished or event.result.token_ids == tokens[event.request_id]
            if event.finished:
                final[event.request_id] = event
        step += 1
    return tokens, final


def test_greedy_requests_joining_at_different_rounds_equal_each_decoded_alone(model):
    """Every method in one batch of at most 4 (the rest queued), prompts of 1-18 tokens joining at
    rounds 0-9, some ending at EOS, trees sized from the load (a full batch drafts for some of its
    sequences, so a drafter catches up after root-only rounds): each request's tokens are its own
    ``ar`` decoding's."""
    batch = prompts(12, seed=2)
    joins: dict[int, list[tuple]] = {}
    for i, ids in enumerate(batch):
        options = RequestOptions(method=METHODS[i % len(METHODS)], max_new_tokens=6 + 2 * (i % 7))
        joins.setdefault((3 * i) % 10, []).append((i, ids, options))
    engine, trees = ServingEngine(model, max_batch=4, row_seconds=STEP), []
    tokens, final = run(engine, joins, trees)
    eagle = {size > 1 for method, size in trees if method == "eagle-tree"}
    assert eagle == {True, False}
    assert len(final) == len(batch) and engine.active == engine.queued == 0
    reasons = {e.stop_reason for e in final.values()}
    assert reasons == {"eos", "length"}
    drafted = 0
    for i, ids in enumerate(batch):
        alone = model.generate(ids, method="ar", max_new_tokens=6 + 2 * (i % 7))
        assert tokens[i] == alone.token_ids, (i, final[i].stats.method)
        drafted += sum(n - 1 for n in final[i].stats.accept_lengths)
    assert drafted > 3  # drafts were really accepted, not only each round's own token


def assert_batch_decodes_as_alone(model, engine, batch) -> None:
    """Greedy eagle-tree requests served together give each one's tokens and rounds decoded alone."""
    results = generate_together(engine, batch, RequestOptions(method="eagle-tree", max_new_tokens=10))
    for ids, result in zip(batch, results):
        alone = model.generate(ids, method="eagle-tree", max_new_tokens=10)
        assert result.token_ids == alone.token_ids
        assert result.accept_lengths == alone.accept_lengths


def test_eagle_tree_batch_equals_single_stream_tree_decoding(model):
    """Batched eagle-tree with the configured trees gives decode_loop's tokens and rounds."""
    batch = prompts(4, seed=7)
    engine = ServingEngine(model, max_batch=4, load_sizing=False)
    assert_batch_decodes_as_alone(model, engine, batch)


def test_seeded_sampled_requests_draw_what_they_draw_alone(model):
    """A request's random generator drives its drafts and acceptance: with the configured trees a
    seeded sampled request gives the same tokens in a batch as alone."""
    batch = prompts(5, seed=8)
    options = [RequestOptions(method=METHODS[i % 5], max_new_tokens=8, temperature=1.0, seed=i)
               for i in range(len(batch))]
    results = generate_together(ServingEngine(model, max_batch=3, load_sizing=False), batch, options)
    for ids, opts, result in zip(batch, options, results):
        alone = model.generate(ids, method=opts.method, max_new_tokens=8, temperature=1.0, seed=opts.seed)
        assert result.token_ids == alone.token_ids, opts.method


@pytest.mark.parametrize("method", ["eagle-tree", "pld", "sd", "ar"])
def test_a_seeded_sampled_request_draws_the_same_at_max_batch_1_and_n(model, method):
    """A seeded sampled request served alone at ``max_batch`` 1 and served at ``max_batch`` 4 beside
    others (greedy, unseeded sampled, seeded sampled at another seed; joining before, with and after it)
    with trees sized from the load gives the same tokens: it owns its generator, and its draws never
    depend on its batch company. Another seed draws other tokens (it samples)."""
    batch = prompts(5, seed=11)
    mine = RequestOptions(method=method, max_new_tokens=12, temperature=1.0, top_p=0.95, seed=21)

    def alone(options):
        tokens, _ = run(ServingEngine(model, max_batch=1, row_seconds=STEP), {0: [("mine", batch[0], options)]})
        return tokens["mine"]

    others = [RequestOptions(method="eagle-tree", max_new_tokens=9),
              RequestOptions(method=method, max_new_tokens=14, temperature=1.0),
              RequestOptions(method="eagle-tree", max_new_tokens=7, temperature=0.7, seed=21),
              RequestOptions(method="pld", max_new_tokens=10, temperature=1.0)]
    joins = {0: [(0, batch[1], others[0]), (1, batch[2], others[1])],
             1: [("mine", batch[0], mine), (2, batch[3], others[2])], 3: [(3, batch[4], others[3])]}
    tokens, _ = run(ServingEngine(model, max_batch=4, row_seconds=STEP), joins)
    assert tokens["mine"] == alone(mine)
    assert any(alone(dataclasses.replace(mine, seed=seed)) != tokens["mine"] for seed in (22, 23, 24))


def test_a_requests_total_tokens_sizes_its_rounds_as_the_library_view_does(model):
    """``RequestOptions.total_tokens`` decodes a request as ``model.with_round_size(method, size)`` does
    alone: eagle-tree trees of that many nodes at most, pld chains of that many drafts + 1; the others
    in the batch keep the model's own sizes."""
    batch = prompts(4, seed=9)
    options = [RequestOptions(method="eagle-tree", max_new_tokens=10, total_tokens=4),
               RequestOptions(method="pld", max_new_tokens=10, total_tokens=3, temperature=1.0, seed=2),
               RequestOptions(method="eagle-tree", max_new_tokens=10),
               RequestOptions(method="eagle-tree", max_new_tokens=10, total_tokens=5, temperature=1.0, seed=3)]
    trees = []
    joins = {0: [(i, ids, opts) for i, (ids, opts) in enumerate(zip(batch, options))]}
    tokens, _ = run(ServingEngine(model, max_batch=4, load_sizing=False), joins, trees)
    for i, (ids, opts) in enumerate(zip(batch, options)):
        view = model.with_round_size(opts.method, opts.total_tokens)
        alone = view.generate(ids, method=opts.method, max_new_tokens=10, temperature=opts.temperature,
                              seed=opts.seed)
        assert tokens[i] == alone.token_ids, i
    assert max(size for method, size in trees if method == "pld") <= 3
    assert {size for method, size in trees if method == "eagle-tree"} >= {8}  # the model's own, request 2
    assert model.with_round_size("eagle-tree", 8) is model and model.with_round_size("ar", 3) is model
    assert model.with_round_size("pld", 4).prompt_lookup.num_draft_tokens == 3
    with pytest.raises(EagleError, match="total_tokens"):
        RequestOptions(method="eagle-tree", total_tokens=0)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_segment_forward_equals_each_sequence_alone(family):
    """Three sequences of different cache lengths, a tree, a chain and a single row in one forward:
    each row's features equal its own sequence's forward, and the caches grow alike (Qwen3: with its
    per-head norms)."""
    target = tiny_target(eos=True, seed=10, family=family)
    lean = target.lean
    contexts = [[3, 4, 5, 6, 7], [9], [2, 8, 8, 8, 1, 1, 4, 5, 6]]
    parents = [torch.tensor([-1, 0, 0, 1, 1, 2]), torch.tensor([-1, 0, 1]), torch.tensor([-1])]
    tokens = [torch.tensor([5, 6, 7, 8, 9, 10][:len(p)]) for p in parents]
    caches, alone = [], []
    for ctx, par, tok in zip(contexts, parents, tokens):
        mine, ref = lean.new_cache(), lean.new_cache()
        for cache in (mine, ref):
            target.forward(torch.tensor([ctx]), torch.arange(len(ctx))[None], cache)
        attn = tree_attention(par)
        bias = attention_bias(attn.mask, len(ctx), target.dtype)
        alone.append(target.forward(tok[None], (len(ctx) + attn.depths)[None], ref, bias, aux_layers=(0,)).features[0])
        caches.append((mine, bias, len(ctx) + attn.depths))
    out = segment_forward(lean, torch.cat(tokens), torch.cat([c[2] for c in caches]), [c[0] for c in caches],
                          [len(p) for p in parents], [c[1] if len(p) > 1 else None for c, p in zip(caches, parents)],
                          aux_layers=(0,))
    torch.testing.assert_close(out, torch.cat(alone), rtol=1e-5, atol=1e-5)
    assert [c[0].get_seq_length() for c in caches] == [len(c) + len(p) for c, p in zip(contexts, parents)]


def segments_and_alone(target, contexts: list[list[int]], parents: list[torch.Tensor]) -> tuple[list, list]:
    """``segment_forward`` of one tree per context (token ids 5, 6, ... on ``parents``) and each
    tree's own forward -> ([the segments' rows, each sequence's own], [(its cache, its own cache)])."""
    lean = target.lean
    tokens = [torch.arange(5, 5 + len(p)) % 32 for p in parents]
    caches, alone, inputs = [], [], []
    for ctx, par, tok in zip(contexts, parents, tokens):
        mine, ref = lean.new_cache(), lean.new_cache()
        for cache in (mine, ref):
            target.forward(torch.tensor([ctx]), torch.arange(len(ctx))[None], cache)
        attn = tree_attention(par)
        bias = attention_bias(attn.mask, len(ctx), target.dtype) if len(par) > 1 else None
        alone.append(target.forward(tok[None], (len(ctx) + attn.depths)[None], ref, bias, aux_layers=(0,)).features[0])
        caches.append((mine, ref))
        inputs.append((bias, len(ctx) + attn.depths))
    sizes = [len(p) for p in parents]
    out = segment_forward(lean, torch.cat(tokens), torch.cat([i[1] for i in inputs]), [c[0] for c in caches],
                          sizes, [i[0] for i in inputs], aux_layers=(0,))
    return list(zip(out.split(sizes), alone)), caches


def assert_same_caches(caches: list[tuple]) -> None:
    """Each (cache, its sequence's own cache) pair holds the same lengths and, up to them, the same bits."""
    for mine, ref in caches:
        assert mine.lengths == ref.lengths
        n = ref.lengths[0]
        assert all(torch.equal(a[..., :n, :], b[..., :n, :]) for a, b in zip(mine.keys + mine.values,
                                                                             ref.keys + ref.values))


def test_segment_forward_with_compiled_attention_gives_each_row_its_bits_alone():
    """Head dim 32 (the compiled attention runs): a tree, a single row and a chain, 16 rows in all,
    in one forward: every row is bit-identical to its sequence's own forward (the compiled stack),
    and every cache holds what its own forward wrote. Past 16 rows in all (a chain of 18 beside a
    row) the products over all rows are torch's while alone the stack takes them 16 at a time: the
    rows agree to fp32 rounding of the features' scale."""
    from tests.runtime.test_kernels import module_or_skip

    module_or_skip()
    target = tiny_target(seed=6, hidden=128)
    assert target.lean.stack is not None
    contexts = [[3, 4, 5, 6, 7], [9, 2, 2], [2, 8, 8, 8, 1, 1, 4, 5, 6]]
    rows, caches = segments_and_alone(target, contexts, [torch.tensor([-1, 0, 0, 1, 1, 2]), torch.tensor([-1]),
                                                         torch.arange(-1, 8)])
    assert all(torch.equal(mine, alone) for mine, alone in rows)
    assert_same_caches(caches)
    rows, caches = segments_and_alone(target, contexts[:2], [torch.arange(-1, 17), torch.tensor([-1])])
    for mine, alone in rows:
        torch.testing.assert_close(mine, alone, rtol=1e-5, atol=1e-5 * alone.abs().max().item())
    assert [c.lengths for c, _ in caches] == [[5 + 18] * 2, [3 + 1] * 2]


def test_gemma_segments_give_each_row_its_bits_alone():
    """Gemma-3 (sliding-window layers of 6 beside full ones): a tree after a context longer than the
    window, a single row, a chain, and a chain longer than the compiled stack takes, in one
    ``segment_forward``: every row is bit-identical to its own sequence's forward, and every cache holds
    what its own forward wrote."""
    from tests.runtime.test_kernels import module_or_skip

    module_or_skip()
    target = tiny_gemma(seed=3, window=6)
    assert runs_segments(target.lean) and target.lean.stack is not None
    contexts = [[3, 4, 5, 6, 7, 8, 9, 10, 11], [9, 2, 2], [2, 8, 8, 8, 1], [7, 7]]
    parents = [torch.tensor([-1, 0, 0, 1, 1, 2, 5]), torch.tensor([-1]), torch.arange(-1, 8), torch.arange(-1, 19)]
    rows, caches = segments_and_alone(target, contexts, parents)
    assert [len(mine) for mine, _ in rows] == [7, 1, 9, 20]
    assert all(torch.equal(mine, alone) for mine, alone in rows)
    assert_same_caches(caches)


def test_gemma_batch_runs_one_forward_a_round_and_equals_each_request_alone(monkeypatch):
    """A Gemma-3 target in the batch: each round's trees verified by one call of the compiled stack for
    all sequences, prompts of up to 16 tokens prefilled together; every request's greedy tokens are its
    own ``ar`` decoding's, past the sliding window."""
    from tests.runtime.test_kernels import module_or_skip

    module_or_skip()
    target = tiny_gemma(seed=4, window=6)
    model = EagleModel.from_pretrained(target, drafter=tiny_drafter(target), total_tokens=8, depth=3, top_k=3,
                                       auto_length=False)  # pld alone: chains not sized by timing
    calls = []
    together = GemmaDecoder.segment_forward
    monkeypatch.setattr(GemmaDecoder, "segment_forward",
                        lambda self, *args, **kw: calls.append(list(args[3])) or together(self, *args, **kw))
    batch = prompts(6, seed=3)
    options = [RequestOptions(method=("ar", "pld", "eagle-tree")[i % 3], max_new_tokens=12) for i in range(6)]
    results = generate_together(ServingEngine(model, max_batch=4, load_sizing=False), batch, options)
    for ids, opts, result in zip(batch, options, results):
        assert result.token_ids == model.generate(ids, method="ar", max_new_tokens=12).token_ids, opts.method
        assert result.accept_lengths == model.generate(ids, method=opts.method, max_new_tokens=12).accept_lengths
    assert any(len(sizes) == 4 and max(sizes) > 1 for sizes in calls)  # a round of four sequences, trees among them
    assert sum(len(r.accept_lengths) for r in results) < sum(len(r.token_ids) for r in results)  # drafts accepted


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_pooled_batch_equals_each_request_alone(family, monkeypatch):
    """Caches as slots of one pool (a GPU batch's layout), 7 requests through 3 slots (slots freed and
    handed out again, a cancelled one too): each round's trees verified by one pooled forward for all
    sequences, each drafter call run once for the sequences drafting (their drafters' caches pooled too),
    and every request's tokens and rounds are its own decoding's (Gemma-3: past its window)."""
    target = tiny_target(eos=True, seed=10) if family == "llama" else tiny_gemma(seed=4, window=6)
    model = EagleModel.from_pretrained(target, drafter=tiny_drafter(target), total_tokens=8, depth=3, top_k=3,
                                       auto_length=False)  # pld alone: chains not sized by timing
    calls, drafter_calls = [], []
    pooled = segments.pooled_forward
    monkeypatch.setattr(segments, "pooled_forward",
                        lambda *args, **kw: calls.append(list(args[4])) or pooled(*args, **kw))
    pooled_drafter = draft_steps.pooled_drafter_forward
    monkeypatch.setattr(draft_steps, "pooled_drafter_forward",
                        lambda *args: drafter_calls.append(len(args[4])) or pooled_drafter(*args))
    batch = prompts(7, seed=3)
    options = [RequestOptions(method=("eagle-tree", "ar", "eagle-tree", "pld")[i % 4], max_new_tokens=12)
               for i in range(7)]
    engine = ServingEngine(model, max_batch=3, load_sizing=False, cache_pool=True)
    engine.add("gone", batch[0], options[0])
    engine.step()
    assert engine._pool.top == 1 and engine.cancel("gone") and engine._pool.top == 0
    results = generate_together(engine, batch, options)
    for ids, opts, result in zip(batch, options, results):
        alone = model.generate(ids, method=opts.method, max_new_tokens=12)
        assert result.token_ids == alone.token_ids, opts.method
        assert result.accept_lengths == alone.accept_lengths
    assert any(len(sizes) == 3 and max(sizes) > 1 for sizes in calls)  # a round of three sequences, trees among them
    assert sum(len(r.accept_lengths) for r in results) < sum(len(r.token_ids) for r in results)  # drafts accepted
    assert max(drafter_calls) > 1  # the drafters' caches pooled too: one drafter call for several sequences
    assert engine._pool.top == 0 and all(pool.top == 0 for _, pool in engine._draft_pools.values())


def test_cancel_queue_counts_and_refusals(model):
    engine = ServingEngine(model, max_batch=2, row_seconds=CHEAP)
    for i in range(4):
        engine.add(i, [3, 4, 5 + i], RequestOptions(method="eagle-tree", max_new_tokens=30))
    assert (engine.active, engine.queued) == (0, 4) and 3 in engine
    with pytest.raises(EagleError, match="in use"):
        engine.add(2, [1, 2])
    assert engine.cancel(3) and not engine.cancel(3) and engine.queued == 3
    events = engine.step()
    assert [e.request_id for e in events] == [0, 1] and (engine.active, engine.queued) == (2, 1)
    assert engine.cancel(0) and engine.active == 1
    assert [e.request_id for e in engine.step()] == [1, 2]
    for bad in (dict(method="beam"), dict(max_new_tokens=0), dict(temperature=-1.0), dict(stop=("",))):
        with pytest.raises(EagleError):
            RequestOptions(**bad)
    with pytest.raises(EagleError, match="context"):
        engine.add("long", list(range(1, 20)) * 20)
    with pytest.raises(EagleError, match="draft model"):
        ServingEngine(EagleModel(model.target)).add("sd", [1, 2], RequestOptions(method="sd"))


def test_stop_strings_end_a_request_and_cut_its_text(model):
    ids, alone = next((ids, alone) for ids in prompts(12, seed=1)
                      if len((alone := model.generate(ids, method="ar", max_new_tokens=20)).token_ids) == 20)
    words = alone.text.split()
    stop = " ".join(words[3:5])
    [result] = generate_together(ServingEngine(model, row_seconds=CHEAP), [ids],
                                 RequestOptions(method="eagle-tree", max_new_tokens=20, stop=stop))
    assert result.stop_reason == "stop" and result.text == alone.text[:alone.text.find(stop)]
    assert alone.token_ids[:len(result.token_ids)] == result.token_ids and len(result.token_ids) < 20


def test_tree_sizes_shrink_as_the_batch_grows():
    """Flat cost up to 16 rows (reading the weights), then rising: one sequence gets a big tree,
    16 sequences get none (batched ar), in between they share the cheap rows."""
    seconds = [1.0] * 16 + [1.0 + 0.25 * n for n in range(1, 113)]
    gains = [0.8, 0.6, 0.5, 0.4, 0.3, 0.25, 0.2, 0.15, 0.1]
    sizes = {b: batch_tree_sizes(seconds, [gains] * b, [0.05] * b) for b in (1, 2, 4, 8, 16)}
    assert sizes[1] == [10]
    per_sequence = [max(s) for s in sizes.values()]
    assert per_sequence == sorted(per_sequence, reverse=True) and per_sequence[0] > per_sequence[2]
    assert sum(sizes[4]) <= 16 + 2 and sizes[16] == [1] * 16


def test_tree_sizes_never_expect_less_than_batched_ar():
    """Drafting too dear, or drafts never accepted: all ones. Rows go to the best gains across
    sequences (a sequence that cannot draft gets none) and each sequence's drafts are a prefix."""
    seconds = [1.0 + 0.05 * n for n in range(64)]
    assert batch_tree_sizes(seconds, [[0.9, 0.5]] * 3, [5.0] * 3) == [1, 1, 1]
    assert batch_tree_sizes(seconds, [[0.0, 0.0]] * 3, [0.0] * 3) == [1, 1, 1]
    assert batch_tree_sizes(seconds, [[0.9, 0.8], [], [0.1]], [0.0] * 3) == [3, 1, 1]
    assert batch_tree_sizes([1.0] * 5, [[0.9, 0.8, 0.7]] * 2, [0.0] * 2) == [3, 2]  # no rows past the curve
    assert batch_tree_sizes(seconds[:2], [[0.9]] * 3, [0.0] * 3) == [1, 1, 1]
    for b in range(1, 6):
        gains = [[0.9 * 0.7 ** r for r in range(8)] for _ in range(b)]
        sizes = batch_tree_sizes(seconds, gains, [0.02] * b)
        kept = sum(sum(g[:n - 1]) for g, n in zip(gains, sizes))
        drafting = 0.02 * sum(n > 1 for n in sizes)
        assert (b + kept) / (drafting + seconds[sum(sizes) - 1]) >= b / seconds[b - 1]


def best_rate_by_brute_force(seconds: list[float], gains: list[list[float]], fixed: list) -> float:
    """The highest (B + kept gains) / seconds[rows - 1] over every choice of draft prefixes for the
    sequences not fixed (no drafting cost), the fixed ones at their sizes."""
    import itertools

    choices = [range(len(g) + 1) if f is None else [f - 1] for g, f in zip(gains, fixed)]
    best = 0.0
    for drafts in itertools.product(*choices):
        rows = len(gains) + sum(drafts)
        if rows <= len(seconds):
            best = max(best, (len(gains) + sum(sum(g[:d]) for g, d in zip(gains, drafts))) / seconds[rows - 1])
    return best


def test_fixed_tree_sizes_are_kept_and_the_others_sized_around_them():
    """A fixed sequence (a seeded sampled one) keeps its size and its rows count: with 8 cheap rows
    and four sequences, one pinned at 6 nodes leaves no cheap row for the others (all ones), where
    unpinned they share the rows; rows too dear or past the curve never shrink a pinned tree. Every
    result is the best rate a brute-force search over the other sequences' sizes finds."""
    seconds = RISING[:24]
    gains = [[0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2]] * 4
    assert sum(batch_tree_sizes(seconds, gains, [0.0] * 4)) == 8
    assert batch_tree_sizes(seconds, gains, [0.0] * 4, [6, None, None, None]) == [6, 1, 1, 1]
    assert batch_tree_sizes(seconds, gains, [0.0] * 4, [3, None, 2, None]) == [3, 2, 2, 1]
    assert batch_tree_sizes(seconds, gains, [9.0] * 4, [3, None, None, None]) == [3, 1, 1, 1]
    assert batch_tree_sizes(seconds[:4], gains, [0.0] * 4, [8, None, None, None]) == [8, 1, 1, 1]
    assert batch_tree_sizes(seconds, [[], [0.9]], [0.0] * 2, [1, None]) == [1, 2]
    with pytest.raises(ValueError, match="one entry per sequence"):
        batch_tree_sizes(seconds, gains, [0.0] * 4, [None])
    generator = torch.Generator().manual_seed(0)
    for _ in range(40):
        b = int(torch.randint(1, 5, (1,), generator=generator))
        gains = [sorted(torch.rand(int(torch.randint(0, 4, (1,), generator=generator)), generator=generator).tolist(),
                        reverse=True) for _ in range(b)]
        fixed = [len(g) + 1 if torch.rand(1, generator=generator) < 0.4 else None for g in gains]
        cost = torch.cumsum(torch.rand(14, generator=generator) * 0.4, 0) + 1
        seconds = cost.tolist()
        sizes = batch_tree_sizes(seconds, gains, [0.0] * b, fixed)
        assert all(f is None or n == f for n, f in zip(sizes, fixed))
        rate = (b + sum(sum(g[:n - 1]) for g, n in zip(gains, sizes))) / seconds[sum(sizes) - 1]
        assert rate == pytest.approx(best_rate_by_brute_force(seconds, gains, fixed))


def test_a_seeded_sampled_tree_takes_its_rows_from_the_batchs_budget(model):
    """8 cheap rows (``RISING``): a seeded sampled eagle-tree request keeps its 8-node tree, which
    spends them all, so the greedy eagle-tree requests beside it verify their roots alone until it
    ends; every request still gives what it gives alone."""
    batch = prompts(3, seed=4)
    options = [RequestOptions(method="eagle-tree", max_new_tokens=6, temperature=1.0, seed=3)] + [
        RequestOptions(method="eagle-tree", max_new_tokens=12)] * 2
    engine = ServingEngine(model, max_batch=3, row_seconds=RISING)
    beside, trees = [], {}
    for i, (ids, opts) in enumerate(zip(batch, options)):
        engine.add(i, ids, opts)
    while engine.active or engine.queued:
        events = engine.step()
        sizes = {e.request_id: e.stats.tree_size for e in events}
        if 0 in sizes and not any(e.finished and e.request_id == 0 for e in events):
            beside += [sizes[i] for i in sizes if i != 0]
        for e in events:
            trees.setdefault(e.request_id, []).extend(e.new_token_ids)
    assert beside and set(beside) == {1}
    sampled = model.generate(batch[0], method="eagle-tree", max_new_tokens=6, temperature=1.0, seed=3)
    assert trees[0] == sampled.token_ids
    for i in (1, 2):
        assert trees[i] == model.generate(batch[i], method="ar", max_new_tokens=12).token_ids


def test_request_ids_and_close(model):
    """``request_ids`` lists the running requests, then the queued ones; ``close`` drops them all
    and the engine then serves new requests as before."""
    engine = ServingEngine(model, max_batch=2, row_seconds=CHEAP)
    assert engine.request_ids == []
    for i in range(4):
        engine.add(f"r{i}", [3, 4, 5 + i], RequestOptions(method="eagle-tree", max_new_tokens=30))
    assert engine.request_ids == ["r0", "r1", "r2", "r3"]
    engine.step()
    engine.cancel("r0")
    engine.step()
    assert engine.request_ids == ["r1", "r2", "r3"] and (engine.active, engine.queued) == (2, 1)
    engine.close()
    assert engine.request_ids == [] and (engine.active, engine.queued) == (0, 0) and engine.step() == []
    assert "r1" not in engine and not engine.cancel("r1")
    [result] = generate_together(engine, [[3, 4, 6]], RequestOptions(method="eagle-tree", max_new_tokens=8))
    assert result.token_ids == model.generate([3, 4, 6], method="ar", max_new_tokens=8).token_ids


def test_rank_rates_learn_per_rank_and_stay_non_increasing():
    rates = RankRates()
    assert rates.gains(3) == pytest.approx([0.6, 0.48, 0.384])
    for _ in range(50):
        rates.record([-0.1, -0.5, -2.0], [True, False, True])  # the best and the third accepted
    gains = rates.gains(4)
    assert gains[0] > 0.9 and gains[1] < 0.1 and gains[2] <= gains[1] and gains == sorted(gains, reverse=True)


def test_load_sizing_gives_batched_ar_when_rows_are_dear(model):
    """Every extra row doubling a forward's cost: eagle-tree rounds verify the root alone."""
    engine = ServingEngine(model, max_batch=4, row_seconds=[float(2 ** n) for n in range(40)])
    results = generate_together(engine, prompts(4, seed=3), RequestOptions(method="eagle-tree", max_new_tokens=8))
    assert all(set(r.accept_lengths) == {1} for r in results)


def test_drafting_time_fades_once_per_round_whatever_the_batch(model):
    """Rows too dear to draft: each round without a draft fades a method's drafting time once
    (``DRAFT_FADE``), for 1 sequence or 6, so a large batch does not go back to drafting sooner."""
    from eagle.decoding.serving import DRAFT_FADE

    for batch in (1, 6):
        engine = ServingEngine(model, max_batch=batch, row_seconds=[float(2 ** n) for n in range(40)])
        for i, ids in enumerate(prompts(batch, seed=5)):
            engine.add(i, ids, RequestOptions(method="eagle-tree", max_new_tokens=20))
        engine._draft_seconds["eagle-tree"] = 1.0
        for rounds in range(1, 4):
            assert all(e.stats.tree_size == 1 for e in engine.step())
            assert engine._draft_seconds["eagle-tree"] == pytest.approx(DRAFT_FADE ** rounds), batch


@pytest.mark.slow
def test_batched_sampling_keeps_the_target_distribution_and_the_check_has_teeth(monkeypatch):
    """First 3 tokens of 2000 sampled eagle-tree requests of one prompt, decoded 8 at a time beside
    requests of other prompts and methods, with trees sized from the load (a full batch has 4
    cheap draft rows: some rounds draft, some verify the root alone and defer the drafter's
    update): a chi-square fit to the enumerated target distribution. The negative control
    (rejected siblings keep their mass) must fail the same check."""
    from tests.decoding.test_losslessness import PROMPT, VOCAB, chi_square_p, exact_triples, no_renormalization

    target = tiny_target(vocab_size=VOCAB, hidden=16, layers=1, init_std=0.5)
    model = EagleModel.from_pretrained(target, drafter=tiny_drafter(target), total_tokens=6, depth=3, top_k=2)
    sampling = RequestOptions(temperature=1.0).sampling
    exact = exact_triples(model, sampling)

    def counts(m: EagleModel, n: int) -> tuple[torch.Tensor, int]:
        engine = ServingEngine(m, max_batch=8, row_seconds=[1.0] * 12 + [4.0] * 52)
        found, trees, roots = torch.zeros(VOCAB, VOCAB, VOCAB), 0, 0
        for seed in range(n):
            engine.add(seed, PROMPT, RequestOptions(method="eagle-tree", max_new_tokens=3, temperature=1.0, seed=seed))
            if seed % 4 == 0:
                engine.add(("other", seed), [4, 1, 5, 2, 3][: 1 + seed % 5],
                            RequestOptions(method=("ar", "pld", "eagle-chain")[seed % 3], max_new_tokens=2 + seed % 4,
                                           temperature=1.0))
            while engine.queued > 8 or seed == n - 1 and (engine.active or engine.queued):
                for event in engine.step():
                    if not isinstance(event.request_id, tuple):
                        trees, roots = trees + (event.stats.tree_size > 1), roots + (event.stats.tree_size == 1)
                        if event.finished:
                            found[tuple(event.result.token_ids)] += 1
        return found, trees, roots

    found, trees, roots = counts(model, 2000)
    assert found.sum() == 2000 and trees > 300 and roots > 300
    assert chi_square_p(found, exact) > 1e-3
    monkeypatch.setattr(acceptance, "recursive_rejection_tree", no_renormalization)
    deterministic = EagleModel(model.target, model.drafter, tree=dataclasses.replace(model.tree, sampled_tree=False))
    assert chi_square_p(counts(deterministic, 1000)[0], exact) < 1e-3


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_pooled_rounds_on_static_shapes_are_captured_and_equal_each_request_alone(family, fake_capture, monkeypatch):
    """A pooled batch's rounds on static shapes (``PooledGraphs``, which the engine gives a pool where
    the target runs on them: ``cuda_graphs``; its drafter's pool then gets ``DrafterGraphs``): every shape
    is captured (by the CPU stand-in for CUDA capture where there is no GPU: a host tensor, a host read or
    a data-dependent shape inside fails the test) and replayed in later rounds, and each request's tokens
    and rounds are its own decoding's (Gemma-3: past its window of 6), across a growth of the pool (its
    graphs made again)."""
    # built here, after fake_capture turned the compiled CPU kernels off (a recording cannot replay them)
    target = tiny_target(eos=True, seed=10) if family == "llama" else tiny_gemma(seed=4, window=6)
    model = EagleModel.from_pretrained(target, drafter=tiny_drafter(target), total_tokens=8, depth=3, top_k=3,
                                       cuda_graphs=False, auto_length=False)  # pld alone: chains not sized by timing
    if family == "llama":  # the engine's own choice
        static = EagleModel.from_pretrained(target, drafter=tiny_drafter(target), cuda_graphs=True)
        assert ServingEngine(static, cache_pool=True)._pool.graphs is not None
        assert ServingEngine(model, cache_pool=True)._pool.graphs is None
    batch = prompts(7, seed=3)
    options = [RequestOptions(method=("eagle-tree", "ar", "eagle-tree", "pld")[i % 4], max_new_tokens=12) for i in range(7)]
    engine = ServingEngine(model, max_batch=3, load_sizing=False, cache_pool=True)
    lean = target.lean
    # a pool of 16 positions a slot: sequences outgrow it mid-run (a new buffer: the graphs made again)
    engine._pool = CachePool(len(lean.layers), 3, lean.num_kv_heads, lean.head_dim, target.dtype, target.device,
                             capacity=16)
    graphs = engine._pool.graphs = PooledGraphs(lean, engine._pool)
    buffers = set()
    grow = CachePool.grow
    monkeypatch.setattr(CachePool, "grow", lambda self, end: grow(self, end) or buffers.add(self.kv.data_ptr()))
    calls, drafter_calls = [], []
    monkeypatch.setattr(PooledGraphs, "__call__",
                        lambda self, *a, run=PooledGraphs.__call__: calls.append(len(a[0])) or run(self, *a))
    monkeypatch.setattr(DrafterGraphs, "__call__",
                        lambda self, *a, run=DrafterGraphs.__call__: drafter_calls.append(len(a[3])) or run(self, *a))
    results = generate_together(engine, batch, options)
    for ids, opts, result in zip(batch, options, results):
        alone = model.generate(ids, method=opts.method, max_new_tokens=12)
        assert result.token_ids == alone.token_ids, opts.method
        assert result.accept_lengths == alone.accept_lengths
    assert len(calls) > len(graphs.shapes) and any(n > 3 for n in calls)  # shapes replayed; trees among the rows
    assert graphs.fallbacks == 0 and engine._pool.capacity > 16 and len(buffers) > 1
    assert graphs.captured > len(graphs.shapes)  # grown mid-run: the shapes made for the old buffer made again
    (_, draft_pool), = engine._draft_pools.values()  # the drafter's calls on static shapes too, sequences together
    assert draft_pool.graphs.fallbacks == 0 and draft_pool.graphs.captured > 0 and max(drafter_calls) > 1
    assert len(drafter_calls) > draft_pool.graphs.captured  # shapes replayed


def test_sequences_of_a_graphed_drafter_keep_caches_of_their_own(fake_capture):
    """A target on static shapes gives its drafter static shapes too, with ONE cache for one sequence at a
    time (``cuda_graphs.GraphedDrafter.new_cache``): a batch of per-sequence caches gives each sequence a
    drafter cache of its own, so four eagle-tree requests together draft and accept what each does alone."""
    target = tiny_target(eos=True, seed=10)
    model = EagleModel.from_pretrained(target, drafter=tiny_drafter(target), total_tokens=8, depth=3, top_k=3,
                                       cuda_graphs=True)
    batch = prompts(4, seed=7)
    engine = ServingEngine(model, max_batch=4, load_sizing=False, cache_pool=False)
    assert_batch_decodes_as_alone(model, engine, batch)


class DeviceReads(TorchDispatchMode):
    """Counts what makes the host wait for a GPU: a value read or a data-dependent size of a device tensor
    (``fake_capture.syncs``), or a copy from the device to the host."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        on_device = any(isinstance(a, torch.Tensor) and a.device.type != "cpu" for a in args)
        out = func(*args, **kwargs)
        to_host = isinstance(out, torch.Tensor) and out.device.type == "cpu"
        self.count += on_device and (syncs(func, args, kwargs) or to_host)
        return out


def device_reads(engine: ServingEngine, monkeypatch, rounds: int) -> int:
    """The device reads (``DeviceReads``, and ``tolist`` of a device tensor) of ``rounds`` rounds of ``engine``'s
    eight running sequences, after one uncounted round."""
    engine.step()
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(self.device.type != "cpu") or tolist(self))
    with DeviceReads() as counter:
        for _ in range(rounds):
            assert len(engine.step()) == 8
    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    return counter.count + sum(reads)


@pytest.mark.skipif(device_under_test().type != "cuda", reason="counts reads of a GPU's tensors")
def test_a_batched_greedy_round_reads_the_device_twice(monkeypatch):
    """Eight greedy sequences (``ar``, ``pld``) in a pooled round: the trees come to the host in one copy,
    the argmaxes in another; acceptance and compaction read nothing more from the device."""
    target = tiny_target(eos=False, seed=10)
    model = EagleModel.from_pretrained(target, drafter=tiny_drafter(target), auto_length=False)
    engine = ServingEngine(model, max_batch=8, load_sizing=False, cache_pool=True)
    for i, ids in enumerate(prompts(8, seed=2)):
        engine.add(i, ids, RequestOptions(method=("ar", "pld")[i % 2], max_new_tokens=20))
    assert device_reads(engine, monkeypatch, rounds=3) <= 2 * 3


@pytest.mark.skipif(device_under_test().type != "cuda", reason="counts reads of a GPU's tensors")
def test_a_batched_eagle_round_reads_the_device_twice_for_all_sequences(monkeypatch):
    """Eight greedy eagle-tree sequences in a pooled round (trees of 3 levels): the trees grow together on
    the device (``batch_trees``) and their best nodes come to the host in one copy for all, the argmaxes
    in one more; nothing else is read, however many sequences draft."""
    target = tiny_target(eos=False, seed=10)
    model = EagleModel.from_pretrained(target, drafter=tiny_drafter(target), total_tokens=8, depth=3, top_k=3,
                                       lookup_tokens=0)
    engine = ServingEngine(model, max_batch=8, load_sizing=False, cache_pool=True)
    for i, ids in enumerate(prompts(8, seed=2)):
        engine.add(i, ids, RequestOptions(method="eagle-tree", max_new_tokens=20))
    assert device_reads(engine, monkeypatch, rounds=3) <= 2 * 3
