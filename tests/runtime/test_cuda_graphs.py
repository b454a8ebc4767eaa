"""The static decoding path (``eagle.runtime.cuda_graphs``): bucketed, padded, static-cache forwards of the
target and the drafter give what the plain lean forwards give; on CUDA, replayed graphs give what
the same path gives eagerly."""

from __future__ import annotations

import pytest
import torch

from eagle.runtime.cuda_graphs import GraphCache, TargetGraphs, bucket_for, keys_for, with_graphs
from eagle.runtime.kv_cache import StaticCache
from eagle.engine import EagleModel
from eagle.runtime.target import use_cuda_graphs
from eagle.decoding.tree_mask import tree_attention
from eagle.runtime.masks import attention_bias
from eagle.runtime.shapes import MIN_KEYS
from tests.conftest import prompts, tiny_drafter, tiny_target
from tests.conftest import test_device as device_under_test

cuda = pytest.mark.skipif(device_under_test().type != "cuda", reason="needs EAGLE_TEST_DEVICE=cuda")


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def pair(request):
    target = tiny_target(family=request.param, seed=3)
    return target, tiny_drafter(target, seed=4)


def models(target, drafter, **options):
    plain = EagleModel.from_pretrained(target, drafter=drafter, cuda_graphs=False, **options)
    static = EagleModel.from_pretrained(target, drafter=drafter, cuda_graphs=True, **options)
    return plain, static


def test_buckets_and_key_lengths():
    assert [bucket_for(n) for n in (1, 2, 3, 5, 16, 17, 64)] == [1, 2, 4, 8, 16, 32, 64]
    assert bucket_for(65) is None
    assert keys_for(10, 4096) == 64 and keys_for(65, 4096) == 128 and keys_for(257, 4096) == 512 and keys_for(5000, 4200) == 4200


def assert_static_path_gives_the_plain_paths_greedy_tokens(target, drafter, method: str) -> None:
    plain, static = models(target, drafter, total_tokens=12, depth=4)
    assert static.target.graphs is not None and plain.target.graphs is None
    for ids in prompts(5, seed=5):
        want = plain.generate(ids, method=method, max_new_tokens=16)
        got = static.generate(ids, method=method, max_new_tokens=16)
        assert got.token_ids == want.token_ids
        assert got.accept_lengths == want.accept_lengths  # the drafter's trees are the same too


@pytest.mark.parametrize("method", ["ar", "eagle-tree", "eagle-chain"])
def test_static_path_gives_the_plain_paths_greedy_tokens(pair, method):
    assert_static_path_gives_the_plain_paths_greedy_tokens(*pair, method)


@pytest.mark.parametrize("method", ["eagle-tree", "eagle-chain"])
def test_static_path_gives_the_plain_paths_greedy_tokens_with_an_eagle3_drafter(eagle3_target, eagle3_drafter,
                                                                               method):
    assert_static_path_gives_the_plain_paths_greedy_tokens(eagle3_target, eagle3_drafter, method)


@torch.inference_mode()
def test_a_graphed_eagle3_drafter_computes_what_the_lean_drafter_does(eagle3_drafter):
    """``GraphedDrafter`` over an EAGLE-3 ``LeanDrafter`` (captured graphs on CUDA, else the same
    static path eagerly), as the tree proposer calls it: committed target features [.., 4 H]
    (padded to a bucket), two tree levels of its own hidden states [.., H] under a tree mask, the
    cache rolled back and extended again (a shape replayed): the lean drafter's outputs."""
    from eagle.runtime.masks import additive_bias
    from eagle.drafting.drafter import LeanDrafter
    from eagle.runtime.cuda_graphs import GraphedDrafter

    lean = LeanDrafter(eagle3_drafter)
    graphed = GraphedDrafter(LeanDrafter(eagle3_drafter), 64, capture=device_under_test().type == "cuda")
    dev, h = lean.fc.weight.device, eagle3_drafter.config.hidden_size
    gen = torch.Generator().manual_seed(0)
    feats, embeds = torch.randn(1, 16, 4 * h, generator=gen).to(dev), torch.randn(1, 16, h, generator=gen).to(dev)
    own = torch.randn(1, 3, h, generator=gen).to(dev)  # level-1 inputs: the root's prediction, as the proposer feeds it
    plain_cache, cache = lean.new_cache(), graphed.new_cache()

    def both(features, tokens, positions, allowed=None):
        bias = None if allowed is None else additive_bias(allowed.to(dev), lean.dtype)
        want = lean(features, tokens, positions, plain_cache, bias)
        got = graphed(features, tokens, positions, cache, bias)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
        assert cache.get_seq_length() == plain_cache.get_seq_length()
        return want

    for _ in range(2):  # the second time each shape is replayed
        plain_cache.truncate(0)
        cache.set_length(0)
        both(feats[:, :5], embeds[:, :5], torch.arange(5, device=dev)[None])
        level1 = both(own, embeds[:, 5:8], torch.full((1, 3), 5, device=dev),
                      torch.cat([torch.ones(3, 5, dtype=torch.bool), torch.eye(3, dtype=torch.bool)], 1))
        allowed = torch.zeros(2, 10, dtype=torch.bool)  # a child of level-1 node 0 and one of node 2
        allowed[:, :5] = True
        allowed[0, [5, 8]] = allowed[1, [7, 9]] = True
        both(level1[:, [0, 2]], embeds[:, 8:10], torch.full((1, 2), 6, device=dev), allowed)
        plain_cache.truncate(5)
        cache.set_length(5)
        both(feats[:, 5:7], embeds[:, 10:12], torch.arange(5, 7, device=dev)[None])
    assert graphed.runner.captured > 0 or device_under_test().type != "cuda"


def test_static_path_keeps_seeded_sampling(pair):
    """Sampling is untouched: the same seed draws the same tokens (hence the same distribution)."""
    target, drafter = pair
    plain, static = models(target, drafter, total_tokens=10, depth=3)
    for ids in prompts(4, seed=6):
        for method in ("ar", "eagle-tree"):
            want = plain.generate(ids, method=method, max_new_tokens=20, temperature=1.0, seed=11)
            got = static.generate(ids, method=method, max_new_tokens=20, temperature=1.0, seed=11)
            assert got.token_ids == want.token_ids


def test_auto_tree_sizes_on_the_static_path_stay_exact(pair):
    target, drafter = pair
    plain, static = models(target, drafter, total_tokens="auto", depth=4, top_k=3)
    for ids in prompts(4, seed=7):
        assert static.generate(ids, method="eagle-tree", max_new_tokens=20).token_ids == \
            plain.generate(ids, method="ar", max_new_tokens=20).token_ids


def test_cost_curves_on_static_shapes_are_measured_at_the_bucket_steps(target):
    from eagle.decoding.tree_sizing import cost_curve

    static = with_graphs(target, capture=False)
    assert static.graphs.curve_sizes() == (1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64)
    assert cost_curve(static, greedy=True).sizes == list(static.graphs.curve_sizes())


@torch.inference_mode()  # as in decoding: the caches' tensors are inference tensors
def test_padded_tree_forward_equals_the_lean_forward(pair):
    """A tree of 5 nodes after a prefix, padded to 8 rows, and later a tree of 3 rows: hidden states
    and aux features as the lean forward computes them, and the kept keys/values equal."""
    target, _ = pair
    static = with_graphs(target, capture=False)
    runner: TargetGraphs = static.graphs
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(1, target.vocab_size, (1, 9), generator=gen).to(target.device)
    plain_cache, cache = target.lean.new_cache(), static.new_cache()
    assert isinstance(cache, GraphCache)
    pos = torch.arange(9, device=target.device)[None]
    a = target.lean.forward(prefix, pos, plain_cache, aux_layers=(0,))
    b = runner.forward(prefix, pos, cache, aux_layers=(0,))
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    for parents in ([-1, 0, 0, 1, 1], [-1, 0, 1]):
        parents = torch.tensor(parents, device=target.device)
        past = plain_cache.get_seq_length()
        tree = tree_attention(parents)
        tokens = torch.randint(1, target.vocab_size, (1, parents.shape[0]), generator=gen).to(target.device)
        bias = attention_bias(tree.mask, past, target.dtype)
        a = target.lean.forward(tokens, (past + tree.depths)[None], plain_cache, bias)
        b = runner.forward(tokens, (past + tree.depths)[None], cache, bias)
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        keep = past + tree.paths[-1][tree.paths[-1] >= 0]
        plain_cache.compact(past, keep)
        cache.compact(past, keep)
        assert cache.get_seq_length() == plain_cache.get_seq_length()
        n = cache.get_seq_length()
        for i in range(len(target.lean.layers)):
            torch.testing.assert_close(cache.keys[i][..., :n, :], plain_cache.keys[i][..., :n, :], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(cache.values[i][..., :n, :], plain_cache.values[i][..., :n, :], rtol=1e-4,
                                       atol=1e-4)


def test_graph_cache_compacts_like_the_static_cache():
    gen = torch.Generator().manual_seed(1)
    graph = GraphCache(3, 2, 4, 32, torch.float32, torch.device("cpu"))
    plain = StaticCache(3)
    for i in range(3):
        k, v = torch.randn(2, 1, 2, 10, 4, generator=gen)
        graph.update(i, k, v)
        plain.update(i, k, v)
    keep = torch.tensor([4, 6, 9])
    graph.compact(4, keep)
    plain.compact(4, keep)
    for i in range(3):
        assert torch.equal(graph.keys[i][..., :7, :], plain.keys[i][..., :7, :])
        assert torch.equal(graph.values[i][..., :7, :], plain.values[i][..., :7, :])
    assert graph.get_seq_length() == 7


def test_the_option_selects_the_path(target):
    assert use_cuda_graphs(target, None).graphs is None or target.device.type == "cuda"
    assert use_cuda_graphs(target, False).graphs is None
    on = use_cuda_graphs(target, True)
    assert isinstance(on.graphs, TargetGraphs) and on.graphs.capture == (target.device.type == "cuda")
    assert use_cuda_graphs(on, True) is on and use_cuda_graphs(on, False).graphs is None
    with pytest.raises(Exception, match="lean forward"):
        use_cuda_graphs(tiny_target(lean=False), True)


def test_a_cache_too_small_is_a_clear_error(target):
    small = with_graphs(target, capture=False, capacity=8, buckets=(1, 2, 4))
    model = EagleModel.from_pretrained(small, cuda_graphs=True)
    with pytest.raises(Exception, match="static KV cache holds"):
        model.generate(list(range(1, 8)), method="ar", max_new_tokens=20)


@cuda
@pytest.mark.parametrize("method", ["ar", "eagle-tree"])
def test_graph_replay_equals_the_eager_static_path(pair, method):
    assert_graph_replay_equals_the_eager_static_path(*pair, method)


@cuda
def test_graph_replay_with_an_eagle3_drafter_equals_the_eager_static_path(eagle3_target, eagle3_drafter):
    assert_graph_replay_equals_the_eager_static_path(eagle3_target, eagle3_drafter, "eagle-tree")


def assert_graph_replay_equals_the_eager_static_path(target, drafter, method: str) -> None:
    graphed = EagleModel.from_pretrained(with_graphs(target, capture=True), drafter=drafter, total_tokens=12, depth=4)
    eager = EagleModel.from_pretrained(with_graphs(target, capture=False), drafter=drafter, total_tokens=12, depth=4)
    assert graphed.target.graphs.capture and not eager.target.graphs.capture
    for ids in prompts(6, seed=8):
        got = graphed.generate(ids, method=method, max_new_tokens=16)
        want = eager.generate(ids, method=method, max_new_tokens=16)
        assert got.token_ids == want.token_ids
    assert graphed.target.graphs.captured > 0


@cuda
def test_graph_replay_of_a_tree_forward_equals_the_eager_one(pair):
    target, _ = pair
    outs = []
    for capture in (True, False):
        static = with_graphs(target, capture=capture)
        cache = static.new_cache()
        ids = torch.arange(1, 11, device=target.device)[None] % target.vocab_size
        static.graphs.forward(ids, torch.arange(10, device=target.device)[None], cache)
        for _ in range(2):  # the second call replays the captured graph
            cache.truncate(10)
            parents = torch.tensor([-1, 0, 0, 1], device=target.device)
            tree = tree_attention(parents)
            bias = attention_bias(tree.mask, 10, target.dtype)
            out = static.graphs.forward(ids[:, :4], (10 + tree.depths)[None], cache, bias)
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


@cuda
def test_cuda_targets_use_graphs_by_default(target):
    assert EagleModel.from_pretrained(target).target.graphs.capture


@pytest.mark.parametrize("capture", [False, True])
def test_greedy_steps_as_one_graph_each_give_plain_decoding(request, capture):
    """``ar`` on the static path: one static function a token (captured by the CPU stand-in for
    CUDA capture, or eagerly), past an attended length (256) into the next; the same tokens and stop
    reasons as plain decoding, one graph per attended length (``shapes.MIN_KEYS`` = 64 for the short
    prompt; 256, then the capacity 384, for the long one)."""
    if capture:
        request.getfixturevalue("fake_capture")
    target = tiny_target(seed=5, max_positions=320)
    plain = EagleModel.from_pretrained(target, cuda_graphs=False)
    static = EagleModel.from_pretrained(target, cuda_graphs=True)
    gen = torch.Generator().manual_seed(3)
    long = torch.randint(1, target.vocab_size, (250,), generator=gen).tolist()
    for ids, budget in ((long, 80), ([5], 6)):  # the first runs into the context's end (320)
        want = plain.generate(ids, method="ar", max_new_tokens=budget)
        got = static.generate(ids, method="ar", max_new_tokens=budget)
        assert got.token_ids == want.token_ids and got.stop_reason == want.stop_reason
        assert got.accept_lengths == [1] * len(got.token_ids) == want.accept_lengths
    steps = [key for key in static.target.graphs.shapes if key[0] == "greedy step"]
    assert sorted(key[1] for key in steps) == [MIN_KEYS, 256, static.target.graphs.cache.capacity]
    if capture or device_under_test().type == "cuda":
        assert all(static.target.graphs.shapes[key].graph is not None for key in steps)
