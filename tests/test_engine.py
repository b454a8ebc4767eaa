"""The engine on tiny random models: greedy identity for every method, stops, budgets, caches."""

import dataclasses

import pytest
import torch
from transformers import DynamicCache

from eagle import EagleError, EagleModel
from eagle.runtime import kv_cache
from eagle.config import SamplingConfig, TreeConfig
from eagle.decoding.loop import truncate_at_stop

from tests.conftest import prompts, tiny_drafter, tiny_target


@pytest.fixture(scope="module")
def model(target, drafter):
    draft = tiny_target(seed=5, hidden=16, layers=1)
    return EagleModel.from_pretrained(target, drafter=drafter, draft_model=draft.model, total_tokens=12, depth=4,
                                      top_k=3, gamma=3, auto_length=False)  # pld's chains not sized by timing


@pytest.fixture(scope="module")
def eagle3_model(eagle3_target, eagle3_drafter):
    return EagleModel.from_pretrained(eagle3_target, drafter=eagle3_drafter, total_tokens=12, depth=4, top_k=3)


@pytest.mark.parametrize("kind, method", [("eagle", "pld"), ("eagle", "sd"), ("eagle", "eagle-chain"),
                                          ("eagle", "eagle-tree"), ("eagle3", "eagle-chain"), ("eagle3", "eagle-tree")])
def test_greedy_matches_ar_on_20_prompts(request, kind, method):
    """With the default prompt-lookup grafts; ``kind``: the drafter's (EAGLE-1/2 or EAGLE-3)."""
    model = request.getfixturevalue("model" if kind == "eagle" else "eagle3_model")
    gained = 0
    for ids in prompts(20):
        ref = model.generate(ids, method="ar", max_new_tokens=24)
        out = model.generate(ids, method=method, max_new_tokens=24)
        assert out.token_ids == ref.token_ids, (method, ids)
        assert sum(out.accept_lengths) == len(out.token_ids)
        assert out.target_forwards == len(out.accept_lengths)
        gained += max(out.accept_lengths)
    assert gained > 20  # drafts were really accepted sometimes, not only bonus tokens


def test_adaptive_gamma_is_still_exact(model, monkeypatch):
    from eagle.decoding.proposers import DraftModel

    gammas = []
    propose = DraftModel.propose

    def spy(self, *args, **kwargs):
        gammas.append(self.gamma)
        return propose(self, *args, **kwargs)

    monkeypatch.setattr(DraftModel, "propose", spy)
    adaptive = EagleModel(model.target, draft_model=model.draft_model,  # full chains: gamma's own rule
                          speculative=dataclasses.replace(model.speculative, adaptive_gamma=True, draft_confidence=0.0))
    for ids in prompts(5, seed=3):
        assert adaptive.generate(ids, method="sd", max_new_tokens=20).token_ids == \
            model.generate(ids, method="ar", max_new_tokens=20).token_ids
    # a random draft model is often rejected early: gamma (3) shrinks
    assert min(gammas) < model.speculative.gamma
    # a perfect draft (the target itself) is always accepted: gamma grows by 2 a round up to max_gamma
    t = model.target
    perfect = EagleModel(t, draft_model=t.model, drafter_dtype=t.dtype,
                         speculative=dataclasses.replace(model.speculative, gamma=4, max_gamma=9, adaptive_gamma=True,
                                                           draft_confidence=0.0))
    out = perfect.generate([3, 4, 5], method="sd", max_new_tokens=60)
    assert out.accept_lengths[:5] == [5, 7, 9, 10, 10]
    fixed = EagleModel(t, draft_model=t.model, speculative=dataclasses.replace(model.speculative, gamma=4,
                                                                               draft_confidence=0.0),
                       drafter_dtype=t.dtype)
    assert fixed.generate([3, 4, 5], method="sd", max_new_tokens=40).accept_lengths[:5] == [5] * 5


def test_accepted_drafts_with_a_self_draft():
    """The target drafting for itself (in its own precision) accepts everything: gamma + 1 tokens per forward."""
    t = tiny_target()
    m = EagleModel.from_pretrained(t, draft_model=t.model, gamma=4, drafter_dtype=t.dtype, draft_confidence=0.0)
    out = m.generate([3, 4, 5], method="sd", max_new_tokens=21)
    assert out.accept_lengths[:4] == [5, 5, 5, 5] and len(out.token_ids) == 21


def test_max_new_tokens_is_never_exceeded(model):
    for method in ["ar", "pld", "sd", "eagle-tree"]:
        for limit in (1, 2, 5, 7):
            out = model.generate([1, 2, 3, 1, 2, 3], method=method, max_new_tokens=limit)
            assert len(out.token_ids) == limit and out.stop_reason == "length"


def test_eos_inside_an_accepted_chunk_stops_exactly_there():
    assert truncate_at_stop([5, 0, 7, 8], frozenset({0}), 10) == ([5, 0], "eos")
    assert truncate_at_stop([5, 6, 7, 8], frozenset({0}), 2) == ([5, 6], "length")
    assert truncate_at_stop([5, 6], frozenset({0}), 10) == ([5, 6], "")
    t = tiny_target(eos=True, seed=3)
    m = EagleModel.from_pretrained(t, drafter=tiny_drafter(t), draft_model=t.model, gamma=6, total_tokens=10,
                                   depth=4, top_k=3)
    stopped = 0
    for ids in prompts(20, seed=1, low=1):
        ref = m.generate(ids, method="ar", max_new_tokens=40)
        for method in ["sd", "eagle-tree", "pld"]:
            out = m.generate(ids, method=method, max_new_tokens=40)
            assert out.token_ids == ref.token_ids
            if 0 in out.token_ids:
                assert out.token_ids.index(0) == len(out.token_ids) - 1 and out.stop_reason == "eos"
                stopped += 1
    assert stopped > 0


def test_tree_near_the_context_end_is_clipped(model):
    small = tiny_target(max_positions=20)
    m = EagleModel.from_pretrained(small, drafter=tiny_drafter(small), draft_model=small.model, total_tokens=12,
                                   depth=5, top_k=3)
    ref = m.generate(list(range(1, 15)), method="ar", max_new_tokens=50)
    assert ref.stop_reason == "context" and len(ref.token_ids) == 20 - 14
    for method in ["pld", "sd", "eagle-tree", "eagle-chain"]:
        out = m.generate(list(range(1, 15)), method=method, max_new_tokens=50)
        assert out.token_ids == ref.token_ids


def test_compacted_cache_equals_recomputed_cache(target):
    dev = target.device
    torch.manual_seed(0)
    prefix = torch.randint(1, 32, (1, 6), device=dev)
    cache = DynamicCache(config=target.model.config)
    target.forward(prefix, torch.arange(6, device=dev)[None], cache)
    # a tree: root 0 -> 1 -> 3, and a sibling branch 2
    tokens = torch.tensor([[4, 9, 11, 12]], device=dev)
    parents = torch.tensor([-1, 0, 0, 1])
    from eagle.decoding.tree_mask import tree_attention
    from eagle.runtime.masks import attention_bias
    attn = tree_attention(parents)
    bias = attention_bias(attn.mask, 6, torch.float32).to(dev)
    target.forward(tokens, (6 + attn.depths)[None].to(dev), cache, bias)
    kv_cache.compact(cache, 6, torch.tensor([6, 7, 9]))
    ref = DynamicCache(config=target.model.config)
    kept = torch.tensor([[4, 9, 12]], device=dev)
    target.forward(torch.cat([prefix, kept], 1), torch.arange(9, device=dev)[None], ref)
    assert kv_cache.cache_length(cache) == 9
    for got, want in zip(cache.layers, ref.layers):
        assert torch.allclose(got.keys, want.keys, atol=1e-5) and torch.allclose(got.values, want.values, atol=1e-5)


def test_stream_yields_the_same_text(model):
    stream = model.generate([3, 4, 5, 6], method="eagle-tree", max_new_tokens=12, stream=True)
    pieces = list(stream)
    assert "".join(pieces) == stream.result.text
    assert stream.result.token_ids == model.generate([3, 4, 5, 6], method="ar", max_new_tokens=12).token_ids


def test_seeded_sampling_is_reproducible(model):
    a = model.generate([3, 4, 5], method="eagle-tree", max_new_tokens=16, temperature=1.0, seed=7)
    b = model.generate([3, 4, 5], method="eagle-tree", max_new_tokens=16, temperature=1.0, seed=7)
    assert a.token_ids == b.token_ids


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(method="beam"), "unknown method"),
])
def test_bad_generation_options_are_clear_errors(model, kwargs, message):
    with pytest.raises(EagleError, match=message):
        model.generate([1, 2, 3], **kwargs)


def test_bad_prompts_and_tree_options_are_clear_errors(model, target):
    with pytest.raises(EagleError, match="empty prompt"):
        model.generate([], method="ar")
    with pytest.raises(EagleError, match="empty prompt"):
        model.generate("   ", method="ar")
    with pytest.raises(EagleError, match="context"):
        model.generate(list(range(1, 30)) * 10, method="ar")
    for field in ("total_tokens", "top_k"):
        with pytest.raises(EagleError, match=field):
            TreeConfig(**{field: 0})
    with pytest.raises(EagleError, match="depth"):
        TreeConfig(depth=-1)
    with pytest.raises(EagleError, match="lookup_tokens"):
        TreeConfig(lookup_tokens=-1)
    with pytest.raises(EagleError, match="draw_temperature_scale"):
        TreeConfig(draw_temperature_scale=0.0)
    with pytest.raises(EagleError, match="needs a drafter"):
        EagleModel(target).generate([1, 2], method="eagle-tree")
    with pytest.raises(EagleError, match="needs a draft model"):
        EagleModel(target).generate([1, 2], method="sd")


def test_auto_total_tokens_is_exact_and_within_budget(target, drafter, monkeypatch, tmp_path):
    import eagle.decoding.tree_sizing

    monkeypatch.setenv("EAGLE_CACHE", str(tmp_path))
    monkeypatch.setattr(eagle.decoding.tree_sizing, "NOISY", float("inf"))  # sub-millisecond timings of a tiny model are noisy
    monkeypatch.setattr(eagle.decoding.tree_sizing, "_MEASURED", {})  # a curve kept in memory by an earlier test
    auto = EagleModel.from_pretrained(target, drafter=drafter, total_tokens="auto", depth=4, top_k=3,
                                      lookup_tokens=0)
    for ids in prompts(5, seed=4):
        out = auto.generate(ids, method="eagle-tree", max_new_tokens=16)
        assert out.token_ids == auto.generate(ids, method="ar", max_new_tokens=16).token_ids
    assert list((tmp_path / "cost").glob("*.json"))  # the measured curve is cached

    # the tree verified each round (its size recorded by the sizing) is what the cost curve pays for
    # on a target whose rounds take what the curve says they take (then the sizing's refit keeps it)
    sizes = []
    record = eagle.decoding.tree_sizing.Sizing.record_round

    def sizes_under(seconds_of: callable) -> list[int]:
        curve = eagle.decoding.tree_sizing.CostCurve(list(eagle.decoding.tree_sizing.SIZES), [seconds_of(n) for n in eagle.decoding.tree_sizing.SIZES])
        monkeypatch.setattr(eagle.decoding.tree_sizing, "cost_curve", lambda target, greedy=False: curve)
        monkeypatch.setattr(eagle.decoding.tree_sizing.Sizing, "record_round",
                            lambda self, size, seconds: (sizes.append(size), record(self, size, seconds_of(size))))
        model = EagleModel(target, drafter, tree=TreeConfig(total_tokens="auto", depth=4, top_k=3, lookup_tokens=0),
                           drafter_quant="none")
        sizes.clear()
        for ids in prompts(3, seed=4):
            out = model.generate(ids, method="eagle-tree", max_new_tokens=16)
            assert out.token_ids == model.generate(ids, method="ar", max_new_tokens=16).token_ids
            assert max(out.accept_lengths) <= max(sizes[-len(out.accept_lengths):])  # accepted within the tree
        return list(sizes)

    # (the curves are in seconds, so that the drafter's own time, milliseconds, hardly counts)
    # each token past the first costs 100 s: no draft pays for that, every round verifies the root alone
    assert set(sizes_under(lambda n: 0.001 + 100.0 * (n - 1))) == {1}
    # tokens cost nothing more: trees as large as the drafted pool (root, 3 children, 4 expansions of 3 x 3)
    free = sizes_under(lambda n: 100.0)
    assert sum(free) / len(free) > 8 and max(free) <= 1 + 3 + 4 * 9
    # a budget: 4 tokens cost as 1, each past them 100 s more (5 tokens never pay: their rate is at most half)
    budget = sizes_under(lambda n: 100.0 * max(1, n - 3))
    assert max(budget) == 4


def test_static_tree_from_choices_is_exact(kind_pair):
    target, drafter = kind_pair
    choices = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]]
    static = EagleModel.from_pretrained(target, drafter=drafter, total_tokens=20, choices=choices)
    gained = 0
    for ids in prompts(10, seed=6):
        out = static.generate(ids, method="eagle-tree", max_new_tokens=20)
        assert out.token_ids == static.generate(ids, method="ar", max_new_tokens=20).token_ids
        gained += max(out.accept_lengths)
    assert gained > 10
    with pytest.raises(EagleError, match="choices"):
        TreeConfig(choices=[[]])


def test_tree_settings_that_cannot_work_are_clear_errors(target):
    small_vocab = tiny_drafter(target, draft_vocab_size=4)
    with pytest.raises(EagleError, match="exceeds the drafter's vocabulary"):
        EagleModel.from_pretrained(target, drafter=small_vocab, top_k=5).generate([1, 2], method="eagle-tree")
    with pytest.raises(EagleError, match="lacks its parent"):
        TreeConfig(choices=[[0, 0]])


def test_eagle_chain_ignores_static_choices(target, drafter):
    m = EagleModel.from_pretrained(target, drafter=drafter, depth=3, choices=[[0], [1], [0, 0]])
    chain = m._proposer("eagle-chain", SamplingConfig(), None)
    assert chain.cfg.choices is None and chain.cfg.top_k == 1


def test_sliding_window_models_are_refused():
    t = tiny_target(family="mistral")
    t.model.config.sliding_window = 4
    with pytest.raises(EagleError, match="sliding-window"):
        EagleModel(t).generate([1, 2, 3], method="ar")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_drafters_precision_never_changes_the_output(target, drafter, dtype):
    model = EagleModel.from_pretrained(target, drafter=drafter, draft_model=tiny_target(seed=5, hidden=16, layers=1).model,
                                       total_tokens=12, depth=4, top_k=3, drafter_dtype=dtype)
    proposer = model._proposer("eagle-tree", SamplingConfig(), torch.Generator())
    h = torch.zeros(1, 1, target.hidden_size, dtype=dtype, device=target.device)
    pos = torch.zeros(1, 1, dtype=torch.long, device=target.device)
    assert proposer.dtype == dtype and proposer.drafter(h, h, pos).dtype == dtype
    draft_lm = model._proposer("sd", SamplingConfig(), torch.Generator()).model.model  # the module's inference copy
    assert {p.dtype for p in draft_lm.parameters()} == {dtype} and draft_lm is not model.draft_model
    for ids in prompts(10, seed=3):
        expected = model.generate(ids, method="ar", max_new_tokens=24).token_ids
        for method in ("eagle-tree", "sd"):
            assert model.generate(ids, method=method, max_new_tokens=24).token_ids == expected


def test_the_drafter_runs_in_bf16_on_a_cpu_that_multiplies_bf16_natively(target, monkeypatch):
    from eagle import engine as model_module

    if target.device.type != "cpu":
        pytest.skip("the drafter's dtype on a CPU")
    monkeypatch.setattr(model_module, "cpu_has_fast_bf16", lambda: True)
    assert model_module.default_drafter_dtype(target) == torch.bfloat16
    monkeypatch.setattr(model_module, "cpu_has_fast_bf16", lambda: False)
    assert model_module.default_drafter_dtype(target) == torch.float32
    assert EagleModel(target).drafter_dtype == torch.float32


def test_the_drafter_is_quantized_to_8_bits_where_the_compiled_kernels_run(target, drafter, monkeypatch):
    """By default an fp32 target on a CPU with the compiled kernels drafts with a q8_0 drafter (not
    when a drafter dtype is asked for, nor where the kernels do not run); "none" turns it off; the
    output is the target's with each format."""
    from eagle import engine as model_module

    if target.device.type != "cpu":
        pytest.skip("the drafter's quantization on a CPU")
    monkeypatch.setattr(model_module, "stream_linear_op", lambda: object())
    assert EagleModel(target).drafter_quant == "q8_0"
    assert EagleModel(target, drafter_dtype=torch.bfloat16).drafter_quant is None
    assert EagleModel(target, drafter_quant="none").drafter_quant is None
    monkeypatch.setattr(model_module, "stream_linear_op", lambda: None)
    assert EagleModel(target).drafter_quant is None
    with pytest.raises(EagleError, match="unknown drafter quantization 'q3'"):
        EagleModel(target, drafter_quant="q3")
    for quant in ("q8_0", "q4_1"):
        model = EagleModel.from_pretrained(target, drafter=drafter, total_tokens=12, depth=4, top_k=3,
                                           drafter_quant=quant)
        proposer = model._proposer("eagle-tree", SamplingConfig(), torch.Generator())
        assert proposer.drafter.quant == quant and proposer.dtype == torch.float32
        for ids in prompts(6, seed=4):
            assert model.generate(ids, method="eagle-tree", max_new_tokens=24).token_ids == \
                model.generate(ids, method="ar", max_new_tokens=24).token_ids
        lean = proposer.drafter  # where streamed, the codes alone: no fp32 copy of a quantized matrix
        for linear in [lean.fc, lean.lm_head] + [m for layer in lean.layers for m in layer.matrices()]:
            if linear is not None and linear.stream_op is not None and linear.in_features % 32 == 0:
                assert linear.encoded is not None and linear.weight is None and linear.plain_weight is None


def test_a_model_with_other_tree_options_shares_the_inference_copies(target, drafter):
    """``with_tree``: other tree options over the same weights; the drafter's inference copy is made
    once for both, and each decodes as a model built with those options."""
    model = EagleModel.from_pretrained(target, drafter=drafter, total_tokens=12, depth=4, top_k=3)
    view = model.with_tree(TreeConfig(total_tokens=6, depth=3, top_k=2))
    copy = model._proposer("eagle-tree", SamplingConfig(), torch.Generator()).drafter
    assert view._proposer("eagle-tree", SamplingConfig(), torch.Generator()).drafter is copy
    alone = EagleModel.from_pretrained(target, drafter=drafter, total_tokens=6, depth=3, top_k=2)
    for ids in prompts(3, seed=5):
        out = view.generate(ids, method="eagle-tree", max_new_tokens=16)
        assert out.token_ids == alone.generate(ids, method="ar", max_new_tokens=16).token_ids
        assert out.accept_lengths == alone.generate(ids, method="eagle-tree", max_new_tokens=16).accept_lengths
